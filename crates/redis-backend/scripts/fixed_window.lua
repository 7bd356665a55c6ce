-- tollgate fixed window: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::fixed_window::apply exactly, after the prelude's
-- policy-change rules.
-- KEYS[1] bucket key
-- ARGV[1] head: 2, generation, 0, limit, window_us; then transition (0 reset, 1 carry,
--         2 proportional, 3 defer), cost, commit (1 acquire, 0 peek) — MessagePack integers,
--         see the prelude
-- record  2, generation, pending, limit, window_us, window_start_us, count
-- returns allowed 1/0 (-1: cost above the governing limit, nothing written), remaining,
--         retry_after_us (-1 when allowed), reset_after_us, governing limit (REPLY); most
--         admissions as one integer, remaining * 2^37 + reset_after_us (see the prelude)
-- The arguments, checked inline (see the prelude: no closure, no pcall): the head's bytes
-- and the values. A value of another type than number where the checks compare it (a
-- MessagePack string, nil, ...), or an argument that is not MessagePack, raises a Lua error
-- before anything is written; every other invalid argument is refused by `slow().refuse`.
repeat -- until true: `break` leaves the block when another algorithm's record governs
local n, tag, gen, pe, limit, window, e, rule, cost, commit
if arg then
  n, tag, gen, pe, limit, window = cmsgpack.unpack_limit(arg, 5)
  if n > 0 then e, rule, cost, commit = cmsgpack.unpack_limit(arg, 3, n) end
end
if not (e == -1 and tag == 2 and pe == 0 and (commit == 0 or commit == 1) and gen >= 0
    and gen <= MAX and gen % 1 == 0 and limit >= 1 and limit <= MAX and limit % 1 == 0
    and window >= 1 and window <= MAX and window % 1 == 0
    and (rule == 0 or rule == 1 or rule == 2 or rule == 3) and cost >= 1 and cost <= limit
    and cost % 1 == 0) then
  return slow().refuse({ 'tag', 2, 2, 'generation', 0, MAX, 'pending', 0, 0, 'limit', 1, MAX,
    'window_us', 1, MAX, 'transition', 0, 3, 'cost', 1, MAX, 'commit', 0, 1 }, function(v)
    if v[7] > v[4] then return 'cost exceeds limit' end
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
-- those of a policy change) is recognised by its head's fields alone and gives its window
-- and count (st, cnt); any other gives all its fields, checked, for the general path, and a
-- malformed one nothing. Every field must be an integer (this crate writes no other), so that
-- every time derived from them is one (the epilogue's PXAT rounding relies on it).
local st, cnt, ok, mine, rg, rpe, rlimit, rwindow, rstart, rcount
if raw then
  ok, mine, rg, rpe, rlimit, rwindow, rstart, rcount = pcall(function(raw, max, gen, limit,
      window)
    local tag, rg, rpe, rlimit, rwindow, rstart, rcount, extra = cmsgpack.unpack(raw)
    if tag == 2 and rg == gen and rpe == 0 and rlimit == limit and rwindow == window
        and extra == nil and rstart >= 0 and rstart <= max * 2 and rcount >= 0
        and rcount <= max and rstart % 1 + rcount % 1 == 0 then
      return true, rstart, rcount
    end
    if tag == 2 and rcount and extra == nil and rg >= 0 and rg <= max and rpe >= 0
        and rpe <= max + 1 and rlimit >= 1 and rlimit <= max and rwindow >= 1
        and rwindow <= max and rstart >= 0 and rstart <= max * 2 and rcount >= 0
        and rcount <= max and rg % 1 + rpe % 1 + rlimit % 1 + rwindow % 1 + rstart % 1
        + rcount % 1 == 0 then
      return false, rg, rpe, rlimit, rwindow, rstart, rcount
    end
  end, raw, MAX, gen, limit, window)
  if ok and mine then st, cnt = rg, rpe end
end

-- A deferral run out (tollgate_core::algorithm::deferral_lapsed): pending, and its window
-- ended; its key outlives that by up to a millisecond. A missing bucket (see token_bucket.lua).
if raw and not cnt and ok and rcount and rpe > 0 and rstart + rwindow <= now then raw = false end

-- the governing parameters, generation and pending deferral, whether they are the caller's
-- head (then the record is written as head .. state); the stored window and count
local glimit, gwindow, g, pe, own, changed, keep =
  limit, window, gen, 0, true, st == nil or force, false
if raw and not cnt then
  -- The general path: a record of other parameters, generation or a pending deferral (or a
  -- malformed one: a missing bucket).
  if ok and rcount then
    local newer = gen > rg or (gen == rg and not (rlimit == limit and rwindow == window))
    -- the same generation with other parameters takes over by carry, whatever the rule
    if gen == rg then rule = 1 end
    if newer and rpe <= gen and rule ~= 3 then
      -- convert: what the current window has used under the old parameters; then the rule
      local eff, used = now, 0
      if rstart >= now - now % rwindow then
        eff, used = rstart > now and rstart or now, rcount
      end
      st = eff - eff % window
      if rule == 1 then
        cnt = used
      elseif rule == 2 then
        cnt = limit - slow().muldiv(rlimit - (used < rlimit and used or rlimit), limit, rlimit, limit)
      else
        cnt = 0
      end
    else
      -- the stored parameters govern; a newer caller with rule 3 starts a deferral
      glimit, gwindow, g, st, cnt, own = rlimit, rwindow, rg, rstart, rcount, false
      if newer and rpe <= gen then
        pe, keep = gen + 1, true
      else
        pe, changed, keep = rpe, force, rpe > 0
      end
    end
  elseif not via then
    -- a record of another algorithm (or a malformed one: a missing bucket)
    local x = slow().cross(raw, now, 2, gen, rule, cost, commit, limit, 1)
    if x and x.over then return struct.pack(REPLY, -1, 0, -1, 0, x.over) end
    if x and x.reply then return x.reply end
    if x and x.arg then
      arg, raw, force, via = x.arg, x.raw, x.force, true
      break
    end
    if x and x.used then
      st, cnt, changed = x.eff - x.eff % window, x.used, true
    end
  end
end
-- a cost above the governing limit: -1, nothing written (the caller's was checked); under a
-- deferral (pending or starting), denied until the bucket expires instead
if cost > glimit then
  if keep then return slow().until_expiry(raw, now, commit, pe ~= rpe and pe or nil) end
  return struct.pack(REPLY, -1, 0, -1, 0, glimit)
end

-- a stored window later than the current one (clock stepped back) stays in force
local start, count = now - now % gwindow, 0
if st and st >= start then start, count = st, cnt end
local until_end = start + gwindow - now
local allowed, retry = 0, until_end
if count + cost <= glimit then allowed, retry, count = 1, -1, count + cost end

-- the record to write (epilogue.lua; a denial writes only a policy change), and the reply
local rec
if commit == 1 and (allowed == 1 or changed) then
  if own and start >= 4294967296 then
    -- head .. start, count in one struct.pack: start (a time, 2^32 and up) as uint64, count
    -- in its smallest MessagePack encoding (as cmsgpack.pack writes it)
    if count < 128 then
      rec = struct.pack('>c0BI8B', head, 0xcf, start, count)
    elseif count < 256 then
      rec = struct.pack('>c0BI8BB', head, 0xcf, start, 0xcc, count)
    elseif count < 65536 then
      rec = struct.pack('>c0BI8BH', head, 0xcf, start, 0xcd, count)
    elseif count < 4294967296 then
      rec = struct.pack('>c0BI8BI4', head, 0xcf, start, 0xce, count)
    else
      rec = struct.pack('>c0BI8BI8', head, 0xcf, start, 0xcf, count)
    end
  elseif own then
    rec = head .. cmsgpack.pack(start, count)
  else
    rec = cmsgpack.pack(2, g, pe, glimit, gwindow, start, count)
  end
end
local remaining, reset, limit = glimit > count and glimit - count or 0, until_end, glimit
