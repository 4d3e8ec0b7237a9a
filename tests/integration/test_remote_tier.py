"""The Redis remote tier against a real redis-server on 127.0.0.1: records round-trip
exactly, the budget holds by LRU, a corrupt / foreign / old record written straight into
Redis is rejected whole and counted, a killed Redis is survived (absent, never an
exception) and the tier comes back when Redis does, saved session names are shared."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from redis_process import RedisProcess

from flare.state import disk_records
from flare.state.disk_records import StateRecord
from flare.state.remote_link import RemoteTierConfig
from flare.state.remote_sessions import RemoteSessions
from flare.state.remote_tier import RemoteTier

NS, LAYOUT = "pkg-a", '{"layers": 2}'


def record(i: int, parent: bytes = b"\0" * 16, kind: str = "page", n: int = 1000) -> StateRecord:
    g = torch.Generator().manual_seed(i)
    return StateRecord(kind, bytes([i % 256]) * 16, parent, tuple(range(i, i + 4)), i,
                       {"k": torch.randn(n, generator=g), "v": torch.randn(n, generator=g)})


def equal(a: StateRecord, b: StateRecord) -> bool:
    return (a.kind, a.key, a.parent, a.tokens, a.position) == (
        b.kind, b.key, b.parent, b.tokens, b.position) and all(
        torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


@pytest.fixture
def redis(tmp_path):
    server = RedisProcess(tmp_path / "redis")
    yield server
    server.stop()


def tier(server: RedisProcess, budget: int = 1 << 20, namespace: str = NS,
         layout: str = LAYOUT) -> RemoteTier:
    return RemoteTier(RemoteTierConfig(server.url, budget_bytes=budget, timeout_s=0.5,
                                       ping_interval_s=0.1), namespace, layout)


def test_records_round_trip_and_index(redis):
    t = tier(redis)
    try:
        a, b = record(1), record(2, parent=bytes([1]) * 16, kind="tail")
        assert t.put(a) and t.put(b) and t.put(a)  # the second put of a only touches
        assert t.stats.written == 2 and t.stats.touched == 1
        assert equal(t.get(a.key), a) and equal(t.get(b.key), b)
        assert t.contains_many([a.key, b.key, b"\7" * 16]) == {a.key, b.key}
        assert t.children(bytes([1]) * 16, "tail") == [(b.key, b.tokens, b.position)]
        assert len(t) == 2 and t.bytes_per_s > 0
        t.check_integrity()
        t.remove(a.key)
        assert t.get(a.key) is None and len(t) == 1
        t.check_integrity()
    finally:
        t.close()


def test_budget_evicts_least_recently_used(redis):
    size = len(_encoded(record(1)))
    t = tier(redis, budget=3 * size + 10)
    try:
        for i in (1, 2, 3):
            assert t.put(record(i))
        assert t.get(record(1).key) is not None  # 1 is now the most recent
        assert t.put(record(4))
        assert t.contains_many([record(i).key for i in (1, 2, 3, 4)]) == {
            record(i).key for i in (1, 3, 4)}
        assert t.stats.evicted == 1
        t.touch_many([record(3).key, b"\x09" * 16])  # 3 used again; an absent key is ignored
        assert t.put(record(2))
        assert t.contains_many([record(i).key for i in (1, 2, 3, 4)]) == {
            record(i).key for i in (2, 3, 4)}
        t.check_integrity()
        assert not t.put(record(5, n=10_000))  # alone larger than the budget
        assert t.stats.refused == 1
    finally:
        t.close()


def _encoded(r: StateRecord, namespace: str = NS, layout: str = LAYOUT,
             version: int = disk_records.FORMAT_VERSION) -> bytes:
    import io

    buf = io.BytesIO()
    disk_records.write(buf, disk_records.encode(r, namespace, layout, version))
    return buf.getvalue()


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),  # one bit of a tensor
    (lambda b: b[:len(b) // 2], "truncated"),
    ("foreign", "namespace"),
    ("old", "version"),
])
def test_corrupt_record_written_into_redis_is_rejected_whole(redis, damage, reason):
    t = tier(redis)
    try:
        r = record(7)
        assert t.put(r)
        if damage == "foreign":
            blob = _encoded(r, namespace="another-package")
        elif damage == "old":
            blob = _encoded(r, version=disk_records.FORMAT_VERSION + 1)
        else:
            blob = damage(_encoded(r))
        redis.client().set(f"{t.prefix}:r:{r.key.hex()}", blob)
        assert t.get(r.key) is None
        assert getattr(t.stats, f"rejected_{reason}") == 1
        assert not t.contains(r.key)  # deleted whole: never offered again
        t.check_integrity()
    finally:
        t.close()


def test_namespace_and_layout_are_separate_key_spaces(redis):
    a, b, c = tier(redis), tier(redis, namespace="pkg-b"), tier(redis, layout='{"x": 1}')
    try:
        r = record(3)
        assert a.put(r)
        assert b.contains_many([r.key]) == set() and c.get(r.key) is None
    finally:
        for t in (a, b, c):
            t.close()


def test_redis_killed_then_restarted(redis):
    t = tier(redis)
    try:
        r = record(9)
        assert t.put(r)
        redis.stop()
        # every call answers "absent" quickly, never raises
        t0 = time.monotonic()
        assert t.get(r.key) is None and t.contains_many([r.key]) == set()
        assert t.children(r.parent, "page") == [] and not t.put(record(10))
        assert time.monotonic() - t0 < 5
        assert not t.up and t.as_stats()["remote_tier_up"] == 0
        assert t.stats.errors >= 1 and t.stats.outages == 1
        redis.start()  # empty: nothing was persisted
        deadline = time.monotonic() + 10
        while not t.up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.up and t.stats.reconnects == 1
        assert t.put(r) and equal(t.get(r.key), r)
    finally:
        t.close()


def test_tier_that_starts_while_redis_is_down_comes_up_later(tmp_path):
    server = RedisProcess(tmp_path / "r")
    server.stop()
    t = tier(server)
    try:
        assert not t.up and t.get(b"\1" * 16) is None
        server.start()
        deadline = time.monotonic() + 10
        while not t.up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.up
    finally:
        t.close()
        server.stop()


def test_password_is_required_and_used(tmp_path):
    server = RedisProcess(tmp_path / "r", password="s3cret")
    try:
        wrong = RemoteTier(RemoteTierConfig(server.url.replace("s3cret", "nope")), NS, LAYOUT)
        assert not wrong.up
        wrong.close()
        url = f"redis://127.0.0.1:{server.port}/0"
        good = RemoteTier(RemoteTierConfig(url, password="s3cret"), NS, LAYOUT)
        assert good.up and good.put(record(1))
        assert "s3cret" not in RemoteTierConfig(server.url).redacted()
        good.close()
    finally:
        server.stop()


def test_two_replicas_saving_one_session_name_leave_one_whole_session(redis):
    a, b = tier(redis), tier(redis)
    try:
        sa, sb = RemoteSessions(a), RemoteSessions(b)
        chains = {"a": list(range(100)), "b": list(range(500, 700))}
        barrier = threading.Barrier(2)

        def save(s, name):
            barrier.wait()
            for _ in range(50):
                assert s.put("shared", chains[name], len(chains[name]))

        threads = [threading.Thread(target=save, args=(sa, "a")),
                   threading.Thread(target=save, args=(sb, "b"))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        tokens, saved, _ = sb.get("shared")
        assert (tokens, saved) in [(c, len(c)) for c in chains.values()]
        redis.client().hset(f"{a.prefix}:s", "shared", b'{"tokens": [1, 2]}')
        assert sa.get("shared") is None and sa.rejected == 1
    finally:
        a.close()
        b.close()
