-- tollgate token bucket: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::token_bucket::apply exactly (integer maths in doubles,
-- every quantity below 2^53; ceil(a / b) as (a - a % b) / b (+1), exact for such numbers),
-- after the prelude's policy-change rules.
-- KEYS[1] bucket key
-- ARGV    capacity, unit, rate, max_elapsed_us (0 = none), generation, transition
--         (0 reset, 1 carry, 2 proportional, 3 defer), cost, commit (1 acquire, 0 peek)
-- record  1, generation, pending, capacity, unit, rate, max_elapsed_us, level_units, updated_us
-- returns {allowed 1/0 (-1: cost above the governing capacity, nothing written), remaining,
--          retry_after_us (-1 when allowed), reset_after_us, governing capacity}
local ok, capacity, unit, rate, max_elapsed, gen, rule, cost, commit
if #K == 1 and #A == 8 then
  ok, capacity, unit, rate, max_elapsed, gen, rule, cost, commit = pcall(numbers, 8)
end
if not (ok and capacity >= 1 and capacity <= MAX and capacity % 1 == 0 and unit >= 1
    and unit <= MAX and unit % 1 == 0 and rate >= 1 and rate <= MAX and rate % 1 == 0
    and max_elapsed >= 0 and max_elapsed <= MAX and max_elapsed % 1 == 0 and gen >= 0
    and gen <= MAX and gen % 1 == 0 and rule >= 0 and rule <= 3 and rule % 1 == 0
    and cost >= 1 and cost <= MAX and cost % 1 == 0 and (commit == 0 or commit == 1)) then
  return slow().refuse({ 'capacity', 1, MAX, 'unit', 1, MAX, 'rate', 1, MAX,
    'max_elapsed_us', 0, MAX, 'generation', 0, MAX, 'transition', 0, 3, 'cost', 1, MAX,
    'commit', 0, 1 })
end
if capacity * unit + rate > MAX then return bad('capacity * unit + rate exceeds 2^52') end
if cost > capacity then return bad('cost exceeds capacity') end

local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]

-- the governing parameters, generation and pending deferral; the stored level and time
local gcap, gunit, grate, gmax, g, pe = capacity, unit, rate, max_elapsed, gen, 0
local stored, updated, keep
local raw = redis.call('GET', K[1])
-- the record's fields, or nothing when it is malformed (a missing bucket): a non-number
-- fails its comparison inside the pcall
local function record()
  local tag, rg, rpe, rcap, runit, rrate, rmax, rlevel, rupdated, extra = cmsgpack.unpack(raw)
  if tag == 1 and rupdated and extra == nil and rg >= 0 and rg <= MAX and rpe >= 0
      and rpe <= MAX + 1 and rcap >= 1 and runit >= 1 and rrate >= 1
      and rcap * runit + rrate <= MAX and rmax >= 0 and rmax <= MAX and rlevel >= 0
      and rlevel <= MAX and rupdated >= 0 and rupdated <= MAX * 2 then
    return rg, rpe, rcap, runit, rrate, rmax, rlevel, rupdated
  end
end
local rg, rpe, rcap, runit, rrate, rmax, rlevel, rupdated
if raw then ok, rg, rpe, rcap, runit, rrate, rmax, rlevel, rupdated = pcall(record) end
if ok and rupdated then
  local same = rcap == capacity and runit == unit and rrate == rate and rmax == max_elapsed
  local newer = gen > rg or (gen == rg and not same)
  if newer and rpe <= gen and rule ~= 3 then
    -- convert: the old bucket's level now, under its own parameters; then the caller's rule
    local ocap, ncap = rcap * runit, capacity * unit
    updated = rupdated > now and rupdated or now
    local old = rlevel < ocap and rlevel or ocap
    local elapsed, d = updated - rupdated, ocap - old
    if rmax > 0 and elapsed > rmax then elapsed = rmax end
    local full = (d - d % rrate) / rrate + (d % rrate > 0 and 1 or 0)
    if elapsed >= full then old = ocap else old = old + elapsed * rrate end
    if rule == 1 then
      stored = slow().muldiv(old, unit, runit, ncap)
    elseif rule == 2 then
      stored = slow().muldiv(old, ncap, ocap, ncap)
    else
      stored = ncap
    end
  else
    -- the stored parameters govern; a newer caller with rule 3 starts a deferral
    gcap, gunit, grate, gmax, g, stored, updated = rcap, runit, rrate, rmax, rg, rlevel, rupdated
    if newer and rpe <= gen then
      pe, keep = gen + 1, true
    else
      pe, keep = rpe, rpe > 0
    end
  end
end
if cost > gcap then return { -1, 0, -1, 0, gcap } end

local cap = gcap * gunit
if not stored then stored, updated = cap, now end
local eff = updated > now and updated or now
-- refill for the elapsed time (capped), never past capacity
local level = stored < cap and stored or cap
local elapsed, d = eff - updated, cap - level
if gmax > 0 and elapsed > gmax then elapsed = gmax end
if elapsed >= (d - d % grate) / grate + (d % grate > 0 and 1 or 0) then
  level = cap
else
  level = level + elapsed * grate
end

local need = cost * gunit
local allowed, retry = 1, -1
if level >= need then
  level = level - need
else
  d = need - level
  local wait = (d - d % grate) / grate + (d % grate > 0 and 1 or 0)
  if gmax > 0 and wait > gmax then wait = gmax end
  allowed, retry = 0, (eff - now) + wait
end
d = cap - level
local reset = (eff - now) + (d - d % grate) / grate + (d % grate > 0 and 1 or 0)

if commit == 1 then
  local rec = cmsgpack.pack(1, g, pe, gcap, gunit, grate, gmax, level, eff)
  write(rec, keep, reset)
end
return { allowed, (level - level % gunit) / gunit, retry, reset, gcap }
