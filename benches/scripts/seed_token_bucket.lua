-- The token-bucket script of the source text (shared/seed), verbatim: the reference the
-- ceiling comparison in redis-compare.sh measures tollgate's own script against.
-- KEYS[1]: bucket hash
-- ARGV[1]: capacity, ARGV[2]: refill tokens per second, ARGV[3]: request cost
local capacity = tonumber(ARGV[1])
local refill_per_second = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])

if not capacity or not refill_per_second or not cost
   or capacity <= 0 or refill_per_second <= 0
   or cost <= 0 or cost > capacity then
  return redis.error_reply('invalid token bucket parameters')
end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens')) or capacity
local last_ms = tonumber(redis.call('HGET', KEYS[1], 'last_ms')) or now_ms

local elapsed_ms = math.max(0, now_ms - last_ms)
local refill_per_ms = refill_per_second / 1000
tokens = math.min(capacity, tokens + elapsed_ms * refill_per_ms)

local allowed = 0
local retry_ms = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
else
  retry_ms = math.ceil((cost - tokens) / refill_per_ms)
end

redis.call('HSET', KEYS[1], 'tokens', tokens, 'last_ms', now_ms)
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / refill_per_ms))
return {allowed, math.floor(tokens), retry_ms}
