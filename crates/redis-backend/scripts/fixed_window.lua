-- tollgate fixed window: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::fixed_window::apply exactly.
-- KEYS[1] bucket key
-- ARGV    limit, window_us, cost, commit (1 acquire, 0 peek)
-- state   STRING struct.pack('<dd', window_start_us, count)
-- returns {allowed 0/1, remaining, retry_after_us (-1 when allowed), reset_after_us}
local MAX = 4503599627370496 -- 2^52
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
local limit = int(ARGV[1], 1, MAX)
if not limit then return bad('limit must be an integer in [1, 2^52]') end
local window = int(ARGV[2], 1, MAX)
if not window then return bad('window_us must be an integer in [1, 2^52]') end
local cost = int(ARGV[3], 1, MAX)
if not cost then return bad('cost must be an integer in [1, 2^52]') end
local commit = int(ARGV[4], 0, 1)
if not commit then return bad('commit must be 0 or 1') end
if cost > limit then return bad('cost exceeds limit') end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local start, count = now - now % window, 0
local raw = redis.call('GET', KEYS[1])
if raw and #raw == 16 then
  local s, c = struct.unpack('<dd', raw)
  -- a stored window later than the current one (clock stepped back) stays in force
  if s >= start and s <= MAX * 2 and c >= 0 and c <= MAX and s == math.floor(s) and c == math.floor(c) then
    start, count = s, c
  end
end

local until_end = start + window - now
local allowed, retry = 0, until_end
if count + cost <= limit then
  allowed, retry, count = 1, -1, count + cost
  if commit == 1 then
    redis.call('SET', KEYS[1], struct.pack('<dd', start, count), 'PX', math.ceil(math.max(until_end, 1) / 1000))
  end
end
return {allowed, math.max(limit - count, 0), retry, until_end}
