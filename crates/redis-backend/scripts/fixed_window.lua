-- tollgate fixed window: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::fixed_window::apply exactly, after the prelude's
-- policy-change rules.
-- KEYS[1] bucket key
-- ARGV    limit, window_us, generation, transition (0 reset, 1 carry, 2 proportional,
--         3 defer), cost, commit (1 acquire, 0 peek)
-- record  2, generation, pending, limit, window_us, window_start_us, count
-- returns {allowed 1/0 (-1: cost above the governing limit, nothing written), remaining,
--          retry_after_us (-1 when allowed), reset_after_us, governing limit}
local ok, limit, window, gen, rule, cost, commit
if #K == 1 and #A == 6 then ok, limit, window, gen, rule, cost, commit = pcall(numbers, 6) end
if not (ok and limit >= 1 and limit <= MAX and limit % 1 == 0 and window >= 1
    and window <= MAX and window % 1 == 0 and gen >= 0 and gen <= MAX and gen % 1 == 0
    and rule >= 0 and rule <= 3 and rule % 1 == 0 and cost >= 1 and cost <= MAX
    and cost % 1 == 0 and (commit == 0 or commit == 1)) then
  return slow().refuse({ 'limit', 1, MAX, 'window_us', 1, MAX, 'generation', 0, MAX,
    'transition', 0, 3, 'cost', 1, MAX, 'commit', 0, 1 })
end
if cost > limit then return bad('cost exceeds limit') end

local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]

-- the governing parameters, generation and pending deferral; the stored window and count
local glimit, gwindow, g, pe, changed, keep = limit, window, gen, 0, true, false
local st, cnt
local raw = redis.call('GET', K[1])
-- the record's fields, or nothing when it is malformed (a missing bucket): a non-number
-- fails its comparison inside the pcall
local function record()
  local tag, rg, rpe, rlimit, rwindow, rstart, rcount, extra = cmsgpack.unpack(raw)
  if tag == 2 and rcount and extra == nil and rg >= 0 and rg <= MAX and rpe >= 0
      and rpe <= MAX + 1 and rlimit >= 1 and rlimit <= MAX and rwindow >= 1
      and rwindow <= MAX and rstart >= 0 and rstart <= MAX * 2 and rcount >= 0
      and rcount <= MAX then
    return rg, rpe, rlimit, rwindow, rstart, rcount
  end
end
local rg, rpe, rlimit, rwindow, rstart, rcount
if raw then ok, rg, rpe, rlimit, rwindow, rstart, rcount = pcall(record) end
if ok and rcount then
  local newer = gen > rg or (gen == rg and not (rlimit == limit and rwindow == window))
  if newer and rpe <= gen and rule ~= 3 then
    -- convert: what the current window has used under the old parameters; then the rule
    local eff, used = now, 0
    if rstart >= now - now % rwindow then
      eff, used = rstart > now and rstart or now, rcount
    end
    st = eff - eff % window
    if rule == 1 then
      cnt = used
    elseif rule == 2 then
      cnt = limit - slow().muldiv(rlimit - (used < rlimit and used or rlimit), limit, rlimit, limit)
    else
      cnt = 0
    end
  else
    -- the stored parameters govern; a newer caller with rule 3 starts a deferral
    glimit, gwindow, g, st, cnt = rlimit, rwindow, rg, rstart, rcount
    if newer and rpe <= gen then
      pe, keep = gen + 1, true
    else
      pe, changed, keep = rpe, false, rpe > 0
    end
  end
end
if cost > glimit then return { -1, 0, -1, 0, glimit } end

-- a stored window later than the current one (clock stepped back) stays in force
local start, count = now - now % gwindow, 0
if st and st >= start then start, count = st, cnt end
local until_end = start + gwindow - now
local allowed, retry = 0, until_end
if count + cost <= glimit then allowed, retry, count = 1, -1, count + cost end
if commit == 1 and (allowed == 1 or changed) then
  local rec = cmsgpack.pack(2, g, pe, glimit, gwindow, start, count)
  write(rec, keep, until_end)
end
return { allowed, glimit > count and glimit - count or 0, retry, until_end, glimit }
