-- tollgate script prelude, prepended to every algorithm's script: argument checks, the record
-- codec, exact integer helpers, and the rule that settles which policy governs a bucket.
-- Mirrors tollgate_core::algorithm (mod.rs, transition.rs) exactly.
--
-- A record is one STRING: a tag byte (1 token bucket, 2 fixed window, 3 sliding log), then
-- unsigned LEB128 varints: generation, pending (0 = none, else the deferring generation + 1),
-- the parameters, then the algorithm's state. Every number is an integer below 2^53.
local MAX = 4503599627370496 -- 2^52
local function int(s, min, max)
  if type(s) ~= 'string' or #s == 0 or #s > 16 or not string.find(s, '^%d+$') then
    return nil
  end
  local n = tonumber(s)
  if n < min or n > max then return nil end
  return n
end
local function bad(what) return redis.error_reply('ERR tollgate: ' .. what) end

local function putv(n)
  local out = {}
  while n >= 128 do
    local low = n % 128
    out[#out + 1] = low + 128
    n = (n - low) / 128
  end
  out[#out + 1] = n
  return string.char(unpack(out))
end

-- Reads `count` varints from `raw` at `pos`: a table of them and the next position, or nil.
local function getv(raw, pos, count)
  local v = {}
  for i = 1, count do
    local x, mul, done = 0, 1, false
    for j = 0, 7 do
      local b = string.byte(raw, pos + j)
      if not b then return nil end
      if b < 128 then
        x, pos, done = x + b * mul, pos + j + 1, true
        break
      end
      x, mul = x + (b - 128) * mul, mul * 128
    end
    if not done then return nil end
    v[i] = x
  end
  return v, pos
end

-- min(floor(a * b / c), max) exactly, for a, b < 2^53, 1 <= c <= 2^52, max <= 2^52.
local function muldiv(a, b, c, max)
  local p = a * b
  if p <= MAX then
    local q = math.floor(p / c)
    local r = p - q * c
    if r < 0 then q = q - 1 elseif r >= c then q = q + 1 end
    return math.min(q, max)
  end
  local qa = math.floor(a / c)
  local ra = a - qa * c
  if ra < 0 then qa, ra = qa - 1, ra + c elseif ra >= c then qa, ra = qa + 1, ra - c end
  local base = qa * b
  if base > max then return max end
  -- floor(ra * b / c) bit by bit over b, remainder kept below c
  local q, r, bit, rest = 0, 0, MAX, b
  while bit >= 1 do
    q, r = q * 2, r * 2
    if r >= c then q, r = q + 1, r - c end
    if rest >= bit then
      rest, r = rest - bit, r + ra
      if r >= c then q, r = q + 1, r - c end
    end
    bit = bit / 2
  end
  return math.min(base + q, max)
end

-- Which policy governs a bucket: 'fresh' (none stored), 'stored' (the stored parameters: the
-- caller is not newer, or a deferral at least as new as the caller is running), 'defer' (the
-- stored parameters, and the caller now waits for the bucket to expire) or 'convert' (the
-- caller's rule moves the bucket to the caller's parameters). Newer: a higher generation, or
-- the same generation with other parameters.
local function plan(rec, gen, params, rule)
  if not rec then return 'fresh' end
  local same = true
  for i = 1, #params do
    if rec.params[i] ~= params[i] then same = false end
  end
  if not (gen > rec.gen or (gen == rec.gen and not same)) or rec.pe > gen then
    return 'stored'
  end
  if rule == 3 then return 'defer' end
  return 'convert'
end

-- Writes a record: with a new expiry of `ttl` microseconds, or keeping the key's expiry.
local function write(key, value, keep, ttl)
  if keep then
    redis.call('SET', key, value, 'KEEPTTL')
  else
    redis.call('SET', key, value, 'PX', math.ceil(math.max(ttl, 1) / 1000))
  end
end

