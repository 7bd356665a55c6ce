-- tollgate policy registry: publish one named policy atomically.
-- KEYS[1] the registry hash (field = name, value = "<generation> <spec>")
-- ARGV    name, generation, spec (parses back to the policy), notification channel
-- returns {1, generation, changed 0/1} when stored (or already stored, unchanged);
--         {0, stored generation} when the stored generation is higher (refused);
--         {-1, stored generation} when that generation holds another policy (refused).
-- An entry without a generation before the space, or with one above 2^52, is replaced.
-- On a change, PUBLISHes the name on the channel, in the same atomic step.
local name, gen, spec, channel = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local value = ARGV[2] .. ' ' .. spec
local cur = redis.call('HGET', KEYS[1], name)
if cur then
  local stored = tonumber(string.match(cur, '^(%d+) '))
  -- A number above MAX_EXACT (2^52) is no policy's generation: a corrupt entry (followers
  -- read it as such), replaced by this publication rather than taken for a newer one.
  if stored and stored > 4503599627370496 then stored = nil end
  if stored and stored > gen then return { 0, stored } end
  if stored and stored == gen then
    if cur == value then return { 1, gen, 0 } end
    return { -1, stored }
  end
end
redis.call('HSET', KEYS[1], name, value)
redis.call('PUBLISH', channel, name)
return { 1, gen, 1 }
