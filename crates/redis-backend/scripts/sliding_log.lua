-- tollgate sliding log: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::sliding_log::apply exactly, after the prelude's
-- policy-change rules.
-- KEYS[1] bucket key
-- ARGV    limit (<= 1000), window_us, generation, transition (0 reset, 1 carry,
--         2 proportional, 3 defer), cost, commit (1 acquire, 0 peek)
-- record  tag 3; generation, pending, limit, window_us; then (time_us, cost) pairs, each
--         struct.pack('<dd', t, c), oldest first, times strictly rising; at most 1000 entries,
--         so every call's work is bounded.
-- returns {allowed 1/0 (-1: cost above the governing limit, nothing written), remaining,
--          retry_after_us (-1 when allowed), reset_after_us, governing limit}
local MAX_ENTRIES = 1000
if #KEYS ~= 1 then return bad('expected 1 key') end
if #ARGV ~= 6 then
  return bad('expected 6 arguments: limit window_us generation transition cost commit')
end
local limit = int(ARGV[1], 1, MAX_ENTRIES)
if not limit then return bad('limit must be an integer in [1, 1000]') end
local window = int(ARGV[2], 1, MAX)
if not window then return bad('window_us must be an integer in [1, 2^52]') end
local gen = int(ARGV[3], 0, MAX)
if not gen then return bad('generation must be an integer in [0, 2^52]') end
local rule = int(ARGV[4], 0, 3)
if not rule then return bad('transition must be 0, 1, 2 or 3') end
local cost = int(ARGV[5], 1, MAX)
if not cost then return bad('cost must be an integer in [1, 2^52]') end
local commit = int(ARGV[6], 0, 1)
if not commit then return bad('commit must be 0 or 1') end
if cost > limit then return bad('cost exceeds limit') end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local rec
local raw = redis.call('GET', KEYS[1])
if raw and string.byte(raw, 1) == 3 then
  local v, base = getv(raw, 2, 4)
  if v and v[1] <= MAX and v[2] <= MAX + 1 and v[3] >= 1 and v[3] <= MAX_ENTRIES and v[4] >= 1
      and v[4] <= MAX and (#raw - base + 1) % 16 == 0 and #raw - base + 1 <= 16 * MAX_ENTRIES then
    rec = { gen = v[1], pe = v[2], params = { v[3], v[4] }, base = base, times = {}, costs = {}, n = 0 }
    local pos, prev = base, -1
    while pos < #raw do
      local et, ec
      et, ec, pos = struct.unpack('<dd', raw, pos)
      if not (et > prev and et <= MAX * 2 and ec >= 1 and ec <= MAX
          and et == math.floor(et) and ec == math.floor(ec)) then
        rec = nil -- malformed: a missing bucket
        break
      end
      rec.n = rec.n + 1
      rec.times[rec.n], rec.costs[rec.n], prev = et, ec, et
    end
  end
end

local P = { limit, window }
local mode = plan(rec, gen, P, rule)
local g, pe, changed, keep = gen, 0, true, false
-- base: where the entries start in `raw` while they are the stored ones, unconverted
local times, costs, n, base = {}, {}, 0, nil
if mode == 'stored' or mode == 'defer' then
  P, g, times, costs, n, base = rec.params, rec.gen, rec.times, rec.costs, rec.n, rec.base
  if mode == 'stored' then
    pe, changed, keep = rec.pe, false, rec.pe > 0
  else
    pe, keep = gen + 1, true
  end
elseif mode == 'convert' and rule ~= 0 then
  local o, rt, rc, rn = rec.params, rec.times, rec.costs, rec.n
  local eff = now
  if rn > 0 and rt[rn] > now then eff = rt[rn] end
  for i = 1, rn do
    if rt[i] + o[2] > eff then
      n = n + 1
      times[n], costs[n] = rt[i], rc[i]
    end
  end
  if rule == 2 and n > 0 then
    -- keep the fraction of the limit still available: rescale, rounding onto the newest entry
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
local glimit, gwindow = P[1], P[2]
if cost > glimit then return { -1, 0, -1, 0, glimit } end

local eff = now
if n > 0 and times[n] > now then eff = times[n] end
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
  write(KEYS[1], string.char(3) .. putv(g) .. putv(pe) .. putv(glimit) .. putv(gwindow) .. kept,
    keep, reset)
end
return { allowed, math.max(glimit - sum, 0), retry, reset, glimit }
