-- What any admission must do at least: read the clock and the key, write a 25-byte value with
-- a millisecond expiry, and reply with a 40-byte string (tollgate's reply is five int64 in
-- one string). No argument checks, no record, no maths.
local t = redis.call('TIME')
local raw = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], 'abcdefghijklmnopqrstuvwxy', 'PX', '60000')
return '0123456789012345678901234567890123456789'
