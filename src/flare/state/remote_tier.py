"""Remote tier of conversation state: verified records in Redis, shared by replicas.

The tier below the host tier when several `flare serve` replicas of one package run
behind a gateway (`flare serve --remote-tier redis://HOST:PORT/DB`, docs/scale-out.md).
It offers the same interface as `flare.state.disk_tier.DiskTier` (contains, children, get,
put, remove, ...), so `TierStore` and the transfer tickets use it unchanged, and it stores
the same self-describing, checksummed records (`flare.state.disk_records`), verified whole
on every read: a foreign, old or damaged record is deleted and counted, never used.

Redis keys (P = "flare:" + BLAKE2b-64 of namespace and layout, so two packages or two
layouts sharing one Redis never see each other's keys):

    P:r:<key hex>   string   one encoded record (the disk tier's file bytes)
    P:m             hash     key hex -> "kind parent position nbytes tokens" (the index)
    P:c:<parent>:<kind> set  key hex of the records of `kind` filed under `parent`
    P:lru           zset     key hex -> last use (Redis server clock, microseconds)
    P:bytes         string   bytes of all records (what the budget bounds)
    P:s             hash     session name -> JSON {tokens, saved_tokens, saved_at, digest}

Atomicity. A record is stored, and the budget enforced (least recently used records
evicted first), by one Lua script, so a replica that dies mid-write leaves either the
whole record with its index entries or nothing, and two replicas writing one key store it
once. A session name is one hash field written in one command after every record of its
chain was written: two replicas saving one name at once leave one complete session.
Redis Cluster is not supported (the scripts touch keys they compute).

Faults. Every call has a short socket timeout (`timeout_s`). A failure marks the tier
down (logged once, counted): while down, calls return "absent" at once without touching
the network, so serving goes on without the tier (recompute, never an error), and a
monitor thread pings every `ping_interval_s` and marks it up again when Redis answers.
The index calls the engine thread makes (contains, children) are single round trips;
record bytes move only on the transfer worker (`flare.state.transfer`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from flare.state import disk_records as rec
from flare.state.disk_records import KINDS, RecordError, StateRecord

__all__ = ["RemoteTier", "RemoteTierConfig", "RemoteTierStats", "RemoteSessions",
           "DEFAULT_BYTES_PER_S"]

log = logging.getLogger(__name__)

DEFAULT_BYTES_PER_S = 1e8  # assumed until the first probe or read measures it
_EWMA = 0.3  # weight of the newest bandwidth sample

# KEYS: none (computed from ARGV[1], the prefix). ARGV: prefix, key hex, record bytes,
# meta, parent hex, kind, budget bytes, nbytes. Returns {status, evicted}: status 1 stored,
# 0 already stored (touched), -1 larger than the budget.
_PUT = """
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
_REMOVE = """
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
_TOUCH = """
local t = redis.call('TIME')
if redis.call('HEXISTS', ARGV[1] .. ':m', ARGV[2]) == 1 then
  redis.call('ZADD', ARGV[1] .. ':lru', tonumber(t[1]) * 1000000 + tonumber(t[2]), ARGV[2])
end
return 1
"""

# ARGV: prefix, key hex... Touch (LRU) the indexed ones of many records in one call.
_TOUCH_MANY = """
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


@dataclass(frozen=True)
class RemoteTierConfig:
    """Where and how big the remote tier is (`flare serve --remote-tier ...`).

    Attributes:
        url: `redis://[user:password@]HOST:PORT/DB` or `rediss://...` (TLS).
        password: overrides a password in the URL (None: the URL's, or none).
        budget_bytes: most bytes of records kept in Redis for this package and layout
            (give every replica the same figure: each enforces its own on its writes).
        timeout_s: socket connect and command timeout, seconds.
        ping_interval_s: while down, how often the monitor retries, seconds.
        tls_ca: a CA file for `rediss://` (None: the system's).

    Raises:
        ValueError: a URL that is not redis:// or rediss://, a budget < 0, a timeout <= 0.
    """

    url: str
    password: str | None = None
    budget_bytes: int = 1 << 30
    timeout_s: float = 0.25
    ping_interval_s: float = 1.0
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ValueError(f"--remote-tier must be redis://HOST:PORT/DB or "
                             f"rediss://HOST:PORT/DB, got {self.redacted()!r}")
        if self.budget_bytes < 0:
            raise ValueError(f"remote tier budget must be >= 0 bytes, got {self.budget_bytes}")
        if self.timeout_s <= 0 or self.ping_interval_s <= 0:
            raise ValueError("remote tier timeouts must be > 0 seconds")

    def redacted(self) -> str:
        """The URL with any password replaced by '***' (for logs and errors)."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return parts._replace(netloc=netloc).geturl()


@dataclass
class RemoteTierStats:
    """Counters since this RemoteTier was opened (`as_stats` names them
    `remote_tier_<field>_total`). `rejected_*` count records rejected whole, by reason
    (`disk_records.REASONS`), as the disk tier does."""

    written: int = 0
    write_failures: int = 0
    refused: int = 0
    touched: int = 0
    read_hits: int = 0
    read_misses: int = 0
    evicted: int = 0
    removed: int = 0
    errors: int = 0  # Redis calls that failed (connection, timeout, server error)
    skipped: int = 0  # calls answered "absent" without Redis because it was down
    outages: int = 0  # up -> down transitions
    shares: int = 0  # finished requests whose state was written through (engine)
    share_refused: int = 0  # write-throughs refused (transfer queue full, too big)
    reconnects: int = 0  # down -> up transitions
    rejected_checksum: int = 0
    rejected_truncated: int = 0
    rejected_namespace: int = 0
    rejected_version: int = 0
    rejected_layout: int = 0
    rejected_missing: int = 0
    rejected_malformed: int = 0
    rejected_io: int = 0


class _Down(Exception):
    """Internal: the tier is down; the caller answers its default."""


class RemoteTier:
    """Records of one namespace and layout in Redis, at most `budget_bytes` in all.

    Args:
        config: the URL, password, budget and timeouts.
        namespace: the package id; only its records are offered.
        layout: the state layout as a string (as for `DiskTier`).
        on_bandwidth: called with the measured read bandwidth (bytes/s) after the start-up
            probe and after each record read (the admission cost policy's "remote" speed).
        client: a ready `redis.Redis` (tests); None: one is made from `config`.

    Never raises because Redis is unreachable: the tier starts down and comes up when the
    monitor reaches it.
    """

    tier_name = "remote"

    def __init__(self, config: RemoteTierConfig, namespace: str, layout: str,
                 on_bandwidth: Callable[[float], None] = lambda bps: None,
                 client: object | None = None) -> None:
        self.config = config
        self.namespace, self.layout = namespace, layout
        self.budget_bytes = config.budget_bytes
        self.format_version = rec.FORMAT_VERSION
        self.prefix = "flare:" + hashlib.blake2b(f"{namespace}\n{layout}".encode(),
                                                 digest_size=8).hexdigest()
        self.stats = RemoteTierStats()
        self.bytes_per_s = DEFAULT_BYTES_PER_S
        self.on_bandwidth = on_bandwidth
        self._lock = threading.Lock()  # counters, state transitions
        self._up = False
        self._closed = threading.Event()
        self._client = client if client is not None else _make_client(config)
        self._put = self._client.register_script(_PUT)
        self._remove = self._client.register_script(_REMOVE)
        self._touch = self._client.register_script(_TOUCH)
        self._touch_many = self._client.register_script(_TOUCH_MANY)
        self._check()
        if self._up:
            self._probe()
        self._monitor = threading.Thread(target=self._watch, name="flare-remote-tier",
                                         daemon=True)
        self._monitor.start()

    # ---- health -------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        """Whether Redis answered the last call (False: serving without the tier)."""
        return self._up

    def health(self) -> str:
        """"ok" or "down"."""
        return "ok" if self._up else "down"

    def _check(self) -> bool:
        try:
            self._client.ping()
        except Exception as exc:  # redis.RedisError, OSError: Redis is not there
            self._mark_down(exc)
            return False
        self._mark_up()
        return True

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            self.stats.errors += 1
            was_up, self._up = self._up, False
            if was_up or self.stats.outages == 0:
                self.stats.outages += 1
                log.warning("remote tier %s unreachable (%s): serving without it until it "
                            "answers again", self.config.redacted(), exc)

    def _mark_up(self) -> None:
        with self._lock:
            was_up, self._up = self._up, True
            if not was_up:
                if self.stats.outages:
                    self.stats.reconnects += 1
                log.info("remote tier %s is up", self.config.redacted())

    def _watch(self) -> None:
        while not self._closed.wait(self.config.ping_interval_s):
            if not self._up:
                self._check()

    def _call(self, fn: Callable[[], object]) -> object:
        """Run one Redis call; raises _Down (counted) when the tier is or goes down."""
        if not self._up or self._closed.is_set():
            with self._lock:
                self.stats.skipped += 1
            raise _Down
        try:
            return fn()
        except Exception as exc:  # any client error: the tier is unusable for now
            self._mark_down(exc)
            raise _Down from None

    def _probe(self) -> None:
        """Measure read bandwidth once with 1 MiB (a scratch key, deleted after)."""
        key = f"{self.prefix}:probe:{os.getpid()}"
        blob = os.urandom(1 << 20)
        try:
            self._call(lambda: self._client.set(key, blob, ex=60))
            t0 = time.perf_counter()
            got = self._call(lambda: self._client.get(key))
            dt = time.perf_counter() - t0
            self._call(lambda: self._client.delete(key))
        except _Down:
            return
        if got == blob and dt > 0:
            self._bandwidth(len(blob), dt, first=True)

    def _bandwidth(self, nbytes: int, seconds: float, first: bool = False) -> None:
        if nbytes < 4096 or seconds <= 0:
            return  # tiny reads measure latency, not bandwidth
        sample = nbytes / seconds
        self.bytes_per_s = sample if first else (1 - _EWMA) * self.bytes_per_s + _EWMA * sample
        try:
            self.on_bandwidth(self.bytes_per_s)
        except Exception:
            log.exception("remote tier bandwidth callback failed")

    # ---- queries (the DiskTier interface) -----------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of this namespace's records in Redis (0 while down)."""
        try:
            return int(self._call(lambda: self._client.get(self.prefix + ":bytes")) or 0)
        except _Down:
            return 0

    def __len__(self) -> int:
        """Records offered (0 while down)."""
        try:
            return int(self._call(lambda: self._client.hlen(self.prefix + ":m")))
        except _Down:
            return 0

    def contains(self, key: bytes) -> bool:
        """Whether a record of `key` is indexed (`get` may still reject it)."""
        return key in self.contains_many([key])

    def contains_many(self, keys: list[bytes]) -> set[bytes]:
        """The keys of `keys` indexed in Redis, one HMGET per 500 keys (empty while down)."""
        found: set[bytes] = set()
        try:
            for i in range(0, len(keys), 500):
                part = keys[i:i + 500]
                metas = self._call(lambda: self._client.hmget(self.prefix + ":m",
                                                              [k.hex() for k in part]))
                found.update(k for k, m in zip(part, metas) if m is not None)
        except _Down:
            return set()
        return found

    def offered(self, keys: list[bytes]) -> set[bytes]:
        """`contains_many` under the disk tier's other name (the tier store asks it)."""
        return self.contains_many(list(keys))

    def children(self, parent: bytes, kind: str) -> list[tuple[bytes, tuple[int, ...], int]]:
        """(key, tokens, position) of records of `kind` under `parent`, ordered by
        position then key (empty while down). Does not touch (LRU).

        Raises:
            ValueError: `kind` is not one of `KINDS`.
        """
        if kind not in KINDS:
            raise ValueError(f"record kind {kind!r} is not one of {KINDS}")
        try:
            members = self._call(lambda: self._client.smembers(
                f"{self.prefix}:c:{parent.hex()}:{kind}"))
            if not members:
                return []
            hexes = sorted(m.decode() for m in members)
            metas = self._call(lambda: self._client.hmget(self.prefix + ":m", hexes))
        except _Down:
            return []
        out = []
        for h, m in zip(hexes, metas):
            parsed = _parse_meta(m)
            if parsed is not None and parsed[0] == kind:
                out.append((bytes.fromhex(h), parsed[3], parsed[2]))
        return sorted(out, key=lambda r: (r[2], r[0]))

    def keys(self, kind: str | None = None) -> list[bytes]:
        """Keys of indexed records (of one kind, or all), least recently used first."""
        try:
            hexes = [h.decode() for h in self._call(
                lambda: self._client.zrange(self.prefix + ":lru", 0, -1))]
            if kind is None:
                return [bytes.fromhex(h) for h in hexes]
            metas = self._call(lambda: self._client.hmget(self.prefix + ":m", hexes)) \
                if hexes else []
        except _Down:
            return []
        return [bytes.fromhex(h) for h, m in zip(hexes, metas)
                if (p := _parse_meta(m)) is not None and p[0] == kind]

    # ---- read / write -------------------------------------------------------------------

    def get(self, key: bytes) -> StateRecord | None:
        """Read and verify the record of `key`; touches it (LRU).

        Returns:
            The whole record (fresh CPU tensors), or None: not stored, Redis down, or
            rejected (then it is deleted from Redis and `stats.rejected_<reason>` counts
            it). Never raises for a bad record or an unreachable Redis.
        """
        h = key.hex()
        try:
            t0 = time.perf_counter()
            blob = self._call(lambda: self._client.get(f"{self.prefix}:r:{h}"))
            dt = time.perf_counter() - t0
            if blob is None:
                meta = self._call(lambda: self._client.hexists(self.prefix + ":m", h))
                if meta:  # indexed without its bytes (a damaged or flushed Redis)
                    self._reject(h, "missing")
                else:
                    self._count("read_misses")
                return None
            try:
                record = rec.read(io.BytesIO(blob), len(blob), self.namespace, self.layout,
                                  key, self.format_version)
            except RecordError as e:
                self._reject(h, e.reason)
                return None
            self._call(lambda: self._touch(args=[self.prefix, h]))
        except _Down:
            return None
        self._count("read_hits")
        self._bandwidth(len(blob), dt)
        return record

    def put(self, record: StateRecord) -> bool:
        """Store a record atomically (one Lua script), evicting least recently used
        records to stay within the budget. Call it off the engine's step loop.

        Returns:
            True when stored (or already stored: then only touched); False when it alone
            exceeds the budget (`stats.refused`) or Redis is down (`write_failures`).

        Raises:
            ValueError: a tensor dtype the format cannot store.
        """
        h = record.key.hex()
        try:
            if self._call(lambda: self._client.hexists(self.prefix + ":m", h)):
                self._call(lambda: self._touch(args=[self.prefix, h]))
                self._count("touched")
                return True
        except _Down:
            self._count("write_failures")
            return False
        encoded = rec.encode(record, self.namespace, self.layout, self.format_version)
        buf = io.BytesIO()
        rec.write(buf, encoded)
        blob = buf.getvalue()
        meta = " ".join([record.kind, record.parent.hex(), str(int(record.position)),
                         str(len(blob)), ",".join(str(int(t)) for t in record.tokens)])
        try:
            status, evicted = self._call(lambda: self._put(args=[
                self.prefix, h, blob, meta, record.parent.hex(), record.kind,
                self.budget_bytes, len(blob)]))
        except _Down:
            self._count("write_failures")
            return False
        with self._lock:
            self.stats.evicted += int(evicted)
            if status == -1:
                self.stats.refused += 1
            elif status == 0:
                self.stats.touched += 1
            else:
                self.stats.written += 1
        return status != -1

    def touch_many(self, keys: "set[bytes] | list[bytes]") -> None:
        """Mark indexed records of `keys` used now (LRU), one call per 500 keys; a save
        of a conversation whose pages are stored already touches them instead of
        rewriting them (nothing while down)."""
        keys = list(keys)
        try:
            for i in range(0, len(keys), 500):
                part = [k.hex() for k in keys[i:i + 500]]
                self._call(lambda: self._touch_many(args=[self.prefix, *part]))
        except _Down:
            pass

    def remove(self, key: bytes) -> None:
        """Delete the record of `key` and its index entries (nothing if absent or down)."""
        try:
            if self._call(lambda: self._remove(args=[self.prefix, key.hex()])):
                self._count("removed")
        except _Down:
            pass

    def close(self) -> None:
        """Stop the monitor and close the connections (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._monitor.join(timeout=2)
        try:
            self._client.close()
        except Exception:
            pass

    def as_stats(self) -> dict[str, int]:
        """Counters as `remote_tier_<field>_total`, the gauge `remote_tier_up` (0/1) and
        the measured read bandwidth `remote_tier_read_bytes_per_second`."""
        with self._lock:
            out = {f"remote_tier_{k}_total": v for k, v in asdict(self.stats).items()}
        out["remote_tier_up"] = int(self._up)
        out["remote_tier_budget_bytes"] = self.budget_bytes
        out["remote_tier_read_bytes_per_second"] = int(self.bytes_per_s)
        return out

    def check_integrity(self) -> None:
        """Assert the index agrees with the records (tests): every indexed key has its
        bytes, an LRU entry and its child-set entry, and the byte count adds up.

        Raises:
            AssertionError: naming the first disagreement.
        """
        c, p = self._client, self.prefix
        metas = {h.decode(): m for h, m in c.hgetall(p + ":m").items()}
        lru = {h.decode() for h in c.zrange(p + ":lru", 0, -1)}
        total = 0
        for h, m in metas.items():
            kind, parent, _, tokens, nb = _parse_meta(m, with_nbytes=True)
            assert c.strlen(f"{p}:r:{h}") == nb, f"{h}: record bytes differ from the index"
            assert h in lru, f"{h}: no LRU entry"
            assert c.sismember(f"{p}:c:{parent}:{kind}", h), f"{h}: not in its child set"
            total += nb
        assert lru == set(metas), "an LRU entry without an index entry"
        assert int(c.get(p + ":bytes") or 0) == total, "byte count differs from the index"
        assert total <= self.budget_bytes, "records over the budget"

    # ---- internals ----------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _reject(self, h: str, reason: str) -> None:
        log.warning("remote tier record %s rejected: %s", h, reason)
        self._count(f"rejected_{reason}")
        self._call(lambda: self._remove(args=[self.prefix, h]))


class RemoteSessions:
    """Saved session names in Redis, shared by every replica of one package.

    One hash field per name holds the JSON of the session's tokens, saved positions, the
    save time and a BLAKE2b digest of them; it is written in one HSET after the records
    of its chain were written, so a reader sees a whole session or none, and of two
    replicas saving one name at once the later write wins whole. An entry that fails its
    digest (or is not ours) is ignored and counted.

    Args:
        tier: the remote tier (its client, prefix and fault handling are shared).
    """

    def __init__(self, tier: RemoteTier) -> None:
        self.tier = tier
        self.key = tier.prefix + ":s"
        self.rejected = 0

    def put(self, name: str, tokens: list[int], saved_tokens: int) -> bool:
        """Publish `name` -> (tokens, saved_tokens). False when Redis is down."""
        body = {"namespace": self.tier.namespace, "tokens": [int(t) for t in tokens],
                "saved_tokens": int(saved_tokens), "saved_at": time.time()}
        body["digest"] = _session_digest(body)
        data = json.dumps(body, separators=(",", ":"))
        try:
            self.tier._call(lambda: self.tier._client.hset(self.key, name, data))
        except _Down:
            return False
        return True

    def get(self, name: str) -> tuple[list[int], int, float] | None:
        """(tokens, saved_tokens, saved_at) of `name`, or None: absent, down or damaged."""
        try:
            raw = self.tier._call(lambda: self.tier._client.hget(self.key, name))
        except _Down:
            return None
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            ok = (body["namespace"] == self.tier.namespace
                  and body["digest"] == _session_digest(body))
            tokens = [int(t) for t in body["tokens"]]
            saved = int(body["saved_tokens"])
            at = float(body["saved_at"])
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            self.rejected += 1
            log.warning("remote session %r ignored: damaged or not this package's", name)
            return None
        return tokens, saved, at

    def delete(self, name: str) -> None:
        """Forget `name` (nothing if absent or down)."""
        try:
            self.tier._call(lambda: self.tier._client.hdel(self.key, name))
        except _Down:
            pass


def _session_digest(body: dict) -> str:
    core = json.dumps([body["namespace"], body["tokens"], body["saved_tokens"],
                       body["saved_at"]], separators=(",", ":"))
    return hashlib.blake2b(core.encode(), digest_size=16).hexdigest()


def _parse_meta(m: bytes | None, with_nbytes: bool = False):
    """(kind, parent hex, position, tokens) of an index entry ((.., nbytes) with
    `with_nbytes`), or None when it is absent or malformed."""
    if m is None:
        return None
    try:
        kind, parent, position, nbytes, *rest = m.decode().split(" ")
        tokens = tuple(int(t) for t in rest[0].split(",")) if rest and rest[0] else ()
        out = (kind, parent, int(position), tokens)
        return (*out, int(nbytes)) if with_nbytes else out
    except ValueError:
        return None


def _make_client(config: RemoteTierConfig):
    """A `redis.Redis` from the URL: short timeouts, no retries (a failure marks the tier
    down at once; the monitor reconnects)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kwargs = dict(socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s,
                  retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
                  health_check_interval=0)
    if config.password is not None:
        kwargs["password"] = config.password
    if config.url.startswith("rediss://") and config.tls_ca:
        kwargs["ssl_ca_certs"] = config.tls_ca
    return redis.Redis.from_url(config.url, **kwargs)
