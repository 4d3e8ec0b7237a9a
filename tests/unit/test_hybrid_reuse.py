"""Full-state reuse for hybrid recipes: an endpoint is the KV pages of [0, P) plus a
checkpoint of every conv/recurrent layer state at P. Checkpoints are taken at the end of
each prompt, at the end of each generation and every `checkpoint_interval` tokens of a
prefill; a request reuses the largest checkpoint within its cached common prefix (at most
len - 1), never KV pages alone.

Every answer served after a reuse is compared with the same request on an engine without
reuse (cold), greedy fp32, for the tiny random Qwen3.5 and LFM2 (page size 16, checkpoint
interval 32). Cases from shared/cases/state.md are named in docstrings.
"""

from __future__ import annotations

import pytest

from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest
from flare.state.slots import StateSlotPool
from engine_helpers import (assert_one_step_batch_equals_cold, assert_previous_turn_reused,
                            assert_random_traffic_accounts, greedy, run, run_branches, words)
from hybrid_models import PAGE, tiny_hybrid_fixture

EVERY = 32  # checkpoint interval of these tests (two pages)


tiny = tiny_hybrid_fixture("hybrid-reuse", max_num_seqs=8, checkpoint_interval=EVERY)


def make_engine(tiny, prefix_cache: bool = True, **plan_changes) -> Engine:
    import dataclasses

    pkg = tiny.package
    if "max_num_seqs" in plan_changes:
        plan_changes.setdefault("state_slots", plan_changes["max_num_seqs"])
    plan = dataclasses.replace(pkg.plan, **plan_changes)
    return Engine(pkg.config, plan, pkg.tensors, pkg.tokenizer,
                  namespace=pkg.manifest.package_id, prefix_cache=prefix_cache)


@pytest.fixture(scope="module")
def cold(tiny):
    return make_engine(tiny, prefix_cache=False)


def assert_idle_accounting(engine: Engine) -> None:
    engine.check_integrity()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pool.num_used == engine.prefix_index.num_pages
    assert engine.states.num_used == len(engine.checkpoints)
    engine.checkpoints.clear()
    engine.prefix_index.clear()
    engine.check_integrity()
    assert engine.pool.num_used == 0 and engine.states.num_used == 0


def test_whole_previous_turn_is_reused_and_equals_recompute(tiny, cold):
    """The end-of-generation checkpoint covers the whole previous turn (all but the last
    answer token, which was sampled and never computed)."""
    engine = make_engine(tiny)
    last = assert_previous_turn_reused(engine, cold)
    assert last.reuse == {"outcome": "Admitted", "matched_tokens": last.num_cached_tokens,
                          "reused_tokens": last.num_cached_tokens, "tier": "device"}
    assert_idle_accounting(engine)


def test_template_drift_falls_back_to_the_nearest_earlier_checkpoint(tiny, cold):
    """Case state-template-drift: the answer is resent with one token changed; the KV pages
    match further, but the state is only known at checkpoints: the end of turn 1's prompt."""
    engine = make_engine(tiny)
    turn1 = words(40, seed=5)
    answer, _ = run(engine, turn1, greedy(20))
    drifted = answer[:7] + [answer[7] + 1] + answer[8:]
    turn2 = turn1 + drifted + words(6, seed=6)
    got, last = run(engine, turn2)
    assert last.num_cached_tokens == len(turn1)  # not len(turn1) + 7: no state there
    assert got == run(cold, turn2)[0]
    assert_idle_accounting(engine)


@pytest.mark.parametrize("common", [EVERY - 1, EVERY, EVERY + 1, 3 * EVERY + 5])
def test_reuse_around_grid_checkpoints_equals_recompute(tiny, cold, common):
    """Case state-exact-boundary, for hybrids: a long prefill leaves checkpoints every 32
    tokens (a page boundary); a request diverging at, just before, just after or inside
    the tail past a grid point reuses the largest grid point at or below the divergence."""
    engine = make_engine(tiny)
    base = words(150, seed=1)
    run(engine, base, greedy(2))
    ids = base[:common] + words(9, seed=2)
    got, last = run(engine, ids)
    assert last.num_cached_tokens == (common // EVERY) * EVERY
    assert got == run(cold, ids)[0]
    assert_idle_accounting(engine)


def test_same_prompt_twice_reuses_all_but_its_last_token(tiny, cold):
    """Case state-same-prompt-twice, with max_tokens 1 and with a long generation (the
    stored state runs past X): the checkpoint one token before the prompt's end is the
    endpoint, so cached = len - 1 (not the grid point 288 below it)."""
    for first_tokens in (1, 100):
        engine = make_engine(tiny)
        x = words(300, seed=7)
        run(engine, x, greedy(first_tokens))
        got, last = run(engine, x)
        assert last.num_cached_tokens == len(x) - 1 == 299
        assert got == run(cold, x)[0]
        assert_idle_accounting(engine)


def test_short_first_turn_is_reused(tiny, cold):
    """Case state-short-first-turn: a prompt under 64 tokens (below the grid) still gets its
    end-of-prompt and end-of-generation checkpoints."""
    engine = make_engine(tiny)
    turn1 = words(21, seed=8)
    answer, _ = run(engine, turn1, greedy(5))
    turn2 = turn1 + answer + words(4, seed=9)
    got, last = run(engine, turn2)
    assert last.num_cached_tokens >= len(turn1)
    assert got == run(cold, turn2)[0]


def test_branches_stay_isolated(tiny, cold):
    """Case state-branch-isolation: fork a history, continue both branches, then the
    original branch again; each equals a cold run of its own history."""
    engine = make_engine(tiny)
    br = run_branches(engine, cold)
    assert br.cached_a == br.cached_b == len(br.trunk) - 1
    assert br.cached_again == len(br.a) + len(br.got_a) - 1
    assert_idle_accounting(engine)


def test_failed_state_restore_recomputes_from_scratch(tiny, cold, monkeypatch):
    """Case state-restore-all-or-nothing, at the device level: the copy of the layer states
    fails during a reuse. The request recomputes from position 0 with the right answer;
    nothing half adopted remains (no pages, the slot zeroed), accounting is back to
    baseline, and the counters show an admitted lookup that reused nothing."""
    engine = make_engine(tiny)
    turn1 = words(45, seed=20)
    answer, _ = run(engine, turn1, greedy(10))
    turn2 = turn1 + answer + words(5, seed=21)
    before = engine.stats()

    def broken_copy(self, src, dst):  # copies part of the state, then fails
        first = next(iter(self.conv))
        self.conv[first][dst].copy_(self.conv[first][src])
        raise RuntimeError("injected: state transfer failed")

    monkeypatch.setattr(StateSlotPool, "copy", broken_copy)
    got, last = run(engine, turn2)
    monkeypatch.undo()
    assert got == run(cold, turn2)[0]
    assert last.num_cached_tokens == 0
    assert last.reuse["outcome"] == "Admitted" and last.reuse["reused_tokens"] == 0
    after = engine.stats()
    assert after["reuse_restore_failures_total"] == before["reuse_restore_failures_total"] + 1
    assert after["reuse_reused_tokens_total"] == before["reuse_reused_tokens_total"]
    assert (after["reuse_admitted_tokens_total"]
            == before["reuse_admitted_tokens_total"] + len(turn1) + len(answer) - 1)
    assert_idle_accounting(engine)


def test_restored_state_equals_the_state_computed_from_scratch(tiny):
    """Case state-restore-all-or-nothing, the Admitted half: right after admission the
    sequence's slot holds, in every conv/recurrent layer, the state a cold prefill of the
    same tokens reaches (here the checkpoint was taken by the decode path, the reference by
    one prefill), and its page table holds the K/V of those positions."""
    engine = make_engine(tiny)
    turn1 = words(40, seed=26)
    answer, _ = run(engine, turn1, greedy(8))
    turn2 = turn1 + answer + words(3, seed=27)
    p = len(turn1) + len(answer) - 1
    engine.add_request(GenerationRequest("t2", turn2, greedy(4)))
    engine._drain_inbox()
    engine.scheduler.schedule()  # admission: adopt pages, restore the slot (not run yet)
    seq = engine._seqs["t2"]
    assert seq.num_computed == p and seq.state_slot >= 0
    restored = engine.states.read(seq.state_slot)
    kv_slots = engine.kv.slots(seq.pages, 0, p)
    restored_k = engine.kv.k[:, kv_slots].clone()
    while engine.scheduler.has_work():
        engine.step()

    ref = make_engine(tiny)
    run(ref, turn2[:p], greedy(1))  # its end-of-prompt checkpoint is the state at p
    (ckpt,) = [c for c in ref.checkpoints.entries() if c.position == p]
    expected = ref.states.read(ckpt.slot)
    assert set(restored) == set(expected)
    for name, t in expected.items():
        assert float(t.abs().max()) > 0, name
        assert (restored[name] - t).abs().max() < 1e-4, name
    row = ref.prefix_index.match(turn2[:p], p)  # K/V of positions [0, p) in the reference
    assert row.num_tokens == p
    ref_slots = ref.kv.slots(list(row.pages) + ([row.partial] if row.partial is not None
                                                 else []), 0, p)
    assert (restored_k - ref.kv.k[:, ref_slots]).abs().max() < 1e-4
    assert_idle_accounting(engine)
    assert_idle_accounting(ref)


def test_a_checkpoint_whose_pages_are_gone_is_not_used(tiny, cold):
    """An endpoint needs its KV pages and its layer states: with the pages evicted, the
    checkpoint is not offered (NoMatch), and the answer is still right."""
    engine = make_engine(tiny)
    turn1 = words(40, seed=22)
    answer, _ = run(engine, turn1, greedy(8))
    assert len(engine.checkpoints) > 0
    engine.prefix_index.clear()
    turn2 = turn1 + answer + words(3, seed=23)
    got, last = run(engine, turn2)
    assert last.num_cached_tokens == 0 and last.reuse["outcome"] == "NoMatch"
    assert got == run(cold, turn2)[0]
    assert_idle_accounting(engine)


def test_kv_pages_alone_are_never_reused(tiny, cold):
    """With no checkpoint slots there is no endpoint: even a fully cached KV prefix is a
    NoMatch for a hybrid recipe."""
    engine = make_engine(tiny, checkpoint_slots=0)
    x = words(70, seed=24)
    run(engine, x, greedy(4))
    assert engine.prefix_index.num_pages > 0 and len(engine.checkpoints) == 0
    got, last = run(engine, x + words(3, seed=25))
    assert last.num_cached_tokens == 0 and last.reuse["outcome"] == "NoMatch"
    assert got == run(cold, x + words(3, seed=25))[0]
    assert_idle_accounting(engine)


def test_requests_in_one_step_never_read_unpublished_state(tiny, cold):
    """Case state-publish-after-compute: 8 requests share a 128-token prefix and arrive
    together; each answer equals its answer alone."""
    engine = make_engine(tiny, max_batch_tokens=512)
    assert_one_step_batch_equals_cold(engine, cold)
    assert_idle_accounting(engine)


def test_abort_mid_prefill_then_same_prompt_equals_cold(tiny, cold):
    """Case state-abort-mid-prefill: cached tokens are at most what was published (grid
    checkpoints of the chunks computed before the abort)."""
    prompt = words(200, seed=16)
    expected = run(cold, prompt)[0]
    for chunks_before_abort in (1, 3):
        engine = make_engine(tiny, max_batch_tokens=EVERY)
        engine.add_request(GenerationRequest("a", prompt, greedy()))
        for _ in range(chunks_before_abort):
            engine.step()
        published = max([c.position for c in engine.checkpoints.entries()], default=0)
        engine.abort("a")
        engine.step()
        engine.check_integrity()
        got, last = run(engine, prompt)
        assert got == expected
        assert 0 < last.num_cached_tokens <= chunks_before_abort * EVERY
        assert published <= last.num_cached_tokens
        assert_idle_accounting(engine)


def test_checkpoint_eviction_under_few_slots_keeps_answers_correct(tiny, cold):
    engine = make_engine(tiny, checkpoint_slots=2)
    for i in range(6):
        turn1 = words(30 + 7 * i, seed=300 + i)
        answer, _ = run(engine, turn1, greedy(4))
        got, last = run(engine, turn1 + answer + words(2, seed=400 + i))
        assert got == run(cold, turn1 + answer + words(2, seed=400 + i))[0]
        assert last.num_cached_tokens >= len(turn1)
        engine.check_integrity()
        assert len(engine.checkpoints) <= 2
    assert engine.stats()["checkpoints_evicted_total"] > 0
    assert_idle_accounting(engine)


def test_randomized_traffic_returns_every_pool_to_baseline(tiny):
    """60 requests: random lengths, shared prefixes, ~30% aborted mid-way, small pools."""
    engine = make_engine(tiny, max_seq_len=256, num_pages=40, max_num_seqs=4,
                         max_batch_tokens=48, checkpoint_slots=5)
    assert_random_traffic_accounts(engine, n=60, trunks=4, length=100, suffix=20,
                                   max_tokens=12, seed=500, check_every_step=True)
    assert_idle_accounting(engine)


def test_chunks_are_cut_on_the_checkpoint_grid(tiny):
    """A 100-token prefill with a 48-token budget is cut at 32, 64, 96 and 99: each grid
    point gets a checkpoint, and so do the end of the prompt and the token before it."""
    engine = make_engine(tiny, max_batch_tokens=48)
    run(engine, words(100, seed=30), greedy(1))
    positions = sorted(c.position for c in engine.checkpoints.entries())
    assert positions == [32, 64, 96, 99, 100]
    assert_idle_accounting(engine)


def _recorded(engine: Engine, requests: list[GenerationRequest]):
    """Run `requests` at once; per id: (tokens, the logits rows sampled, last output)."""
    from engine_helpers import output_tokens
    from exactness import record_logits

    got = record_logits(engine)
    outs = engine.run_until_idle(requests)
    engine._sample = type(engine)._sample.__get__(engine)  # unwrap the spy
    return {r.request_id: (output_tokens(outs[r.request_id]), got[r.request_id],
                           outs[r.request_id][-1]) for r in requests}


def _assert_equal_to_cold(got, want, label: str) -> None:
    """Same tokens and bit-identical sampled logits (torch.equal) at every step."""
    from exactness import assert_same_logits

    assert got[0] == want[0], label
    assert_same_logits(got[1], want[1], label)


@pytest.mark.parametrize("length", [17, 40, 100])
def test_same_prompt_twice_below_the_grid_reuses_len_minus_one_bit_exact(tiny, cold, length):
    """Cases state-same-prompt-twice and state-hybrid-same-prompt-twice, below the
    checkpoint grid (interval 256 here, as packages default to): the prompt-end checkpoint
    at P cannot serve a full match (one token must be computed for logits), the one at
    P - 1 does. The repeat, and n = 3
    choices of it (sampled, seeds 3, 4, 5), reuse len - 1 and sample from logits
    bit-identical to a cold engine's; pools and slots return to baseline."""
    from flare.runtime.request import SamplingParams

    engine = make_engine(tiny, checkpoint_interval=256)
    x = words(length, seed=40 + length)
    first = _recorded(engine, [GenerationRequest("first", x, greedy(6))])["first"]
    assert first[2].num_cached_tokens == 0
    again = _recorded(engine, [GenerationRequest("again", x, greedy(6))])["again"]
    assert again[2].num_cached_tokens == length - 1
    assert again[2].reuse == {"outcome": "Admitted", "matched_tokens": length - 1,
                              "reused_tokens": length - 1, "tier": "device"}
    want = _recorded(cold, [GenerationRequest("cold", x, greedy(6))])["cold"]
    _assert_equal_to_cold(first, want, "first")
    _assert_equal_to_cold(again, want, "again")

    def choices(tag: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}-{i}", x, SamplingParams(
            max_tokens=6, temperature=0.8, seed=3 + i, ignore_eos=True)) for i in range(3)]

    n3 = _recorded(engine, choices("n3"))
    ref = _recorded(cold, choices("n3"))
    for rid, got in n3.items():
        assert got[2].num_cached_tokens == length - 1, rid
        _assert_equal_to_cold(got, ref[rid], rid)
    assert_idle_accounting(engine)


def test_turn_boundary_checkpoints_let_short_branches_reuse(tiny, cold):
    """Below the grid, the checkpoints at each prompt end (and the token before it) and
    each generation end are the branch points: a branch diverging right after the prompt
    reuses P, one diverging at the prompt's last token reuses P - 1, a branch after the
    answer and a resend of the whole turn reuse all of the turn but its last token.
    Every answer samples from logits bit-identical to a cold engine's."""
    engine = make_engine(tiny, checkpoint_interval=256)
    prompt = words(29, seed=50)
    answer = _recorded(engine, [GenerationRequest("t1", prompt, greedy(7))])["t1"][0]
    turn = prompt + answer
    cases = {
        "after-prompt": (prompt + words(5, seed=51), len(prompt)),
        "last-prompt-token": (prompt[:-1] + words(6, seed=52), len(prompt) - 1),
        "after-answer": (turn + words(4, seed=53), len(turn) - 1),
        "whole-turn": (turn, len(turn) - 1),
        # the resend of the whole turn checkpointed it at its prompt end too
        "after-answer-again": (turn + words(3, seed=54), len(turn)),
    }
    for label, (ids, cached) in cases.items():
        got = _recorded(engine, [GenerationRequest(label, ids, greedy(5))])[label]
        assert got[2].num_cached_tokens == cached, label
        want = _recorded(cold, [GenerationRequest(label, ids, greedy(5))])[label]
        _assert_equal_to_cold(got, want, label)
        engine.check_integrity()
    assert_idle_accounting(engine)


def test_counters_count_each_prompt_once_under_page_pressure(tiny, cold):
    """Case state-counters-under-pressure (issue 18), hybrids: 5 concurrent prompts on a
    24-page pool; re-lookups after waits and preemptions are retries, not more queries
    or hits."""
    from engine_helpers import assert_counters_once_per_request

    engine = make_engine(tiny, max_seq_len=256, num_pages=24, max_num_seqs=5,
                         max_batch_tokens=64)
    assert_counters_once_per_request(engine, cold, PAGE)
    assert_idle_accounting(engine)


def test_prompt_end_checkpoints_survive_full_checkpoint_slots(tiny, cold):
    """With every checkpoint slot taken by older, usable checkpoints, the ones a running
    sequence takes at its prompt's end and the token before it (their partly filled page
    is published only when it finishes) are not the first retired: the same prompt sent
    again still reuses len - 1."""
    engine = make_engine(tiny, checkpoint_interval=256, checkpoint_slots=3)
    run(engine, words(30, seed=60), greedy(4))  # fills the 3 slots: 29, 30, 33
    assert len(engine.checkpoints) == 3
    x = words(50, seed=61)
    run(engine, x, greedy(4))
    got, last = run(engine, x, greedy(6))
    assert last.num_cached_tokens == len(x) - 1
    assert got == run(cold, x, greedy(6))[0]
    assert_idle_accounting(engine)
