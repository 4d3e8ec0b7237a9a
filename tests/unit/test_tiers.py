"""Tiered state: endpoint states pushed out of the device pools come back from the host
tier, from the disk tier and after a restart, equal to recompute, all or nothing.

Every answer is compared with the same request on an engine without reuse (cold), greedy
fp32, on the tiny random Qwen3 (KV-only) and the tiny Qwen3.5 / LFM2 hybrids. Cases from
shared/cases/state.md are named where they apply.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from flare.loading.checkpoint import load_checkpoint
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams
from flare.state.admission import CostPolicy
from hybrid_models import tiny_hybrid_fixture

PAGE = 16
KIB = 1024


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(engine: Engine, ids: list[int], rid: str = "r", n: int = 8):
    outs = engine.run_until_idle([GenerationRequest(rid, ids, greedy(n))])[rid]
    return sum((o.token_ids for o in outs), []), outs[-1]


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_checkpoint(tiny_qwen3_dir)


def make_engine(ckpt, namespace: str = "pkg-a", num_pages: int | None = None, **kw) -> Engine:
    plan = make_plan(ckpt.config, max_seq_len=512, max_num_seqs=4, max_batch_tokens=128,
                     page_size=PAGE, num_pages=num_pages)
    return Engine(ckpt.config, plan, ckpt.tensors, ckpt.tokenizer, namespace=namespace, **kw)


@pytest.fixture(scope="module")
def cold(tiny):
    return make_engine(tiny, prefix_cache=False)


def two_turns(engine: Engine, seed: int = 1) -> tuple[list[int], list[int]]:
    """Turn 1 (41 prompt tokens + 8 generated: 48 computed, three full pages), then the
    tokens of turn 2."""
    turn1 = words(41, seed)
    answer, _ = run(engine, turn1, "turn1")
    return turn1, turn1 + answer + words(9, seed + 100)


def assert_restored(engine: Engine, ids: list[int], ref: Engine, cached: int,
                    tier: str = "disk", restores: int = 1) -> None:
    """Run `ids` on `engine`: the answer equals `ref`'s (an engine without reuse), with
    `cached` positions from `restores` restores out of `tier`; then check and stop it."""
    got, last = run(engine, ids)
    assert got == run(ref, ids)[0]
    assert last.num_cached_tokens == cached
    assert engine.stats()[f"tier_restores_{tier}_total"] == restores
    engine.check_integrity()
    engine.stop()


def assert_accounting(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.pool.num_used == engine.prefix_index.num_pages
    engine.prefix_index.clear()
    assert engine.pool.num_used == 0


def test_host_restore_equals_recompute(tiny, cold):
    engine = make_engine(tiny, host_tier_bytes=64 * 1024 * KIB)
    _, turn2 = two_turns(engine)
    assert engine.offload() > 0 and engine.prefix_index.num_pages == 0
    got, last = run(engine, turn2)
    assert got == run(cold, turn2)[0]
    assert last.reuse["outcome"] == "Admitted" and last.reuse["tier"] == "host"
    assert last.num_cached_tokens == 48  # all of turn 1 that was computed (3 pages)
    stats = engine.stats()
    assert stats["tier_restores_host_total"] == 1
    assert stats["reuse_outcome_admitted_total"] == 1
    assert_accounting(engine)


def test_disk_restore_and_restart_restore_equal_recompute(tiny, cold, tmp_path):
    # write-through off: turn 1's records reach disk by the offload alone
    engine = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path, write_through=False)
    _, turn2 = two_turns(engine)
    engine.offload()
    engine.tiers.flush()
    assert engine.stats()["disk_tier_records"] == 3  # the 3 full pages of turn 1
    got, last = run(engine, turn2)
    want = run(cold, turn2)[0]
    assert got == want and last.num_cached_tokens == 48 and last.reuse["tier"] == "disk"
    assert engine.stats()["tier_restores_disk_total"] == 1
    assert_accounting(engine)
    engine.stop()

    # a restart: a new engine of the same package on the same folder; turn 2's own state
    # reached disk too (assert_accounting's clear pushed it through the 0-byte host tier,
    # and stop sends what waits), so all but its last token is restored
    restarted = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path)
    got, last = run(restarted, turn2, "again")
    assert got == want and last.num_cached_tokens == len(turn2) - 1
    assert last.reuse["tier"] == "disk"
    assert restarted.stats()["tier_restores_disk_total"] == 1
    restarted.stop()

    # another package on the same folder is offered nothing
    other = make_engine(tiny, namespace="pkg-b", host_tier_bytes=0, state_dir=tmp_path)
    got, last = run(other, turn2, "other")
    assert got == want and last.num_cached_tokens == 0
    assert last.reuse["outcome"] == "NoMatch" and last.reuse["tier"] is None
    other.stop()


def _record_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.rec"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_record_is_rejected_whole_and_the_answer_recomputed(tiny, cold, tmp_path,
                                                                      damage):
    engine = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path)
    _, turn2 = two_turns(engine, seed=5)
    engine.offload()
    engine.tiers.flush()
    engine.stop()
    files = _record_files(tmp_path)
    assert len(files) == 3
    for f in files:  # damage every record: nothing may be used
        data = bytearray(f.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 3]))
    restarted = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path)
    got, last = run(restarted, turn2)
    assert got == run(cold, turn2)[0]
    assert last.num_cached_tokens == 0
    stats = restarted.stats()
    rejected = sum(v for k, v in stats.items() if k.startswith("disk_tier_rejected"))
    assert rejected >= 1
    assert stats["tier_restores_disk_total"] == 0
    assert_accounting(restarted)
    restarted.stop()


def test_cost_policy_rejects_a_restore_not_worth_it(tiny, cold):
    never = CostPolicy(factor=0.0, bytes_per_s={"device": float("inf"), "host": 1e9,
                                                "disk": 1e9})
    engine = make_engine(tiny, host_tier_bytes=64 * 1024 * KIB, cost_policy=never)
    _, turn2 = two_turns(engine, seed=7)
    engine.offload()
    got, last = run(engine, turn2)
    assert got == run(cold, turn2)[0]
    assert last.reuse["outcome"] == "CostRejected"
    assert last.num_cached_tokens == 0
    engine.check_integrity()


def _gate(engine: Engine) -> threading.Event:
    """Hold the transfer worker's disk reads until the returned event is set."""
    gate = threading.Event()
    disk = engine.tiers.disk
    real = disk.get

    def held_get(key):
        gate.wait(10)
        return real(key)

    disk.get = held_get
    return gate


def drive(engine: Engine, done, max_steps: int = 500) -> None:
    """Step the engine until `done()`; while only transfers are pending, wait for them."""
    for _ in range(max_steps):
        if done():
            return
        if not engine.step():
            engine.tiers.transfers.wait_idle(5)
    raise AssertionError(f"not done after {max_steps} steps")


def _two_from_disk(engine: Engine, a: list[int], b: list[int]):
    """Offload every cached state to disk, hold the transfer worker (`_gate`), submit
    requests "a" and "b" and run one step (their lookups). Returns (the gate, their
    outputs by request id)."""
    engine.offload()
    engine.tiers.flush()
    gate = _gate(engine)
    outs: dict[str, list] = {"a": [], "b": []}
    engine.on_output = lambda o: outs[o.request_id].append(o)
    engine.add_request(GenerationRequest("a", a, greedy()))
    engine.add_request(GenerationRequest("b", b, greedy()))
    engine.step()
    return gate, outs


def test_cancel_during_restore_leaks_nothing_and_the_other_waiter_is_served(tiny, cold,
                                                                           tmp_path):
    engine = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path)
    _, turn2 = two_turns(engine, seed=9)
    gate, outs = _two_from_disk(engine, turn2, turn2)  # both wait on one read ticket
    assert engine.stats()["transfer_reads_shared_total"] == 1
    assert engine.stats()["num_running"] == 0
    engine.abort("a")
    engine.step()
    assert outs["a"][-1].finish_reason == "abort"
    gate.set()
    drive(engine, lambda: bool(outs["b"]) and outs["b"][-1].finished)
    got = sum((o.token_ids for o in outs["b"]), [])
    assert got == run(cold, turn2)[0]
    assert outs["b"][-1].num_cached_tokens == 48
    # b's finish queues a write-through ticket that may still be running; once the
    # queue is idle nothing may be left behind (the aborted waiter's share included).
    assert engine.tiers.transfers.wait_idle(10)
    assert engine.tiers.transfers.num_pending == 0
    assert_accounting(engine)
    engine.stop()


def test_full_transfer_queue_is_enqueue_rejected_and_answers_correctly(tiny, cold, tmp_path):
    # write-through off: its ticket would compete for the one transfer slot this test fills
    engine = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path, max_pending_transfers=1,
                         write_through=False)
    _, first = two_turns(engine, seed=11)
    _, second = two_turns(engine, seed=12)
    # a takes the one ticket; b finds the queue full and computes all
    gate, outs = _two_from_disk(engine, first, second)
    gate.set()
    drive(engine, lambda: all(v and v[-1].finished for v in outs.values()))
    assert outs["b"][-1].reuse["outcome"] == "EnqueueRejected"
    assert sum((o.token_ids for o in outs["b"]), []) == run(cold, second)[0]
    assert sum((o.token_ids for o in outs["a"]), []) == run(cold, first)[0]
    engine.check_integrity()
    engine.stop()


# ---- hybrid recipes: KV pages and layer states come back together or not at all ----------

EVERY = 32


hybrid = tiny_hybrid_fixture("tiers", max_num_seqs=4, checkpoint_interval=EVERY)


def hybrid_engine(tiny, **kw) -> Engine:
    pkg = tiny.package
    return Engine(pkg.config, pkg.plan, pkg.tensors, pkg.tokenizer,
                  namespace=pkg.manifest.package_id, **kw)


@pytest.fixture(scope="module")
def hybrid_cold(hybrid):
    return hybrid_engine(hybrid, prefix_cache=False)


@pytest.mark.parametrize("where", ["host", "disk"])
def test_hybrid_restore_equals_recompute(hybrid, hybrid_cold, tmp_path, where):
    kw = ({"host_tier_bytes": 64 * 1024 * KIB} if where == "host"
          else {"host_tier_bytes": 0, "state_dir": tmp_path})
    engine = hybrid_engine(hybrid, **kw)
    _, turn2 = two_turns(engine, seed=21)
    engine.offload()
    assert len(engine.checkpoints) == 0
    if where == "disk":
        engine.tiers.flush()
    # the end-of-generation checkpoint of turn 1 sits at 48 (49 tokens, last not computed)
    assert_restored(engine, turn2, hybrid_cold, 48, where)


def test_hybrid_layer_state_lost_in_transfer_means_clean_recompute(hybrid, hybrid_cold,
                                                                   tmp_path):
    """Case state-restore-all-or-nothing: the recurrent/conv part fails to come back; the
    KV pages alone are never used."""
    engine = hybrid_engine(hybrid, host_tier_bytes=0, state_dir=tmp_path)
    _, turn2 = two_turns(engine, seed=23)
    engine.offload()
    engine.tiers.flush()
    disk = engine.tiers.disk
    real = disk.get
    disk.get = lambda key: None if key in set(disk.keys("checkpoint")) else real(key)
    assert_restored(engine, turn2, hybrid_cold, 0, restores=0)


@pytest.mark.parametrize("how", ["save", "shutdown"])
def test_hybrid_session_chain_survives_a_restart_with_a_retokenized_reply(
        hybrid, hybrid_cold, tmp_path, how):
    """A saved (or shutdown-saved) hybrid session writes every checkpoint on its chain,
    not only the one at its end. After a restart, turn 2 resends turn 1 with a reply that
    re-tokenizes differently from its 3rd token on (one token becomes two): the restarted
    engine restores the prompt-end checkpoint (41, inside a page whose record belongs to
    the other continuation: its first positions are lent, as the device index lends a
    partly matching page), exactly what an engine that never restarted reuses; tokens and
    sampled logits equal a cold engine's."""
    from test_hybrid_reuse import _assert_equal_to_cold, _recorded

    turn1 = words(41, seed=31)

    def first_turn(engine: Engine) -> list[int]:
        req = GenerationRequest("t1", turn1, greedy(16), session="s")
        return sum((o.token_ids for o in engine.run_until_idle([req])["t1"]), [])

    engine = hybrid_engine(hybrid, state_dir=tmp_path)
    answer = first_turn(engine)
    if how == "save":
        ticket, covered = engine.save_session("s")
        assert ticket.done.wait(30) and ticket.written == len(ticket.keys)
        assert engine.sessions.mark_saved("s", turn1 + answer[:-1], covered)
        kinds = [engine.tiers.disk.get(k) for k in ticket.keys]
        positions = sorted(r.position for r in kinds if r.kind == "checkpoint")
        assert positions == [32, 40, 41, 56]  # grid, prompt end - 1, prompt end, generation end
    else:
        engine.save_state_on_stop = True
        covered = 56
    engine.stop()

    reply = answer[:2] + [answer[2] + 1, 777] + answer[3:]
    turn2 = turn1 + reply + words(5, seed=32)
    never = hybrid_engine(hybrid)
    assert first_turn(never) == answer
    want_cached = _recorded(never, [GenerationRequest("t2", turn2, greedy(6))])["t2"][2]
    assert want_cached.num_cached_tokens == len(turn1)

    restarted = hybrid_engine(hybrid, state_dir=tmp_path)
    assert restarted.sessions.get("s").saved_tokens == covered
    got = _recorded(restarted, [GenerationRequest("t2", turn2, greedy(6))])["t2"]
    assert got[2].num_cached_tokens == want_cached.num_cached_tokens
    assert restarted.stats()["tier_restores_disk_total"] == 1
    _assert_equal_to_cold(got, _recorded(hybrid_cold, [GenerationRequest(
        "t2", turn2, greedy(6))])["t2"], "restarted")
    restarted.check_integrity()
    restarted.stop()


def test_a_damaged_index_is_rebuilt_at_restart_and_the_restore_equals_recompute(
        tiny, cold, tmp_path):
    """Issue 23: a damaged SQLite index used to stop the server from starting ("database
    disk image is malformed"). Now the restart moves it aside, rebuilds it from the
    verified records, and the next restore equals recompute."""
    # write-through off: the records reach disk by the offload alone (3 full pages)
    engine = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path, write_through=False)
    _, turn2 = two_turns(engine, seed=61)
    engine.offload()
    engine.tiers.flush()
    engine.stop()
    index = tmp_path / "index.sqlite"
    data = bytearray(index.read_bytes())
    data[100:] = bytes((b * 31 + 7) & 0xFF for b in data[100:])  # every b-tree page
    index.write_bytes(bytes(data))
    for extra in ("index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / extra).unlink(missing_ok=True)

    restarted = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path)
    stats = restarted.stats()
    assert stats["disk_tier_index_rebuilds_total"] == 1 and stats["disk_tier_records"] == 3
    got, last = run(restarted, turn2, "after-rebuild")
    assert got == run(cold, turn2)[0]
    assert last.num_cached_tokens == 48 and last.reuse["outcome"] == "Admitted"
    assert restarted.stats()["tier_restores_disk_total"] == 1
    assert_accounting(restarted)
    restarted.stop()
    assert any(p.name.endswith(".damaged") for p in (tmp_path / "rejected").iterdir())
