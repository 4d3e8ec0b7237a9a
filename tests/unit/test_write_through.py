"""Write-through to the disk tier (issue 18, case state-crash-working-set): with a state
folder, every finished sequence's chain (full pages, tail and, for hybrids, every
checkpoint along it) and every state leaving the device pool reach the disk tier in the
background, so a restart, clean or after a crash, restores the recent working set.

Every answer is compared with an engine without reuse (cold), greedy fp32, on the tiny
random Qwen3 (KV-only) and the tiny Qwen3.5 / LFM2 hybrids. Crashes are simulated here by
closing the tiers without the shutdown path (what the worker had not written is lost);
tests/integration/test_sigkill_write_through.py kills real server processes.
"""

from __future__ import annotations

import time

import pytest

from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest
from flare.state.disk_tier import DiskTier
from test_tiers import (PAGE, assert_restored, cold, greedy, hybrid,  # noqa: F401
                        hybrid_cold, hybrid_engine, make_engine, run, tiny, two_turns,
                        words)


def short_engine(ckpt, num_pages: int, **kw) -> Engine:
    """One sequence of up to 80 tokens at a time, in a pool of `num_pages` pages."""
    plan = make_plan(ckpt.config, max_seq_len=80, max_num_seqs=1, max_batch_tokens=64,
                     page_size=PAGE, num_pages=num_pages)
    return Engine(ckpt.config, plan, ckpt.tensors, ckpt.tokenizer, namespace="pkg-a", **kw)


def settle(engine) -> None:
    """Let write-through finish: what waited while a write ran (the served loop sends it
    when that write completes; `run_until_idle` returns before) is sent and written."""
    tiers = engine.tiers
    while True:
        assert tiers.transfers.wait_idle(60)
        if not tiers.writes_ready:
            return
        tiers.submit_writes()


def crash(engine) -> None:
    """Lose what only memory held (host tier, records not yet handed to the worker), as a
    SIGKILL would, once write-through had time to write (`settle`)."""
    tiers = engine.tiers
    settle(engine)
    tiers.host.drain()
    tiers._outbox.clear()
    tiers.close()
    engine.tiers = engine._reuse.tiers = engine._reuse.index.on_evict = None
    if engine.checkpoints is not None:
        engine.checkpoints.on_evict = None


@pytest.mark.parametrize("save_on_stop", [False, True])
def test_a_clean_restart_restores_with_or_without_the_shutdown_save(tiny, cold, tmp_path,
                                                                   save_on_stop):
    """A clean stop restores after a restart without a flag (write-through wrote the
    chains), and with serve --save-state-on-shutdown (what the device pool held is on
    disk after stop)."""
    engine = make_engine(tiny, state_dir=tmp_path)
    _, turn2 = two_turns(engine, seed=71)
    engine.save_state_on_stop = save_on_stop
    engine.stop()
    assert_restored(make_engine(tiny, state_dir=tmp_path), turn2, cold, 48)


@pytest.mark.parametrize("write_through", [True, False])
def test_states_aged_out_of_the_device_survive_a_crash_only_with_write_through(
        tiny, cold, tmp_path, write_through):
    """Conversation A is pushed out of an 8-page device pool by two others into a large
    host tier; then the process dies. With write-through its whole chain (heads included)
    is on disk and the restart restores all of it; without, it lived in host memory only
    and the restart recomputes it."""
    engine = short_engine(tiny, 8, host_tier_bytes=64 << 20, state_dir=tmp_path,
                          write_through=write_through)
    _, turn2 = two_turns(engine, seed=81)
    two_turns(engine, seed=82)
    two_turns(engine, seed=83)
    assert engine.stats()["prefix_cache_evicted_pages_total"] > 0
    crash(engine)
    restarted = short_engine(tiny, 8, state_dir=tmp_path)
    got, last = run(restarted, turn2)
    assert got == run(cold, turn2)[0]
    assert last.num_cached_tokens == (48 if write_through else 0)
    restarted.check_integrity()
    restarted.stop()


@pytest.mark.parametrize("slow_disk", [False, True])
def test_the_disk_budget_drops_chain_ends_before_the_pages_they_hang_from(
        tiny, cold, tmp_path, monkeypatch, slow_disk):
    """Eight 3-page conversations through a disk tier with room for about 10 pages: the
    budget holds (LRU eviction), every record left on disk hangs from a page that is on
    disk too (eviction took chain ends first, never a head under a surviving end), and
    the newest conversation restores whole after a crash. A slow disk (20 ms a record)
    makes write-through merge several chains into one ticket larger than the budget,
    written heads first and touched only at its end (a CI run found the orphans)."""
    if slow_disk:
        put = DiskTier.put
        monkeypatch.setattr(DiskTier, "put",
                            lambda tier, record: time.sleep(0.02) or put(tier, record))
    page_bytes = PAGE * make_engine(tiny, prefix_cache=False).layout.kv_bytes_per_token
    engine = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path,
                         disk_tier_bytes=10 * page_bytes + 8192)
    turns = [two_turns(engine, seed=90 + i)[1] for i in range(8)]
    settle(engine)
    disk = engine.tiers.disk
    disk.check_integrity()
    assert disk.stats.evicted > 0
    root = engine.prefix_index.root
    records = [disk.get(k) for k in disk.keys()]
    keys = {r.key for r in records}
    assert all(r.parent == root or r.parent in keys for r in records)
    crash(engine)
    restarted = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path)
    got, last = run(restarted, turns[-1])
    assert got == run(cold, turns[-1])[0] and last.num_cached_tokens == 48
    restarted.stop()


def _usable(records: list, page_size: int, root: bytes) -> int:
    """The largest checkpoint position a restore can back with the KV records given: every
    full page below it and, inside a page, the record holding its first positions."""
    pages = {r.key for r in records if r.kind == "page"}
    kv = {(r.parent, r.tokens) for r in records if r.kind != "checkpoint"}
    best = 0
    for c in (r for r in records if r.kind == "checkpoint"):
        ok = c.parent == root or c.parent in pages
        if ok and c.tokens:
            ok = any(parent == c.parent and tokens[:len(c.tokens)] == c.tokens
                     for parent, tokens in kv)
        if ok:
            best = max(best, c.position)
    return best


def test_hybrid_write_through_cut_anywhere_restores_a_verified_prefix(hybrid, hybrid_cold,
                                                                      tmp_path):
    """A hybrid turn's write-through records (pages, tail, the checkpoints at the grid
    point 32, the prompt end - 1 and end 40, 41, the generation end 56), cut after each
    record as a crash part-way through the ticket would: a restart restores exactly the
    newest checkpoint whose KV pages all made it (never KV pages without their layer
    state, never a checkpoint without its pages), growing with the cut, and answers with
    the cold engine's tokens."""
    from test_hybrid_reuse import _assert_equal_to_cold, _recorded

    engine = hybrid_engine(hybrid, state_dir=tmp_path / "live")
    written: list = []
    real = engine.tiers.transfers.write

    def spy(records, waiter=None, touch=(), after=()):
        written.extend(records)
        return real(records, waiter, touch, after)

    engine.tiers.transfers.write = spy
    turn1 = words(41, seed=101)
    outs = engine.run_until_idle([GenerationRequest("t1", turn1, greedy(16))])["t1"]
    answer = sum((o.token_ids for o in outs), [])
    namespace, layout = engine.tiers.disk.namespace, engine.tiers.disk.layout
    root = engine.prefix_index.root
    engine.stop()
    assert sorted(r.position for r in written if r.kind == "checkpoint") == [32, 40, 41, 56]
    assert [r.kind for r in written].count("page") == 3
    turn2 = turn1 + answer[:-1] + words(6, seed=102)
    want = _recorded(hybrid_cold, [GenerationRequest("t2", turn2, greedy(6))])["t2"]
    last_bound = 0
    for cut in range(len(written) + 1):
        folder = tmp_path / f"cut{cut}"
        with DiskTier(folder, namespace, layout, 64 << 20) as disk:
            for rec in written[:cut]:
                assert disk.put(rec)
        bound = _usable(written[:cut], PAGE, root)
        assert bound >= last_bound  # written by position: a later cut never loses reuse
        last_bound = bound
        restarted = hybrid_engine(hybrid, host_tier_bytes=0, state_dir=folder)
        got = _recorded(restarted, [GenerationRequest("t2", turn2, greedy(6))])["t2"]
        assert got[2].num_cached_tokens == bound, f"cut after {cut} records"
        _assert_equal_to_cold(got, want, f"cut after {cut} records")
        restarted.check_integrity()
        restarted.stop()
    assert last_bound == 56


def test_offload_to_disk_writes_pinned_session_chains(tiny, cold, tmp_path):
    """`POST /v1/state/offload {"to": "disk"}`'s engine calls: a session's pinned chain
    stays on the device (the pin), and a copy of it reaches the disk with the session
    marked saved, also with write-through off, so a crash after the offload keeps it."""
    engine = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path, write_through=False)
    turn1 = words(41, seed=111)
    outs = engine.run_until_idle([GenerationRequest("t1", turn1, greedy(), session="s")])
    answer = sum((o.token_ids for o in outs["t1"]), [])
    saves = engine.start_session_saves()
    engine.offload()
    engine.tiers.flush()
    assert engine.finish_session_saves(saves) == 1
    assert engine.stats()["session_pinned_pages"] == 3 == engine.prefix_index.num_pages
    assert len(engine.tiers.disk) == 3
    crash(engine)
    restarted = make_engine(tiny, host_tier_bytes=0, state_dir=tmp_path)
    assert restarted.sessions.get("s").saved_tokens == 48
    turn2 = turn1 + answer + words(9, seed=112)
    got, last = run(restarted, turn2)
    assert got == run(cold, turn2)[0] and last.num_cached_tokens == 48
    restarted.stop()


def _session_crash_restart(build, ckpt, ref, folder) -> tuple[int, int]:
    """A turn naming session "s", a crash, a restart, the next turn: returns (saved_tokens
    after the restart, cached tokens of the next turn); asserts the name resolves to the
    first turn and the next answer equals recompute."""
    engine = build(ckpt, host_tier_bytes=0, state_dir=folder)
    turn1 = words(41, seed=121)
    outs = engine.run_until_idle([GenerationRequest("t1", turn1, greedy(), session="s")])
    answer = [t for o in outs["t1"] for t in o.token_ids]
    crash(engine)
    restarted = build(ckpt, host_tier_bytes=0, state_dir=folder)
    session = restarted.sessions.get("s")
    assert session.tokens == (turn1 + answer)[:48]
    turn2 = turn1 + answer + words(9, seed=122)
    got, last = run(restarted, turn2)
    assert got == run(ref, turn2)[0]
    restarted.check_integrity()
    restarted.stop()
    return session.saved_tokens, last.num_cached_tokens


def test_a_named_session_survives_a_crash_by_name(tiny, cold, tmp_path):
    """Write-through marks a named session saved once its turn's chain is on disk (no
    save call, no shutdown), so after a crash the name comes back with its chain."""
    assert _session_crash_restart(make_engine, tiny, cold, tmp_path) == (48, 48)


def test_a_named_hybrid_session_survives_a_crash_by_name(hybrid, hybrid_cold, tmp_path):
    """As above for a hybrid: the saved positions are those of its newest checkpoint on
    disk (the generation end), and the next turn restores from it."""
    saved, cached = _session_crash_restart(hybrid_engine, hybrid, hybrid_cold, tmp_path)
    assert saved == 48 and cached == 48


def test_a_full_write_behind_queue_drops_the_newest_records(tiny, tmp_path, monkeypatch):
    """While a write ticket runs, write-through records wait, up to `WRITE_BEHIND_BYTES`;
    beyond it the newest are dropped, so two chains queued interleaved (head first, as
    the engine queues them) each keep a restorable prefix, never pages whose head is
    gone; what stays is written on the next ticket."""
    import torch

    from flare.state import tiers as tiers_module
    from flare.state.disk_records import StateRecord
    from flare.state.prefix_index import page_key

    engine = short_engine(tiny, 8, state_dir=tmp_path, write_through=True)
    tiers = engine.tiers
    root = engine.prefix_index.root

    def chain(seed: int, n: int) -> list[StateRecord]:
        records, parent = [], root
        for i in range(n):
            tokens = tuple(range(seed + PAGE * i, seed + PAGE * (i + 1)))
            key = page_key(parent, tokens)
            records.append(StateRecord("page", key, parent, tokens, 0,
                                       {"k": torch.zeros(256), "v": torch.zeros(256)}))
            parent = key
        return records

    a, b = chain(100, 3), chain(900, 2)
    for rec in (a[0], b[0], a[1], b[1], a[2]):  # 2 KiB each
        tiers._outbox[rec.key] = rec
    monkeypatch.setattr(tiers_module, "WRITE_BEHIND_BYTES", 3 * 2048)
    dropped = tiers.stats.dropped_records
    tiers._bound_outbox()
    assert list(tiers._outbox) == [a[0].key, b[0].key, a[1].key]
    assert tiers.stats.dropped_records == dropped + 2
    tiers.submit_writes(force=True)
    assert tiers.transfers.wait_idle(60)
    on_disk = tiers.disk.contains_many([r.key for r in a + b])
    assert on_disk == {a[0].key, a[1].key, b[0].key}
    engine.stop()
