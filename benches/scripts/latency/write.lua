-- What any admission must do at least: read the clock and the key, write a 25-byte value (an
-- idle token bucket's record is 25 bytes) with a millisecond expiry, and reply one integer
-- (as tollgate's admissions have since `3550de4`). No argument checks, no record, no maths.
local t = redis.call('TIME')
local raw = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], 'abcdefghijklmnopqrstuvwxy', 'PX', '60000')
return 1
