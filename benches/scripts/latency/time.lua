-- EVALSHA and Redis TIME, the clock every tollgate script must read.
local t = redis.call('TIME')
return 1
