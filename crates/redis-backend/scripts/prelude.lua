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
-- No record this crate writes is longer (a sliding log of 1,000 entries is 16,000 bytes and a
-- header of at most 31): a longer value at a bucket key is not decoded but taken for a missing
-- bucket. Decoding is one C call that the script-timeout hook cannot interrupt, ~60 ns a byte:
-- an 8 MB value held every other client for 0.5 s per call (found by a review).
local MAX_RECORD = 16384
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

-- One record per bucket whatever the algorithm, and one script for every algorithm: the
-- caller's argument picks the algorithm's block (scripts.rs puts them after this prelude, each
-- followed by the epilogue, inside a loop of at most two passes). A block that meets a record
-- of another algorithm asks `slow().cross` who governs: the caller (a newer generation, or the
-- same one: the old bucket converted by the caller's rule, or fresh), or the stored record (an
-- older caller, a pending deferral at least as new as the caller, or a newer caller deferring).
-- In the last case the block sets `arg` to the stored record's own head (a caller of the
-- stored policy), `raw` to the record (its deferral marked when the caller starts one, with
-- `force`: write it even on a denial) and `via`, and leaves (`break`); the next pass runs the
-- stored algorithm's block as that caller, on the same `now` and record: one decision, in one
-- atomic script. `via`: the reply carries the governing limit (no integer reply).
local arg = #K == 1 and #ARGV == 1 and ARGV[1]
local now, raw, via, force

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
  -- A stored record (any algorithm) checked as its own block checks it, and its use at
  -- eff = max(now, its stored time) under its own parameters (as tollgate_core's
  -- transition::usage): used of total, in units of `unit` per request. Raises (in the pcall
  -- of `cross`) or returns nothing for a malformed record.
  function h.usage(raw, now)
    local skip, tag, g, pe = cmsgpack.unpack_limit(raw, 3)
    if not (skip > 0 and g >= 0 and g <= max and pe >= 0 and pe <= max + 1
        and g % 1 + pe % 1 == 0) then
      return nil
    end
    local r = { tag = tag, g = g, pe = pe, skip = skip }
    if tag == 1 then
      local _, _, _, cap, unit, rate, mx, level, upd, extra = cmsgpack.unpack(raw)
      if not (upd and extra == nil and cap >= 1 and unit >= 1 and rate >= 1
          and cap * unit + rate <= max and mx >= 0 and mx <= max and level >= 0
          and level <= max and upd >= 0 and upd <= max * 2 and cap % 1 + unit % 1 + rate % 1
          + mx % 1 + level % 1 + upd % 1 == 0) then
        return nil
      end
      local total = cap * unit
      local eff = upd > now and upd or now
      level = level < total and level or total
      local elapsed, d = eff - upd, total - level
      -- a deferral run out (tollgate_core::algorithm::deferral_lapsed): full again (uncapped)
      r.lapsed = pe > 0 and upd <= now and elapsed * rate >= d
      if mx > 0 and elapsed > mx then elapsed = mx end
      if elapsed * rate >= d then level = total else level = level + elapsed * rate end
      r.params, r.eff, r.used, r.total, r.unit = { cap, unit, rate, mx }, eff, total - level,
        total, unit
    elseif tag == 2 then
      local _, _, _, lim, win, st, cnt, extra = cmsgpack.unpack(raw)
      if not (cnt and extra == nil and lim >= 1 and lim <= max and win >= 1 and win <= max
          and st >= 0 and st <= max * 2 and cnt >= 0 and cnt <= max
          and lim % 1 + win % 1 + st % 1 + cnt % 1 == 0) then
        return nil
      end
      local used = 0
      if st >= now - now % win then used = cnt < lim and cnt or lim end
      r.lapsed = pe > 0 and st + win <= now
      r.params, r.eff, r.used, r.total, r.unit = { lim, win }, st > now and st or now, used,
        lim, 1
    elseif tag == 3 then
      local next, _, _, _, lim, win = cmsgpack.unpack_limit(raw, 5)
      if not (win and lim >= 1 and lim <= 1000 and win >= 1 and win <= max
          and lim % 1 + win % 1 == 0) then
        return nil
      end
      local base = next < 0 and #raw + 1 or next + 1
      if (#raw - base + 1) % 16 ~= 0 or #raw - base + 1 > 16 * 1000 then return nil end
      local times, costs, n, pos, prev = {}, {}, 0, base, -1
      while pos < #raw do
        local et, ec
        et, ec, pos = struct.unpack('<dd', raw, pos)
        if not (et > prev and et <= max * 2 and ec >= 1 and ec <= max and et % 1 == 0
            and ec % 1 == 0) then
          return nil
        end
        n = n + 1
        times[n], costs[n], prev = et, ec, et
      end
      local eff = now
      if n > 0 and times[n] > now then eff = times[n] end
      r.lapsed = pe > 0 and (n == 0 or times[n] + win <= now)
      local used = 0
      for i = 1, n do
        if times[i] + win > eff then used = used + costs[i] end
      end
      r.params, r.eff, r.used, r.total, r.unit = { lim, win }, eff, used < lim and used or lim,
        lim, 1
    else
      return nil
    end
    return r
  end
  -- A cost above the limit of the stored record `raw` (any algorithm; `r`, its h.usage, if
  -- known) that governs only until its key expires — a deferral pending, or starting with
  -- this call (`mark`: the pending value to write, else nil) — but within the caller's own
  -- limit: not refused, since a fresh bucket under the caller's parameters admits it at the
  -- expiry, but denied until then, with what the stored bucket has left; nothing spent, the
  -- deferral's mark written on a commit (keeping the expiry), as on any denial of a newer
  -- caller (tollgate_core's until_expiry; retry and reset 2^52 there, which the store ends at
  -- the expiry). Returns the reply.
  function h.until_expiry(raw, now, commit, mark, r)
    r = r or h.usage(raw, now)
    local wait = max
    local at = redis.call('PEXPIRETIME', KEYS[1])
    if at >= 0 then
      local gone = (at + 1) * 1000 - now
      if gone < 0 then gone = 0 end
      if gone < wait then wait = gone end
    end
    if mark and commit == 1 then
      redis.call('SET', KEYS[1], cmsgpack.pack(r.tag, r.g, mark) .. string.sub(raw, r.skip + 1),
        'KEEPTTL')
    end
    local left = r.total - r.used
    return struct.pack('<i8i8i8i8i8', 0, (left - left % r.unit) / r.unit, wait, wait, r.params[1])
  end
  -- A record `raw` of another algorithm than the caller's (tag `mine`), met at `now` by a
  -- caller of generation `gen`, rule, cost and commit, whose limit is `total` units of `unit`
  -- per request. Nothing for a malformed record or one of the caller's own algorithm (a
  -- missing bucket); else one of:
  --   { over = limit }: the stored record governs and the cost is above its limit;
  --   { arg, raw, force }: the stored record governs (an older caller, a deferral at least as
  --     new as the caller's generation pending, or a newer caller deferring, whose deferral
  --     `raw` then marks, with `force`): decide as a caller of its own policy, `arg`;
  --   { eff, used = 0 }: the caller's rule is reset: a fresh bucket at the old one's `eff`
  --     (max(now, its stored time): a clock stepped back never moves the bucket's time back);
  --   { eff, used }: the caller converts the bucket (carry, proportional, or the same
  --     generation): its own bucket at `eff` with `used` of its `total` used (as
  --     tollgate_core's transition::across).
  function h.cross(raw, now, mine, gen, rule, cost, commit, total, unit)
    local ok, r = pcall(h.usage, raw, now)
    -- (a deferral run out is a missing bucket, as in the algorithms' blocks)
    if not ok or not r or r.tag == mine or r.lapsed then return nil end
    -- the same generation (other parameters: another algorithm) takes over by carry
    if gen == r.g then rule = 1 end
    if gen < r.g or r.pe > gen or rule == 3 then
      if cost > r.params[1] then
        -- a deferral pending, or starting now (a newer caller's rule 3): until the expiry
        local start = gen > r.g and r.pe <= gen
        if r.pe > 0 or start then
          return { reply = h.until_expiry(raw, now, commit, start and gen + 1 or nil, r) }
        end
        return { over = r.params[1] }
      end
      local out = { raw = raw,
        arg = cmsgpack.pack(r.tag, r.g, 0, unpack(r.params)) .. cmsgpack.pack(1, cost, commit) }
      if gen > r.g and r.pe <= gen then
        out.raw = cmsgpack.pack(r.tag, r.g, gen + 1) .. string.sub(raw, r.skip + 1)
        out.force = true
      end
      return out
    end
    if rule == 0 then return { eff = r.eff, used = 0 } end
    local used
    if rule == 1 then
      local q = r.used % r.unit
      used = h.muldiv((r.used - q) / r.unit + (q > 0 and 1 or 0), unit, 1, total)
    else
      used = total - h.muldiv(r.total - r.used, total, r.total, total)
    end
    return { eff = r.eff, used = used }
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
