-- The floor: what any token-bucket script on Redis time pays before doing any work of its
-- own — TIME, one GET, one SET with a PX expiry, five integers back — with no argument
-- checks, no record and no maths. benches/scripts/script-cost.sh measures tollgate's and the
-- source text's scripts against it.
local t = redis.call('TIME')
local raw = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], 'abcdefghijklmnopqrstuvwxy', 'PX', '60000')
return { 1, 99, -1, 20000, 100 }
