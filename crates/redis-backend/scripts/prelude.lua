-- tollgate script prelude, prepended to every algorithm's script: the argument and record
-- layouts, and the helpers of the rare paths. Mirrors tollgate_core::algorithm (mod.rs,
-- transition.rs) exactly, with the algorithm's file.
--
-- A record is one STRING: MessagePack values one after the other (cmsgpack.pack(a, b, ...),
-- each integer in its smallest encoding): a tag (1 token bucket, 2 fixed window, 3 sliding
-- log), the generation, pending (0 = none, else the deferring generation + 1), the
-- parameters, then the algorithm's state. Every number is an integer below 2^53.
--
-- The arguments: KEYS[1] is the bucket key and ARGV[1] one string of MessagePack integers,
-- encoded by the Rust client (scripts.rs): the *head* of the record the caller would write —
-- tag, generation, 0, the parameters, in those exact bytes — then the transition rule (0
-- reset, 1 carry, 2 proportional, 3 defer), cost and commit (1 acquire, 0 peek, which never
-- writes). Whenever the caller's generation and parameters govern with no deferral pending
-- (every call but those of a policy change), a script writes the head's bytes as they are,
-- followed by the new state: only the state is encoded; other cases take the general path.
--
-- Cost: every decision runs one of these scripts inside Redis, where each argument, C call,
-- table, string and closure is dear next to plain arithmetic, and a closure that captures a
-- local of the script dearer still (one more allocation per captured local, per call). So the
-- hot path decodes its one argument and checks it inline — no closure, no pcall, no call: ~1,900
-- instructions less than doing it in a pcall'd function — keeps its numbers in locals, writes
-- the state with one struct.pack and replies one string or integer (REPLY below), not a table. The price
-- of the inline checks: a value that is not a number (a MessagePack string, nil, ...) where a
-- check compares it, or an argument that is not MessagePack (cut inside a value, a reserved
-- byte: cmsgpack raises), gets a plain Lua error rather than the `ERR tollgate:` refusal; every
-- check still runs before anything is written, and a NaN, infinite, fractional, negative or
-- out-of-range number fails its check (written `x >= lo and ...`, false for NaN) and is
-- refused. Only a stored record is decoded in a pcall (it may be anything), by a function that
-- captures nothing, created only when there is a record. The helpers that only rare paths need
-- (refusal messages, the exact mul-div of a policy conversion) are built by `slow()`, a closure
-- that captures nothing, called only when such a path runs. The record is written by
-- epilogue.lua, appended to every script, rather than by a helper function (one closure and
-- one call less per decision). BENCHMARKS.md has the instruction counts behind these choices.
local MAX = 4503599627370496 -- 2^52
local K = KEYS
-- The reply: allowed (1, 0, or -1 for a cost above the governing limit), remaining,
-- retry_after_us (-1 when allowed), reset_after_us, the governing limit, as five little-endian
-- int64 in one string. A table reply costs Redis ~4,000 instructions more: it looks up six
-- field names in the table (err, ok, double, ...) before reading its elements. An admission
-- under the caller's own parameters (`own`) with remaining < 2^16 and reset_after_us < 2^37
-- (38 hours) — nearly every admission — replies instead one integer, remaining * 2^37 + reset
-- (epilogue.lua): the caller knows the rest (allowed, no retry, its own limit), and the
-- string costs Redis ~2,500 instructions more (struct.pack builds it byte by byte, then Lua
-- interns it).
local REPLY = '<i8i8i8i8i8'
local PACKED = 137438953472 -- 2^37

-- The helpers of the rare paths.
local function slow()
  local h, max = {}, 2 ^ 52
  function h.bad(what) return redis.error_reply('ERR tollgate: ' .. what) end
  -- The refusal for the first bad argument. `spec` lists name, lo, hi for each value of
  -- ARGV[1] (fields of equal lo and hi are fixed); `cross(v)` names a failed check between
  -- values (v: the values in order), once each is in its range.
  function h.refuse(spec, cross)
    local count = #spec / 3
    local names = {}
    for i = 1, count do names[i] = spec[3 * i - 2] end
    local layout = count .. ' MessagePack integers: ' .. table.concat(names, ', ')
    if #KEYS ~= 1 then return h.bad('expected 1 key') end
    if #ARGV ~= 1 then return h.bad('expected 1 argument of ' .. layout) end
    local v = { pcall(cmsgpack.unpack, ARGV[1]) }
    if not v[1] or select('#', unpack(v)) ~= count + 1 then
      return h.bad('the argument must be ' .. layout)
    end
    table.remove(v, 1)
    for i = 1, count do
      local n, lo, hi = v[i], spec[3 * i - 1], spec[3 * i]
      if type(n) ~= 'number' or n % 1 ~= 0 or n < lo or n > hi then
        if lo == hi then return h.bad(spec[3 * i - 2] .. ' must be ' .. lo) end
        local top = hi == max and '2^52' or tostring(hi)
        return h.bad(spec[3 * i - 2] .. ' must be an integer in [' .. lo .. ', ' .. top .. ']')
      end
    end
    return h.bad(cross(v) or 'invalid arguments')
  end
  -- min(floor(a * b / c), mx) exactly, for a, b < 2^53, 1 <= c <= 2^52, mx <= 2^52.
  function h.muldiv(a, b, c, mx)
    local floor = math.floor
    local p = a * b
    if p <= max then
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
    local q, r, bit, rest = 0, 0, max, b
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

-- A caller is newer than a stored record with generation `rg` (and parameters equal to its
-- own or not, `same`) when its generation is higher, or equal with other parameters. An
-- older or equal caller is decided under the stored parameters; so is a newer one while a
-- deferral at least as new as the caller runs (pending `rpe` > caller's generation). A newer
-- caller then converts the bucket by its rule, or (rule 3) defers to the bucket's expiry;
-- a caller of the same generation with other parameters converts by carry (rule 1) whatever
-- its rule: only a generation bump may grant a fresh bucket or start a deferral.
