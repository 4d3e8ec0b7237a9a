"""Stored Responses records shared through a real redis-server: a record one replica's
store keeps is found by another's, deleting it on one forgets it everywhere, a damaged or
foreign record is ignored whole, and Redis down answers "absent", never an exception."""

from __future__ import annotations

import pytest
from redis_process import RedisProcess

from flare.server.response_store import ResponseStore, StoredResponse
from flare.state.remote_responses import RemoteResponses
from flare.state.remote_tier import RemoteTier, RemoteTierConfig

LAYOUT = '{"layers": 2}'


@pytest.fixture
def redis(tmp_path):
    server = RedisProcess(tmp_path / "redis")
    yield server
    server.stop()


def tier(server: RedisProcess, namespace: str = "pkg-a") -> RemoteTier:
    return RemoteTier(RemoteTierConfig(server.url, timeout_s=0.5, ping_interval_s=0.1),
                      namespace, LAYOUT)


def response(n: int) -> StoredResponse:
    rid = f"resp_{n:032x}"
    return StoredResponse(id=rid, body={"id": rid, "object": "response", "created_at": n},
                          instructions="Be terse.",
                          messages=[{"role": "user", "content": "hé"},
                                    {"role": "assistant", "content": "ok"}],
                          text="<s>hé ok", tokens=[1, 2, 3, n])


def test_a_record_kept_on_one_replica_is_found_and_deleted_on_another(redis):
    ta, tb = tier(redis), tier(redis)
    try:
        a = ResponseStore(None, shared=RemoteResponses(ta))
        b = ResponseStore(None, shared=RemoteResponses(tb))
        rec = response(7)
        a.put(rec)
        assert b.get(rec.id) == rec
        assert b.get(response(8).id) is None
        assert b.delete(rec.id)
        assert a.get(rec.id) is None  # a's own copy is dropped: the tombstone says deleted
        assert len(a) == 0 and not b.delete(rec.id)
        a.put(response(10))
        redis.client().flushall()  # expired (or a Redis that restarted empty) ...
        assert a.get(response(10).id) == response(10)  # ... a's own copy still serves
    finally:
        ta.close()
        tb.close()


def test_damaged_or_foreign_records_are_ignored_whole(redis):
    ta, other = tier(redis), tier(redis, namespace="pkg-b")
    try:
        shared = RemoteResponses(ta)
        rec = response(9)
        assert shared.put(rec.id, {"id": rec.id, "tokens": [1]})
        key = f"{ta.prefix}:resp:{rec.id}"
        raw = redis.client().get(key)
        redis.client().set(key, raw.replace(b"[1]", b"[2]"))  # digest no longer matches
        assert shared.get(rec.id) == ("absent", None) and shared.rejected == 1
        redis.client().set(key, b"not json")
        assert shared.get(rec.id) == ("absent", None) and shared.rejected == 2
        assert RemoteResponses(other).put(rec.id, {"id": rec.id})
        assert shared.get(rec.id) == ("absent", None)  # another package's keys: unseen
    finally:
        ta.close()
        other.close()


def test_redis_down_is_absent_not_an_error(redis):
    ta = tier(redis)
    try:
        store = ResponseStore(None, shared=RemoteResponses(ta))
        rec = response(3)
        redis.stop()
        store.put(rec)  # kept locally; publishing failed quietly
        assert store.get(rec.id) == rec
        assert store.get(response(4).id) is None
        assert store.delete(rec.id) and not ta.up and store.get(rec.id) is None
    finally:
        ta.close()
