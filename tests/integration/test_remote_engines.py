"""Two engines of one package ("replicas" in one process, fast) sharing conversation
states through a real redis-server: a conversation started on A continues on B restored
from Redis, equal to an engine without reuse; on the tiny random Qwen3 (KV only) and the
tiny Qwen3.5 / LFM2 hybrids. Redis down: answers equal recompute, the engine reports
the tier down, and it comes back. (HTTP replicas and the gateway: test_cluster.py.)"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest
from redis_process import RedisProcess

from flare.loading.checkpoint import load_checkpoint
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams
from flare.state.remote_link import RemoteTierConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from hybrid_models import RECIPES, build_tiny_hybrid  # noqa: E402

PAGE = 16


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(engine: Engine, ids: list[int], rid: str = "r", n: int = 8):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = engine.run_until_idle([GenerationRequest(rid, ids, params)])[rid]
    return sum((o.token_ids for o in outs), []), outs[-1]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_checkpoint(tiny_qwen3_dir)


def dense(ckpt, **kw) -> Engine:
    plan = make_plan(ckpt.config, max_seq_len=512, max_num_seqs=4, max_batch_tokens=128,
                     page_size=PAGE)
    return Engine(ckpt.config, plan, ckpt.tensors, ckpt.tokenizer, namespace="pkg-a", **kw)


def remote(redis: RedisProcess) -> RemoteTierConfig:
    return RemoteTierConfig(redis.url, budget_bytes=256 << 20, timeout_s=0.5,
                            ping_interval_s=0.1)


def settle(engine: Engine) -> None:
    """Wait for the write-through of finished requests to reach Redis."""
    assert engine.tiers.transfers.wait_idle(30)


def move_to_replica_b(build, ckpt, redis: RedisProcess, seed: int):
    """Turn 1 (naming session "conv") on replica A, written through to Redis; turn 2 on
    replica B, whose answer must equal an engine without reuse. Returns (A, B, the last
    output of turn 2); the caller stops A and B."""
    a, b = build(ckpt, remote_tier=remote(redis)), build(ckpt, remote_tier=remote(redis))
    cold = build(ckpt, prefix_cache=False)
    try:
        turn1 = words(41, seed)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs = a.run_until_idle([GenerationRequest("t1", turn1, params, session="conv")])
        answer = [t for o in outs["t1"] for t in o.token_ids]
        settle(a)
        turn2 = turn1 + answer + words(9, seed + 100)
        got, last = run(b, turn2, "t2")
        assert got == run(cold, turn2)[0]
    finally:
        cold.stop()
    return a, b, last


def assert_shared_once(a: Engine, b: Engine) -> None:
    """A's finish published the session name with its chain; B's finish sent only the
    records Redis lacked (none of A's was sent again, so none was only touched)."""
    assert a.stats()["remote_tier_shares_total"] == 1
    assert b.sessions.get("conv").saved_tokens == 48
    settle(b)
    stats = b.stats()
    assert stats["remote_tier_written_total"] > 0 and stats["remote_tier_touched_total"] == 0


def test_conversation_moves_to_another_replica_and_restores_from_redis(tiny, redis):
    a, b, last = move_to_replica_b(dense, tiny, redis, 1)
    try:
        assert last.num_cached_tokens == 48 and last.reuse["outcome"] == "Admitted"
        stats = b.stats()
        assert stats["tier_restores_disk_total"] == 1  # the tier below the host: Redis
        assert stats["remote_tier_read_hits_total"] >= 3 and stats["remote_tier_up"] == 1
        assert_shared_once(a, b)
        assert b.stats()["remote_tier_written_total"] == 2  # page 4 and the tail
        b.check_integrity()
        a.tiers.disk.check_integrity()
    finally:
        a.stop()
        b.stop()


def test_redis_down_means_recompute_and_the_tier_comes_back(tiny, redis):
    a = dense(tiny, remote_tier=remote(redis))
    cold = dense(tiny, prefix_cache=False)
    try:
        redis.stop()
        ids = words(50, 7)
        got, last = run(a, ids, "down")
        assert got == run(cold, ids)[0] and not a.remote_tier.up
        assert a.stats()["remote_tier_errors_total"] >= 1
        redis.start()
        deadline = time.monotonic() + 10
        while not a.remote_tier.up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.remote_tier.up and a.stats()["remote_tier_reconnects_total"] == 1
        ids2 = words(50, 8)
        run(a, ids2, "up")
        settle(a)
        b = dense(tiny, remote_tier=remote(redis))
        try:
            got, last = run(b, ids2 + words(5, 9), "moved")
            assert last.num_cached_tokens >= 48
        finally:
            b.stop()
    finally:
        a.stop()
        cold.stop()


@pytest.fixture(scope="module", params=RECIPES)
def hybrid(request, tmp_path_factory, embedded_checkpoint):
    root = tmp_path_factory.mktemp(f"remote-{request.param}")
    return build_tiny_hybrid(request.param, root, embedded_checkpoint.tokenizer,
                             max_seq_len=512, max_num_seqs=4, max_batch_tokens=128,
                             checkpoint_interval=32)


def hybrid_engine(tiny, **kw) -> Engine:
    pkg = tiny.package
    return Engine(pkg.config, pkg.plan, pkg.tensors, pkg.tokenizer,
                  namespace=pkg.manifest.package_id, **kw)


def test_hybrid_conversation_moves_to_another_replica(hybrid, redis):
    a, b, last = move_to_replica_b(hybrid_engine, hybrid, redis, 21)
    try:
        # the end-of-generation checkpoint of turn 1 sits at 48 (49 tokens, last not computed)
        assert last.num_cached_tokens == 48
        assert_shared_once(a, b)
        b.check_integrity()
    finally:
        a.stop()
        b.stop()
