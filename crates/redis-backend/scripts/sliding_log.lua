-- tollgate sliding log: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::sliding_log::apply exactly.
-- KEYS[1] bucket key
-- ARGV    limit (<= 1000), window_us, cost, commit (1 acquire, 0 peek)
-- state   STRING of (time_us, cost) pairs, each struct.pack('<dd', t, c), oldest first,
--         times strictly rising; at most 1000 entries, so every call's work is bounded.
-- returns {allowed 0/1, remaining, retry_after_us (-1 when allowed), reset_after_us}
local MAX = 4503599627370496 -- 2^52
local MAX_ENTRIES = 1000
local function int(s, min, max)
  if type(s) ~= 'string' or #s == 0 or #s > 16 or not string.find(s, '^%d+$') then
    return nil
  end
  local n = tonumber(s)
  if n < min or n > max then return nil end
  return n
end
local function bad(what) return redis.error_reply('ERR tollgate: ' .. what) end

if #KEYS ~= 1 then return bad('expected 1 key') end
if #ARGV ~= 4 then return bad('expected 4 arguments: limit window_us cost commit') end
local limit = int(ARGV[1], 1, MAX_ENTRIES)
if not limit then return bad('limit must be an integer in [1, 1000]') end
local window = int(ARGV[2], 1, MAX)
if not window then return bad('window_us must be an integer in [1, 2^52]') end
local cost = int(ARGV[3], 1, MAX)
if not cost then return bad('cost must be an integer in [1, 2^52]') end
local commit = int(ARGV[4], 0, 1)
if not commit then return bad('commit must be 0 or 1') end
if cost > limit then return bad('cost exceeds limit') end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local times, costs, n = {}, {}, 0
local raw = redis.call('GET', KEYS[1])
if raw and #raw % 16 == 0 and #raw <= 16 * MAX_ENTRIES then
  local pos, prev = 1, -1
  while pos < #raw do
    local et, ec
    et, ec, pos = struct.unpack('<dd', raw, pos)
    if not (et > prev and et <= MAX * 2 and ec >= 1 and ec <= MAX
        and et == math.floor(et) and ec == math.floor(ec)) then
      n = 0 -- malformed: a missing bucket
      break
    end
    n = n + 1
    times[n], costs[n], prev = et, ec, et
  end
end

local eff = now
if n > 0 and times[n] > now then eff = times[n] end
local first = n + 1
for i = 1, n do
  if times[i] + window > eff then first = i break end
end
local sum = 0
for i = first, n do sum = sum + costs[i] end

local allowed, retry, newest = 0, -1, nil
if sum + cost <= limit then
  allowed, sum, newest = 1, sum + cost, eff
else
  local left, at = sum, eff
  for i = first, n do
    left, at = left - costs[i], times[i] + window
    if left + cost <= limit then break end
  end
  retry = at - now
  if first <= n then newest = times[n] end
end
local reset = 0
if newest then reset = newest + window - now end

if commit == 1 and allowed == 1 then
  local kept = string.sub(raw or '', 16 * (first - 1) + 1, 16 * n)
  if first <= n and times[n] == eff then
    kept = string.sub(kept, 1, #kept - 16) .. struct.pack('<dd', eff, costs[n] + cost)
  else
    kept = kept .. struct.pack('<dd', eff, cost)
  end
  redis.call('SET', KEYS[1], kept, 'PX', math.ceil(math.max(reset, 1) / 1000))
end
return {allowed, math.max(limit - sum, 0), retry, reset}
