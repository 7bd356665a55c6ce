
-- tollgate script epilogue, appended to every algorithm's script: writes the bucket's record
-- `rec` when the script set one, keeping the key's expiry when `keep` (a deferral runs out on
-- the old one) or with a new one of `reset` microseconds (the reply's reset_after_us: an
-- integer, as the scripts accept only integer records and arguments): alive through the
-- millisecond holding now + reset, and at least through the one after now's
-- (tollgate_core::algorithm::expires_at_ms; Redis drops a key once its expiry is strictly
-- past), so never gone before now + reset and at most a millisecond after. An absolute PXAT
-- from `now`, not a relative PX: Redis bases a PX on its own clock read — the SET call's on
-- 7.0 (a millisecond after `now`'s when one passes between the two reads), the script's start
-- on 7.2 and later (one before: the key gone a few microseconds before the bucket is full).
-- '%d' truncates the quotient exactly: now + reset is an integer below 2^53, so the quotient
-- is below 2^44, where doubles lie at most 2^-9 apart; rounded, it is within 2^-10 of the true
-- quotient, whose fraction is a whole number of thousandths, so it never reaches the next
-- integer. Then replies allowed, remaining, retry, reset, limit in
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
    redis.call('SET', K[1], rec, 'PXAT',
      string.format('%d', (now + (reset > 1000 and reset or 1000)) / 1000))
  end
end
if allowed == 1 and own and not via and remaining < 65536 and reset < PACKED then
  return remaining * PACKED + reset
end
return struct.pack(REPLY, allowed, remaining, retry, reset, limit)
until true
