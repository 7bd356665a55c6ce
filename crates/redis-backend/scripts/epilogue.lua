
-- tollgate script epilogue, appended to every algorithm's script: writes the bucket's record
-- `rec` when the script set one, keeping the key's expiry when `keep` (a deferral runs out on
-- the old one) or with a new one of `ttl` microseconds, rounded up to milliseconds (at least
-- 1); then replies allowed, remaining, retry, reset, limit in one string (REPLY, see the
-- prelude). The milliseconds go as a string made by string.format('%d'): a number argument
-- costs Redis a "%.17g" conversion, dearer than the call.
if rec then
  if keep then
    redis.call('SET', K[1], rec, 'KEEPTTL')
  else
    local ms = ttl > 0 and ttl or 1
    redis.call('SET', K[1], rec, 'PX',
      string.format('%d', (ms - ms % 1000) / 1000 + (ms % 1000 > 0 and 1 or 0)))
  end
end
return struct.pack(REPLY, allowed, remaining, retry, reset, limit)
