-- tollgate token bucket: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::token_bucket::apply exactly (integer maths in doubles,
-- every quantity below 2^53).
-- KEYS[1] bucket key
-- ARGV    capacity, unit, rate, max_elapsed_us (0 = none), cost, commit (1 acquire, 0 peek)
-- state   STRING struct.pack('<dd', level_units, updated_us)
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
if #ARGV ~= 6 then return bad('expected 6 arguments: capacity unit rate max_elapsed_us cost commit') end
local capacity = int(ARGV[1], 1, MAX)
if not capacity then return bad('capacity must be an integer in [1, 2^52]') end
local unit = int(ARGV[2], 1, MAX)
if not unit then return bad('unit must be an integer in [1, 2^52]') end
local rate = int(ARGV[3], 1, MAX)
if not rate then return bad('rate must be an integer in [1, 2^52]') end
local max_elapsed = int(ARGV[4], 0, MAX)
if not max_elapsed then return bad('max_elapsed_us must be an integer in [0, 2^52]') end
local cost = int(ARGV[5], 1, MAX)
if not cost then return bad('cost must be an integer in [1, 2^52]') end
local commit = int(ARGV[6], 0, 1)
if not commit then return bad('commit must be 0 or 1') end
local cap = capacity * unit
if cap + rate > MAX then return bad('capacity * unit + rate exceeds 2^52') end
if cost > capacity then return bad('cost exceeds capacity') end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local stored, updated = cap, now
local raw = redis.call('GET', KEYS[1])
if raw and #raw == 16 then
  local l, u = struct.unpack('<dd', raw)
  if l >= 0 and u >= 0 and u <= MAX * 2 and l == math.floor(l) and u == math.floor(u) then
    stored, updated = math.min(l, cap), u
  end
end

local eff = math.max(now, updated)
local elapsed = eff - updated
if max_elapsed > 0 and elapsed > max_elapsed then elapsed = max_elapsed end
local level = cap
if elapsed < math.ceil((cap - stored) / rate) then level = stored + elapsed * rate end

local need = cost * unit
local allowed, retry = 1, -1
if level >= need then
  level = level - need
else
  local wait = math.ceil((need - level) / rate)
  if max_elapsed > 0 and wait > max_elapsed then wait = max_elapsed end
  allowed, retry = 0, (eff - now) + wait
end
local reset = (eff - now) + math.ceil((cap - level) / rate)

if commit == 1 then
  local ttl_ms = math.ceil(math.max(reset, 1) / 1000)
  redis.call('SET', KEYS[1], struct.pack('<dd', level, eff), 'PX', ttl_ms)
end
return {allowed, math.floor(level / unit), retry, reset}
