-- tollgate sliding log: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::sliding_log::apply exactly, after the prelude's
-- policy-change rules.
-- KEYS[1] bucket key
-- ARGV[1] head: 3, generation, 0, limit (<= 1000), window_us; then transition (0 reset,
--         1 carry, 2 proportional, 3 defer), cost, commit (1 acquire, 0 peek) — MessagePack
--         integers, see the prelude
-- record  3, generation, pending, limit, window_us (MessagePack); then (time_us, cost) pairs,
--         each struct.pack('<dd', t, c), oldest first, times strictly rising; at most 1000
--         entries, so every call's work is bounded.
-- returns allowed 1/0 (-1: cost above the governing limit, nothing written), remaining,
--         retry_after_us (-1 when allowed), reset_after_us, governing limit (REPLY); most
--         admissions as one integer, remaining * 2^37 + reset_after_us (see the prelude)
repeat -- until true: `break` leaves the block when another algorithm's record governs
local MAX_ENTRIES = 1000
-- The arguments, checked inline (see the prelude: no closure, no pcall): the head's bytes
-- and the values. A value of another type than number where the checks compare it (a
-- MessagePack string, nil, ...), or an argument that is not MessagePack, raises a Lua error
-- before anything is written; every other invalid argument is refused by `slow().refuse`.
local n, tag, gen, pe, limit, window, e, rule, cost, commit
if arg then
  n, tag, gen, pe, limit, window = cmsgpack.unpack_limit(arg, 5)
  if n > 0 then e, rule, cost, commit = cmsgpack.unpack_limit(arg, 3, n) end
end
if not (e == -1 and tag == 3 and pe == 0 and (commit == 0 or commit == 1) and gen >= 0
    and gen <= MAX and gen % 1 == 0 and limit >= 1 and limit <= MAX_ENTRIES
    and limit % 1 == 0 and window >= 1 and window <= MAX and window % 1 == 0
    and (rule == 0 or rule == 1 or rule == 2 or rule == 3) and cost >= 1 and cost <= limit
    and cost % 1 == 0) then
  return slow().refuse({ 'tag', 3, 3, 'generation', 0, MAX, 'pending', 0, 0, 'limit', 1,
    MAX_ENTRIES, 'window_us', 1, MAX, 'transition', 0, 3, 'cost', 1, MAX, 'commit', 0, 1 },
    function(v)
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
-- the stored record `sr`: header fields and entries, or nothing when it is malformed (a missing
-- bucket): a non-number fails its comparison inside the pcall; every number must be an
-- integer (this crate writes no other). Captures no local.
local function record(raw)
  local unpack, max = struct.unpack, 2 ^ 52
  local next, tag, rg, rpe, rlimit, rwindow = cmsgpack.unpack_limit(raw, 5)
  if not (tag == 3 and rwindow and rg >= 0 and rg <= max and rpe >= 0 and rpe <= max + 1
      and rlimit >= 1 and rlimit <= 1000 and rwindow >= 1 and rwindow <= max
      and rg % 1 + rpe % 1 + rlimit % 1 + rwindow % 1 == 0) then
    return nil
  end
  local base = next < 0 and #raw + 1 or next + 1
  if (#raw - base + 1) % 16 ~= 0 or #raw - base + 1 > 16 * 1000 then return nil end
  local sr = { gen = rg, pe = rpe, params = { rlimit, rwindow }, base = base, times = {},
    costs = {}, n = 0 }
  local pos, prev = base, -1
  while pos < #raw do
    local et, ec
    et, ec, pos = unpack('<dd', raw, pos)
    if not (et > prev and et <= max * 2 and ec >= 1 and ec <= max and et % 1 == 0
        and ec % 1 == 0) then
      return nil
    end
    sr.n = sr.n + 1
    sr.times[sr.n], sr.costs[sr.n], prev = et, ec, et
  end
  return sr
end
local ok, sr
if raw then
  ok, sr = pcall(record, raw)
  if not ok then sr = nil end
  -- A deferral run out (tollgate_core::algorithm::deferral_lapsed): pending, and its newest
  -- entry out of the window; its key outlives that by up to a millisecond. A missing bucket
  -- (see token_bucket.lua).
  if sr and sr.pe > 0 and (sr.n == 0 or sr.times[sr.n] + sr.params[2] <= now) then
    sr, raw = nil, false
  end
end

-- own: the governing generation and parameters are the caller's head, no deferral pending
-- (then the record is written as head .. entries)
local glimit, gwindow, g, pe, changed, keep, own = limit, window, gen, 0, true, false, true
-- base: where the entries start in `raw` while they are the stored ones, unconverted
-- floor: a converted bucket's time, max(now, the old bucket's stored time): a log keeps its
-- time in its entries, so one left empty by the conversion (a reset) still decides there and
-- writes its first entry there, never at a clock stepped back behind it (as the core's
-- transition::convert, whose marker entry of cost 0 merges into that first entry)
local times, costs, n, base, floor = {}, {}, 0, nil, nil
if sr then
  local o = sr.params
  local newer = gen > sr.gen or (gen == sr.gen and not (o[1] == limit and o[2] == window))
  -- the same generation with other parameters takes over by carry, whatever the rule
  if gen == sr.gen then rule = 1 end
  if not newer or sr.pe > gen or rule == 3 then
    -- the stored parameters govern; a newer caller with rule 3 starts a deferral
    glimit, gwindow, g = o[1], o[2], sr.gen
    own = not newer and sr.gen == gen and sr.pe == 0
    times, costs, n, base = sr.times, sr.costs, sr.n, sr.base
    if newer and sr.pe <= gen then
      pe, keep = gen + 1, true
    else
      pe, changed, keep = sr.pe, force, sr.pe > 0
    end
  else
    local rt, rc, rn = sr.times, sr.costs, sr.n
    local eff = now
    if rn > 0 and rt[rn] > now then eff = rt[rn] end
    floor = eff
    for i = 1, (rule ~= 0 and rn or 0) do
      if rt[i] + o[2] > eff then
        n = n + 1
        times[n], costs[n] = rt[i], rc[i]
      end
    end
    if rule == 2 and n > 0 then
      -- keep the fraction of the limit still available: rescale, rounding onto the newest entry
      local muldiv = slow().muldiv
      local used, sum = 0, 0
      for i = 1, n do used = used + costs[i] end
      local target = limit - muldiv(o[1] - math.min(used, o[1]), limit, o[1], limit)
      for i = 1, n do
        costs[i] = muldiv(costs[i], target, used, target)
        sum = sum + costs[i]
      end
      costs[n] = costs[n] + target - sum
      local kt, kc, k = {}, {}, 0
      for i = 1, n do
        if costs[i] > 0 then
          k = k + 1
          kt[k], kc[k] = times[i], costs[i]
        end
      end
      times, costs, n = kt, kc, k
    end
  end
elseif raw and not via then
  -- a record of another algorithm (or a malformed one: a missing bucket)
  local x = slow().cross(raw, now, 3, gen, rule, cost, commit, limit, 1)
  if x and x.over then return struct.pack(REPLY, -1, 0, -1, 0, x.over) end
    if x and x.reply then return x.reply end
  if x and x.arg then
    arg, raw, force, via = x.arg, x.raw, x.force, true
    break
  end
  if x and x.used and x.used > 0 then
    times, costs, n = { x.eff }, { x.used }, 1
  end
  if x and x.eff then floor = x.eff end
end
-- a cost above the governing limit: -1, nothing written (the caller's was checked); under a
-- deferral (pending or starting), denied until the bucket expires instead
if cost > glimit then
  if keep then return slow().until_expiry(raw, now, commit, pe ~= sr.pe and pe or nil) end
  return struct.pack(REPLY, -1, 0, -1, 0, glimit)
end

local eff = now
if n > 0 and times[n] > now then eff = times[n] end
if floor and floor > eff then eff = floor end
local first = n + 1
for i = 1, n do
  if times[i] + gwindow > eff then first = i break end
end
local sum = 0
for i = first, n do sum = sum + costs[i] end

local allowed, retry, newest = 0, -1, nil
if sum + cost <= glimit then
  allowed, sum, newest = 1, sum + cost, eff
else
  local left, at = sum, eff
  for i = first, n do
    left, at = left - costs[i], times[i] + gwindow
    if left + cost <= glimit then break end
  end
  retry = at - now
  if first <= n then newest = times[n] end
end
local reset = 0
if newest then reset = newest + gwindow - now end

-- the record to write (epilogue.lua; a denial writes only a policy change), and the reply
local rec
if commit == 1 and (allowed == 1 or changed) then
  -- only an admission prunes: a denial keeps every entry
  local from = first
  if allowed == 0 then from = 1 end
  local kept
  if base then
    kept = string.sub(raw, base + 16 * (from - 1), base + 16 * n - 1)
  else
    local parts = {}
    for i = from, n do parts[#parts + 1] = struct.pack('<dd', times[i], costs[i]) end
    kept = table.concat(parts)
  end
  if allowed == 1 then
    if first <= n and times[n] == eff then
      kept = string.sub(kept, 1, #kept - 16) .. struct.pack('<dd', eff, costs[n] + cost)
    else
      kept = kept .. struct.pack('<dd', eff, cost)
    end
  end
  if own then
    rec = head .. kept
  else
    rec = cmsgpack.pack(3, g, pe, glimit, gwindow) .. kept
  end
end
local remaining, limit = math.max(glimit - sum, 0), glimit
