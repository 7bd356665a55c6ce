-- tollgate script prelude, prepended to every algorithm's script: argument reading, the
-- refusal messages and the exact integer helpers of the rare paths. Mirrors
-- tollgate_core::algorithm (mod.rs, transition.rs) exactly, with the algorithm's file.
--
-- A record is one STRING: MessagePack values one after the other (cmsgpack.pack(a, b, ...),
-- each integer in its smallest encoding): a tag (1 token bucket, 2 fixed window, 3 sliding
-- log), the generation, pending (0 = none, else the deferring generation + 1), the
-- parameters, then the algorithm's state. Every number is an integer below 2^53.
--
-- Cost: every decision runs one of these scripts inside Redis, where each C call (even
-- `tonumber`), each closure, table or string is dear next to plain arithmetic. So the hot
-- path reads arguments by Lua's string coercion inside one pcall, reads and writes a record
-- with one cmsgpack call each, and keeps its numbers in locals; helpers that only rare paths
-- need (refusal messages, the exact mul-div of a policy conversion) are built by `slow()`
-- when such a path runs. BENCHMARKS.md has the instruction counts behind these choices.
local MAX = 4503599627370496 -- 2^52
local K, A = KEYS, ARGV
local function bad(what) return redis.error_reply('ERR tollgate: ' .. what) end

-- The arguments as numbers (string coercion: no C call), raising on a non-numeric one; run
-- under pcall. Ranges and integrality are the caller's checks (`n % 1 == 0` is false for
-- NaN and the infinities).
local function numbers(count)
  if count == 8 then
    return A[1] + 0, A[2] + 0, A[3] + 0, A[4] + 0, A[5] + 0, A[6] + 0, A[7] + 0, A[8] + 0
  end
  return A[1] + 0, A[2] + 0, A[3] + 0, A[4] + 0, A[5] + 0, A[6] + 0
end

-- The helpers of the rare paths.
local function slow()
  local h = {}
  -- The refusal for the first bad argument: `spec` lists name, lo, hi per argument.
  function h.refuse(spec)
    local count = #spec / 3
    if #K ~= 1 then return bad('expected 1 key') end
    if #A ~= count then
      local names = {}
      for i = 1, count do names[i] = spec[3 * i - 2] end
      return bad('expected ' .. count .. ' arguments: ' .. table.concat(names, ' '))
    end
    for i = 1, count do
      local lo, hi = spec[3 * i - 1], spec[3 * i]
      local n = string.find(A[i], '^%d+$') and tonumber(A[i])
      if not n or n < lo or n > hi then
        local top = hi == MAX and '2^52' or tostring(hi)
        return bad(spec[3 * i - 2] .. ' must be an integer in [' .. lo .. ', ' .. top .. ']')
      end
    end
    return bad('invalid arguments')
  end
  -- min(floor(a * b / c), mx) exactly, for a, b < 2^53, 1 <= c <= 2^52, mx <= 2^52.
  function h.muldiv(a, b, c, mx)
    local floor = math.floor
    local p = a * b
    if p <= MAX then
      local q = floor(p / c)
      local r = p - q * c
      if r < 0 then q = q - 1 elseif r >= c then q = q + 1 end
      return math.min(q, mx)
    end
    local qa = floor(a / c)
    local ra = a - qa * c
    if ra < 0 then qa, ra = qa - 1, ra + c elseif ra >= c then qa, ra = qa + 1, ra - c end
    local base = qa * b
    if base > mx then return mx end
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
    return math.min(base + q, mx)
  end
  return h
end

-- Writes the bucket's record: keeping the key's expiry (a deferral runs out on the old one), or
-- with a new one of `ttl` microseconds, rounded up to milliseconds (at least 1).
local function write(value, keep, ttl)
  if keep then
    redis.call('SET', K[1], value, 'KEEPTTL')
  else
    local ms = ttl > 0 and ttl or 1
    redis.call('SET', K[1], value, 'PX', (ms - ms % 1000) / 1000 + (ms % 1000 > 0 and 1 or 0))
  end
end

-- A caller is newer than a stored record with generation `rg` (and parameters equal to its
-- own or not, `same`) when its generation is higher, or equal with other parameters. An
-- older or equal caller is decided under the stored parameters; so is a newer one while a
-- deferral at least as new as the caller runs (pending `rpe` > caller's generation). A newer
-- caller then converts the bucket by its rule, or (rule 3) defers to the bucket's expiry.
