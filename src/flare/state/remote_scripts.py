"""The Lua scripts the Redis remote tier runs (`flare.state.remote_tier`): each is one
atomic step on the tier's keys (layout in that module's docstring), so a replica that dies
mid-call leaves the whole change or none. They touch keys they compute from the prefix,
so Redis Cluster is not supported."""

# KEYS: none (computed from ARGV[1], the prefix). ARGV: prefix, key hex, record bytes,
# meta, parent hex, kind, budget bytes, nbytes. Returns {status, evicted}: status 1 stored,
# 0 already stored (touched), -1 larger than the budget.
PUT = """
local p, h = ARGV[1], ARGV[2]
local rk = p .. ':r:' .. h
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if redis.call('HEXISTS', p .. ':m', h) == 1 and redis.call('EXISTS', rk) == 1 then
  redis.call('ZADD', p .. ':lru', now, h)
  return {0, 0}
end
local n, budget = tonumber(ARGV[8]), tonumber(ARGV[7])
if n > budget then return {-1, 0} end
local used = tonumber(redis.call('GET', p .. ':bytes') or '0')
local evicted = 0
while used + n > budget do
  local old = redis.call('ZPOPMIN', p .. ':lru')
  if #old == 0 then used = 0 break end
  local oh = old[1]
  local m = redis.call('HGET', p .. ':m', oh)
  redis.call('DEL', p .. ':r:' .. oh)
  redis.call('HDEL', p .. ':m', oh)
  if m then
    local kind, parent, _, nb = string.match(m, '^(%S+) (%S+) (%S+) (%S+)')
    redis.call('SREM', p .. ':c:' .. parent .. ':' .. kind, oh)
    used = used - tonumber(nb)
  end
  evicted = evicted + 1
end
redis.call('SET', rk, ARGV[3])
redis.call('HSET', p .. ':m', h, ARGV[4])
redis.call('SADD', p .. ':c:' .. ARGV[5] .. ':' .. ARGV[6], h)
redis.call('ZADD', p .. ':lru', now, h)
redis.call('SET', p .. ':bytes', used + n)
return {1, evicted}
"""

# ARGV: prefix, key hex. Deletes a record and its index entries; returns 1 if it existed.
REMOVE = """
local p, h = ARGV[1], ARGV[2]
local m = redis.call('HGET', p .. ':m', h)
redis.call('DEL', p .. ':r:' .. h)
redis.call('ZREM', p .. ':lru', h)
if not m then return 0 end
redis.call('HDEL', p .. ':m', h)
local kind, parent, _, nb = string.match(m, '^(%S+) (%S+) (%S+) (%S+)')
redis.call('SREM', p .. ':c:' .. parent .. ':' .. kind, h)
redis.call('DECRBY', p .. ':bytes', tonumber(nb))
return 1
"""

# ARGV: prefix, key hex. Touch (LRU) a record that was just read and verified.
TOUCH = """
local t = redis.call('TIME')
if redis.call('HEXISTS', ARGV[1] .. ':m', ARGV[2]) == 1 then
  redis.call('ZADD', ARGV[1] .. ':lru', tonumber(t[1]) * 1000000 + tonumber(t[2]), ARGV[2])
end
return 1
"""

# ARGV: prefix, key hex... Touch (LRU) the indexed ones of many records in one call.
TOUCH_MANY = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n = 0
for i = 2, #ARGV do
  if redis.call('HEXISTS', ARGV[1] .. ':m', ARGV[i]) == 1 then
    redis.call('ZADD', ARGV[1] .. ':lru', now, ARGV[i])
    n = n + 1
  end
end
return n
"""
