-- tollgate fixed window: one atomic decision on Redis time.
-- Mirrors tollgate_core::algorithm::fixed_window::apply exactly, after the prelude's
-- policy-change rules.
-- KEYS[1] bucket key
-- ARGV    limit, window_us, generation, transition (0 reset, 1 carry, 2 proportional,
--         3 defer), cost, commit (1 acquire, 0 peek)
-- record  tag 2; generation, pending, limit, window_us, window_start_us, count
-- returns {allowed 1/0 (-1: cost above the governing limit, nothing written), remaining,
--          retry_after_us (-1 when allowed), reset_after_us, governing limit}
if #KEYS ~= 1 then return bad('expected 1 key') end
if #ARGV ~= 6 then
  return bad('expected 6 arguments: limit window_us generation transition cost commit')
end
local limit = int(ARGV[1], 1, MAX)
if not limit then return bad('limit must be an integer in [1, 2^52]') end
local window = int(ARGV[2], 1, MAX)
if not window then return bad('window_us must be an integer in [1, 2^52]') end
local gen = int(ARGV[3], 0, MAX)
if not gen then return bad('generation must be an integer in [0, 2^52]') end
local rule = int(ARGV[4], 0, 3)
if not rule then return bad('transition must be 0, 1, 2 or 3') end
local cost = int(ARGV[5], 1, MAX)
if not cost then return bad('cost must be an integer in [1, 2^52]') end
local commit = int(ARGV[6], 0, 1)
if not commit then return bad('commit must be 0 or 1') end
if cost > limit then return bad('cost exceeds limit') end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local rec
local raw = redis.call('GET', KEYS[1])
if raw and string.byte(raw, 1) == 2 then
  local v, pos = getv(raw, 2, 6)
  if v and pos == #raw + 1 and v[1] <= MAX and v[2] <= MAX + 1 and v[3] >= 1 and v[3] <= MAX
      and v[4] >= 1 and v[4] <= MAX and v[5] <= MAX * 2 and v[6] <= MAX then
    rec = { gen = v[1], pe = v[2], params = { v[3], v[4] }, start = v[5], count = v[6] }
  end
end

local P = { limit, window }
local mode = plan(rec, gen, P, rule)
local g, pe, st, cnt, changed, keep = gen, 0, nil, nil, true, false
if mode == 'stored' or mode == 'defer' then
  P, g, st, cnt = rec.params, rec.gen, rec.start, rec.count
  if mode == 'stored' then
    pe, changed, keep = rec.pe, false, rec.pe > 0
  else
    pe, keep = gen + 1, true
  end
elseif mode == 'convert' then
  local o = rec.params
  local eff, used = now, 0
  if rec.start >= now - now % o[2] then eff, used = math.max(now, rec.start), rec.count end
  st = eff - eff % window
  if rule == 1 then
    cnt = used
  elseif rule == 2 then
    cnt = limit - muldiv(o[1] - math.min(used, o[1]), limit, o[1], limit)
  else
    cnt = 0
  end
end
local glimit, gwindow = P[1], P[2]
if cost > glimit then return { -1, 0, -1, 0, glimit } end

-- a stored window later than the current one (clock stepped back) stays in force
local start, count = now - now % gwindow, 0
if st and st >= start then start, count = st, cnt end
local until_end = start + gwindow - now
local allowed, retry = 0, until_end
if count + cost <= glimit then allowed, retry, count = 1, -1, count + cost end
if commit == 1 and (allowed == 1 or changed) then
  write(KEYS[1], string.char(2) .. putv(g) .. putv(pe) .. putv(glimit) .. putv(gwindow)
    .. putv(start) .. putv(count), keep, until_end)
end
return { allowed, math.max(glimit - count, 0), retry, until_end, glimit }
