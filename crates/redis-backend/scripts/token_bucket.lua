-- tollgate token bucket: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::token_bucket::apply exactly (integer maths in doubles,
-- every quantity below 2^53), after the prelude's policy-change rules.
-- KEYS[1] bucket key
-- ARGV    capacity, unit, rate, max_elapsed_us (0 = none), generation, transition
--         (0 reset, 1 carry, 2 proportional, 3 defer), cost, commit (1 acquire, 0 peek)
-- record  tag 1; generation, pending, capacity, unit, rate, max_elapsed_us, level_units, updated_us
-- returns {allowed 1/0 (-1: cost above the governing capacity, nothing written), remaining,
--          retry_after_us (-1 when allowed), reset_after_us, governing capacity}
if #KEYS ~= 1 then return bad('expected 1 key') end
if #ARGV ~= 8 then
  return bad('expected 8 arguments: capacity unit rate max_elapsed_us generation transition cost commit')
end
local capacity = int(ARGV[1], 1, MAX)
if not capacity then return bad('capacity must be an integer in [1, 2^52]') end
local unit = int(ARGV[2], 1, MAX)
if not unit then return bad('unit must be an integer in [1, 2^52]') end
local rate = int(ARGV[3], 1, MAX)
if not rate then return bad('rate must be an integer in [1, 2^52]') end
local max_elapsed = int(ARGV[4], 0, MAX)
if not max_elapsed then return bad('max_elapsed_us must be an integer in [0, 2^52]') end
local gen = int(ARGV[5], 0, MAX)
if not gen then return bad('generation must be an integer in [0, 2^52]') end
local rule = int(ARGV[6], 0, 3)
if not rule then return bad('transition must be 0, 1, 2 or 3') end
local cost = int(ARGV[7], 1, MAX)
if not cost then return bad('cost must be an integer in [1, 2^52]') end
local commit = int(ARGV[8], 0, 1)
if not commit then return bad('commit must be 0 or 1') end
if capacity * unit + rate > MAX then return bad('capacity * unit + rate exceeds 2^52') end
if cost > capacity then return bad('cost exceeds capacity') end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local rec
local raw = redis.call('GET', KEYS[1])
if raw and string.byte(raw, 1) == 1 then
  local v, pos = getv(raw, 2, 8)
  if v and pos == #raw + 1 and v[1] <= MAX and v[2] <= MAX + 1 and v[3] >= 1 and v[4] >= 1
      and v[5] >= 1 and v[3] * v[4] + v[5] <= MAX and v[6] <= MAX and v[7] <= MAX
      and v[8] <= MAX * 2 then
    rec = { gen = v[1], pe = v[2], params = { v[3], v[4], v[5], v[6] }, level = v[7], updated = v[8] }
  end
end

local function level_at(cap, r, maxel, stored, updated, eff)
  stored = math.min(stored, cap)
  local elapsed = eff - updated
  if maxel > 0 and elapsed > maxel then elapsed = maxel end
  if elapsed < math.ceil((cap - stored) / r) then return stored + elapsed * r end
  return cap
end

local P = { capacity, unit, rate, max_elapsed }
local mode = plan(rec, gen, P, rule)
local g, pe, stored, updated, changed, keep = gen, 0, nil, nil, true, false
if mode == 'stored' or mode == 'defer' then
  P, g, stored, updated = rec.params, rec.gen, rec.level, rec.updated
  if mode == 'stored' then
    pe, changed, keep = rec.pe, false, rec.pe > 0
  else
    pe, keep = gen + 1, true
  end
elseif mode == 'convert' then
  local o = rec.params
  local ocap, ncap = o[1] * o[2], capacity * unit
  updated = math.max(now, rec.updated)
  local old = level_at(ocap, o[3], o[4], rec.level, rec.updated, updated)
  if rule == 1 then
    stored = muldiv(old, unit, o[2], ncap)
  elseif rule == 2 then
    stored = muldiv(old, ncap, ocap, ncap)
  else
    stored = ncap
  end
end
local gcap, gunit, grate, gmax = P[1], P[2], P[3], P[4]
if cost > gcap then return { -1, 0, -1, 0, gcap } end

local cap = gcap * gunit
if not stored then stored, updated = cap, now end
local eff = math.max(now, updated)
local level = level_at(cap, grate, gmax, stored, updated, eff)

local need = cost * gunit
local allowed, retry = 1, -1
if level >= need then
  level = level - need
else
  local wait = math.ceil((need - level) / grate)
  if gmax > 0 and wait > gmax then wait = gmax end
  allowed, retry = 0, (eff - now) + wait
end
local reset = (eff - now) + math.ceil((cap - level) / grate)

if commit == 1 then
  write(KEYS[1], string.char(1) .. putv(g) .. putv(pe) .. putv(gcap) .. putv(gunit) .. putv(grate)
    .. putv(gmax) .. putv(level) .. putv(eff), keep, reset)
end
return { allowed, math.floor(level / gunit), retry, reset, gcap }
