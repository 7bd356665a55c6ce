-- tollgate token bucket: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::token_bucket::apply exactly (integer maths in doubles,
-- every quantity below 2^53; ceil(a / b) as (a - a % b) / b (+1), exact for such numbers),
-- after the prelude's policy-change rules.
-- KEYS[1] bucket key
-- ARGV[1] head: 1, generation, 0, capacity, unit, rate, max_elapsed_us (0 = none); then
--         transition (0 reset, 1 carry, 2 proportional, 3 defer), cost, commit (1 acquire,
--         0 peek) — MessagePack integers, see the prelude
-- record  1, generation, pending, capacity, unit, rate, max_elapsed_us, level_units, updated_us
-- returns allowed 1/0 (-1: cost above the governing capacity, nothing written), remaining,
--         retry_after_us (-1 when allowed), reset_after_us, governing capacity (REPLY); most
--         admissions as one integer, remaining * 2^37 + reset_after_us (see the prelude)
-- The arguments, checked inline (see the prelude: no closure, no pcall): the head's bytes
-- and the values. A value of another type than number where the checks compare it (a
-- MessagePack string, nil, ...), or an argument that is not MessagePack, raises a Lua error
-- before anything is written; every other invalid argument is refused by `slow().refuse`.
-- capacity * unit + rate <= 2^52 bounds each of the three.
repeat -- until true: `break` leaves the block when another algorithm's record governs
local n, tag, gen, pe, capacity, unit, rate, max_elapsed, e, rule, cost, commit
if arg then
  n, tag, gen, pe, capacity, unit, rate, max_elapsed = cmsgpack.unpack_limit(arg, 7)
  if n > 0 then e, rule, cost, commit = cmsgpack.unpack_limit(arg, 3, n) end
end
if not (e == -1 and tag == 1 and pe == 0 and (commit == 0 or commit == 1) and gen >= 0
    and gen <= MAX and gen % 1 == 0 and capacity >= 1 and capacity % 1 == 0 and unit >= 1
    and unit % 1 == 0 and rate >= 1 and rate % 1 == 0 and capacity * unit + rate <= MAX
    and max_elapsed >= 0 and max_elapsed <= MAX and max_elapsed % 1 == 0
    and (rule == 0 or rule == 1 or rule == 2 or rule == 3) and cost >= 1 and cost <= capacity
    and cost % 1 == 0) then
  return slow().refuse({ 'tag', 1, 1, 'generation', 0, MAX, 'pending', 0, 0, 'capacity', 1,
    MAX, 'unit', 1, MAX, 'rate', 1, MAX, 'max_elapsed_us', 0, MAX, 'transition', 0, 3, 'cost',
    1, MAX, 'commit', 0, 1 }, function(v)
    if v[4] * v[5] + v[6] > MAX then return 'capacity * unit + rate exceeds 2^52' end
    if v[9] > v[4] then return 'cost exceeds capacity' end
  end)
end
local head = string.sub(arg, 1, n)

-- Redis time and the stored record, once per script (a redirected pass reuses them)
if not now then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
  raw = redis.call('GET', K[1])
  if raw and #raw > MAX_RECORD then raw = false end
end

-- The stored record, run by pcall (a record that is not MessagePack, or holds a non-number
-- where a number belongs, raises: a missing bucket). Captures nothing; only a stored bucket
-- pays for it. A record of the caller's own head with no deferral pending (every call but
-- those of a policy change) is recognised by its head's fields alone and gives its level and
-- time (stored, updated); any other gives all its fields, checked, for the general path, and
-- a malformed one nothing. Every field must be an integer (this crate writes no other), so
-- that every time derived from them is one (the epilogue's PXAT rounding relies on it).
local stored, updated, ok, mine, rg, rpe, rcap, runit, rrate, rmax, rlevel, rupdated
if raw then
  ok, mine, rg, rpe, rcap, runit, rrate, rmax, rlevel, rupdated = pcall(function(raw, max,
      gen, capacity, unit, rate, max_elapsed)
    local tag, rg, rpe, rcap, runit, rrate, rmax, rlevel, rupdated, extra = cmsgpack.unpack(raw)
    if tag == 1 and rg == gen and rpe == 0 and rcap == capacity and runit == unit
        and rrate == rate and rmax == max_elapsed and extra == nil and rlevel >= 0
        and rlevel <= max and rlevel % 1 == 0 and rupdated >= 0 and rupdated <= max * 2
        and rupdated % 1 == 0 then
      return true, rlevel, rupdated
    end
    if tag == 1 and rupdated and extra == nil and rg >= 0 and rg <= max and rpe >= 0
        and rpe <= max + 1 and rcap >= 1 and runit >= 1 and rrate >= 1
        and rcap * runit + rrate <= max and rmax >= 0 and rmax <= max and rlevel >= 0
        and rlevel <= max and rupdated >= 0 and rupdated <= max * 2 and rg % 1 + rpe % 1
        + rcap % 1 + runit % 1 + rrate % 1 + rmax % 1 + rlevel % 1 + rupdated % 1 == 0 then
      return false, rg, rpe, rcap, runit, rrate, rmax, rlevel, rupdated
    end
  end, raw, MAX, gen, capacity, unit, rate, max_elapsed)
  if ok and mine then stored, updated = rg, rpe end
end
-- asis: the stored record governs as it is (its generation, parameters and pending mark
-- unchanged), so a denial need not write it (see the decision below)
local asis = stored and not force

-- A deferral run out (tollgate_core::algorithm::deferral_lapsed): pending, and the bucket
-- full again at now, its time not after now; its key outlives that by up to a millisecond.
-- A missing bucket, decided fresh under the caller's parameters (under the old ones, written
-- keeping the key's expiry, that millisecond's admissions vanished with the key).
if raw and not stored and ok and rupdated and rpe > 0 and rupdated <= now then
  local total = rcap * runit
  if (now - rupdated) * rrate >= total - (rlevel < total and rlevel or total) then raw = false end
end

-- From here on capacity, unit, rate, max_elapsed, gen and pe are the governing parameters,
-- generation and pending deferral (the caller's unless the stored ones govern); own: they are
-- the caller's head (then the record is written as head .. state); keep: keep the key's expiry
local own, keep = true
if raw and not stored then
  -- The general path: a record of other parameters, generation or a pending deferral (or a
  -- malformed one: a missing bucket).
  if ok and rupdated then
    local same = rcap == capacity and runit == unit and rrate == rate and rmax == max_elapsed
    local newer = gen > rg or (gen == rg and not same)
    -- the same generation with other parameters takes over by carry, whatever the rule
    if gen == rg then rule = 1 end
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
      if newer and rpe <= gen then
        pe, keep = gen + 1, true
      else
        pe, keep, asis = rpe, rpe > 0, not force
      end
      -- a cost above the stored capacity: -1, nothing written (the caller's was checked);
      -- under a deferral (pending or starting), denied until the bucket expires instead
      if cost > rcap then
        if keep then return slow().until_expiry(raw, now, commit, pe ~= rpe and pe or nil) end
        return struct.pack(REPLY, -1, 0, -1, 0, rcap)
      end
      capacity, unit, rate, max_elapsed, gen, stored, updated =
        rcap, runit, rrate, rmax, rg, rlevel, rupdated
      own = false
    end
  elseif not via then
    -- a record of another algorithm (or a malformed one: a missing bucket)
    local x = slow().cross(raw, now, 1, gen, rule, cost, commit, capacity * unit, unit)
    if x and x.over then return struct.pack(REPLY, -1, 0, -1, 0, x.over) end
    if x and x.reply then return x.reply end
    if x and x.arg then
      arg, raw, force, via = x.arg, x.raw, x.force, true
      break
    end
    if x and x.used then
      stored, updated, asis = capacity * unit - x.used, x.eff, false
    end
  end
end
local cap = capacity * unit
local level, eff = cap, now -- a missing bucket is full
if stored then
  -- refill for the elapsed time (capped), never past capacity: elapsed >= ceil(d / rate) is
  -- elapsed * rate >= d, exact (a product past 2^53 rounds to a value still above d)
  eff = updated > now and updated or now
  level = stored < cap and stored or cap
  local elapsed, d = eff - updated, cap - level
  if max_elapsed > 0 and elapsed > max_elapsed then elapsed = max_elapsed end
  if elapsed * rate >= d then
    level = cap
  else
    level = level + elapsed * rate
  end
end

local need = cost * unit
local allowed, retry, d, m = 1, -1
if level >= need then
  level = level - need
else
  d = need - level
  m = d % rate
  local wait = (d - m) / rate + (m > 0 and 1 or 0)
  if max_elapsed > 0 and wait > max_elapsed then wait = max_elapsed end
  allowed, retry = 0, (eff - now) + wait
end
d = cap - level
m = d % rate
local reset = (eff - now) + (d - m) / rate + (m > 0 and 1 or 0)

-- the record to write (epilogue.lua), and the reply. A denial on a record that governs as it
-- is writes nothing (as tollgate_core's token bucket): with exact refill the stored level and
-- time give every later call at or after this time what the refilled ones would (an earlier
-- clock is decided on its own time: never more permissive), and the instant the bucket is
-- full again (its expiry) does not move. Under a cap on credited time (max_elapsed) each
-- call is credited at most the cap, so a denial there writes the refilled state.
local rec
if commit == 1 and (allowed == 1 or not asis or max_elapsed > 0) then
  if own and eff >= 4294967296 then
    -- head .. level, eff in one struct.pack: level in its smallest MessagePack encoding (as
    -- cmsgpack.pack writes it), eff (a time, 2^32 and up) as uint64
    if level < 128 then
      rec = struct.pack('>c0BBI8', head, level, 0xcf, eff)
    elseif level < 256 then
      rec = struct.pack('>c0BBBI8', head, 0xcc, level, 0xcf, eff)
    elseif level < 65536 then
      rec = struct.pack('>c0BHBI8', head, 0xcd, level, 0xcf, eff)
    elseif level < 4294967296 then
      rec = struct.pack('>c0BI4BI8', head, 0xce, level, 0xcf, eff)
    else
      rec = struct.pack('>c0BI8BI8', head, 0xcf, level, 0xcf, eff)
    end
  elseif own then
    rec = head .. cmsgpack.pack(level, eff)
  else
    rec = cmsgpack.pack(1, gen, pe, capacity, unit, rate, max_elapsed, level, eff)
  end
end
local remaining, limit = (level - level % unit) / unit, capacity
