
-- tollgate script epilogue, appended to every algorithm's script: writes the bucket's record
-- `rec` when the script set one, keeping the key's expiry when `keep` (a deferral runs out on
-- the old one) or with a new one of `reset` microseconds (the reply's reset_after_us: an
-- integer, as the scripts accept only integer records and arguments), rounded up to
-- milliseconds (at least 1) and counted from `now`'s millisecond: an absolute PXAT, so the key
-- outlives now + reset whatever instant the server takes as the base of a relative PX (the
-- SET call's own time on Redis 7.0, the script's start on 7.2 and later, which can be a
-- millisecond before `now`'s and so expired a full bucket a few microseconds early); the
-- integer arithmetic is exact below 2^53; then replies allowed, remaining, retry, reset, limit in
-- one string (REPLY, see the prelude), or an admission under the caller's own parameters as
-- one integer, remaining * 2^37 + reset, when both fit (below 2^53: exact). The milliseconds go as a string made by
-- string.format('%d'): a number argument costs Redis a "%.17g" conversion, dearer than the
-- call.
if keep then
  -- old parameters govern until the key expires (a deferral pending or starting): a fresh
  -- bucket admits the caller's cost then, so no wait or reset reaches past the first
  -- microsecond the key is gone (tollgate_core::algorithm::cap_at_expiry)
  -- (a key without an expiry, which only a hand-made PERSIST can leave, is not capped)
  local at = redis.call('PEXPIRETIME', K[1])
  if at >= 0 then
    local gone = (at + 1) * 1000 - now
    if gone < 0 then gone = 0 end
    if retry > gone then retry = gone end
    if reset > gone then reset = gone end
  end
end
if rec then
  if keep then
    redis.call('SET', K[1], rec, 'KEEPTTL')
  else
    redis.call('SET', K[1], rec, 'PXAT', string.format('%d', (now - now % 1000) / 1000
      + (reset > 0 and (reset + 999 - (reset + 999) % 1000) / 1000 or 1)))
  end
end
if allowed == 1 and own and not via and remaining < 65536 and reset < PACKED then
  return remaining * PACKED + reset
end
return struct.pack(REPLY, allowed, remaining, retry, reset, limit)
until true
