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

Faults (`flare.state.remote_link`): a failed or timed-out call marks the tier down;
while down, calls return "absent" at once, so serving goes on without the tier
(recompute, never an error), until the monitor reaches Redis again. The Lua scripts are
in `flare.state.remote_scripts`, the shared session names in `flare.state.remote_sessions`.
The index calls the engine thread makes (contains, children) are single round trips;
record bytes move only on the transfer worker (`flare.state.transfer`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from flare.state import disk_records as rec
from flare.state import remote_scripts
from flare.state.disk_records import KINDS, RecordError, StateRecord
from flare.state.record_stats import RecordTierStats
from flare.state.remote_link import RedisLink, RemoteTierConfig, _Down

__all__ = ["DEFAULT_BYTES_PER_S", "RemoteTier", "RemoteTierStats"]

log = logging.getLogger(__name__)

DEFAULT_BYTES_PER_S = 1e8  # assumed until the first probe or read measures it
_EWMA = 0.3  # weight of the newest bandwidth sample


@dataclass
class RemoteTierStats(RecordTierStats):
    """`RecordTierStats` since this RemoteTier was opened, and the link's and sharing
    counters (`as_stats` names them `remote_tier_<field>_total`)."""

    errors: int = 0  # Redis calls that failed (connection, timeout, server error)
    skipped: int = 0  # calls answered "absent" without Redis because it was down
    outages: int = 0  # up -> down transitions
    shares: int = 0  # finished requests whose state was written through (engine)
    share_refused: int = 0  # finishes whose write-through failed to queue (an error)
    reconnects: int = 0  # down -> up transitions


class RemoteTier(RedisLink):
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
        self.namespace, self.layout = namespace, layout
        self.budget_bytes = config.budget_bytes
        self.format_version = rec.FORMAT_VERSION
        self.prefix = "flare:" + hashlib.blake2b(f"{namespace}\n{layout}".encode(),
                                                 digest_size=8).hexdigest()
        self.bytes_per_s = DEFAULT_BYTES_PER_S
        self.on_bandwidth = on_bandwidth
        super().__init__(config, RemoteTierStats(), client)
        self._put = self._client.register_script(remote_scripts.PUT)
        self._remove = self._client.register_script(remote_scripts.REMOVE)
        self._touch = self._client.register_script(remote_scripts.TOUCH)
        self._touch_many = self._client.register_script(remote_scripts.TOUCH_MANY)
        if self._up:
            self._probe()
        self.start_monitor()

    def _probe(self, reads: int = 3) -> None:
        """Measure read bandwidth with 1 MiB (a scratch key, deleted after): the fastest
        of `reads` reads. A busy machine only ever slows a read down, and one slow probe
        at start-up would make the cost policy refuse every restore from Redis, so no
        read would ever measure the tier again."""
        key = f"{self.prefix}:probe:{os.getpid()}"
        blob = os.urandom(1 << 20)
        best = float("inf")
        try:
            self._call(lambda: self._client.set(key, blob, ex=60))
            for _ in range(reads):
                t0 = time.perf_counter()
                got = self._call(lambda: self._client.get(key))
                dt = time.perf_counter() - t0
                if got == blob:
                    best = min(best, dt)
            self._call(lambda: self._client.delete(key))
        except _Down:
            return
        if 0 < best < float("inf"):
            self._bandwidth(len(blob), best, first=True)

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

    def touch_many(self, keys: set[bytes] | list[bytes]) -> None:
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

    def as_stats(self) -> dict[str, int]:
        """Counters as `remote_tier_<field>_total`, the gauge `remote_tier_up` (0/1) and
        the measured read bandwidth `remote_tier_read_bytes_per_second`."""
        with self._lock:
            out = self.stats.named("remote")
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
        with self._lock:
            self.stats.count_rejected(reason)
        self._call(lambda: self._remove(args=[self.prefix, h]))


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


