-- What any decision that writes nothing (a token-bucket denial) must do at least: read the
-- clock and the key. One integer back.
local t = redis.call('TIME')
local raw = redis.call('GET', KEYS[1])
return 1
