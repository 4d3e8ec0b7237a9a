"""Reuse of cached KV pages: reuse equals recompute, branches stay apart, accounting holds.

Each answer served after a reuse is compared with the same request on an engine without a
prefix cache (cold), greedy fp32, on the tiny random Qwen3 (page size 16). Cases from
shared/cases/state.md are named in the test names or docstrings.
"""

from __future__ import annotations

import pytest

from flare.loading.checkpoint import load_checkpoint
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest
from engine_helpers import (assert_one_step_batch_equals_cold, assert_previous_turn_reused,
                            assert_random_traffic_accounts, greedy, run, run_branches, words)

PAGE = 16


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_checkpoint(tiny_qwen3_dir)


def make_engine(ckpt, prefix_cache: bool = True, **plan_kw) -> Engine:
    kw = {"max_seq_len": 512, "max_num_seqs": 8, "max_batch_tokens": 128,
          "page_size": PAGE, **plan_kw}
    return Engine(ckpt.config, make_plan(ckpt.config, **kw), ckpt.tensors, ckpt.tokenizer,
                  namespace="test", prefix_cache=prefix_cache)


@pytest.fixture(scope="module")
def cold(tiny):
    return make_engine(tiny, prefix_cache=False)


def assert_idle_accounting(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.pool.num_used == engine.prefix_index.num_pages
    engine.prefix_index.clear()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("p", [2 * PAGE - 1, 2 * PAGE, 2 * PAGE + 1, 2 * PAGE + 5])
def test_reuse_equals_recompute_around_a_page_boundary(tiny, cold, p):
    """Case state-exact-boundary: common prefix ends one before, at, one after a page
    boundary, and inside the tail."""
    engine = make_engine(tiny)
    base = words(3 * PAGE + 7, seed=1)
    run(engine, base)
    ids = base[:p] + words(9, seed=2)
    got, last = run(engine, ids)
    assert got == run(cold, ids)[0]
    assert last.num_cached_tokens == p
    assert last.reuse == {"outcome": "Admitted", "matched_tokens": p, "reused_tokens": p,
                          "tier": "device"}
    assert_idle_accounting(engine)


def test_whole_previous_turn_is_reused_and_equals_recompute(tiny, cold):
    # the last answer token was sampled but never computed: everything before it is reused
    engine = make_engine(tiny)
    assert_previous_turn_reused(engine, cold)
    assert_idle_accounting(engine)


def test_template_drift_reuses_up_to_the_common_prefix(tiny, cold):
    """Case state-template-drift: turn 2 resends turn 1's answer rendered differently."""
    engine = make_engine(tiny)
    turn1 = words(40, seed=5)
    answer, _ = run(engine, turn1, greedy(20))
    drifted = answer[:7] + [answer[7] + 1] + answer[8:]  # the template changed one token
    turn2 = turn1 + drifted + words(6, seed=6)
    got, last = run(engine, turn2)
    assert last.num_cached_tokens == len(turn1) + 7
    assert got == run(cold, turn2)[0]


def test_same_prompt_twice_reuses_all_but_the_last_token(tiny, cold):
    """Case state-same-prompt-twice, with max_tokens 1 and with a long generation."""
    for first_tokens in (1, 100):
        engine = make_engine(tiny)
        x = words(300, seed=7)
        run(engine, x, greedy(first_tokens))
        got, last = run(engine, x)
        assert last.num_cached_tokens == len(x) - 1
        assert got == run(cold, x)[0]
        assert_idle_accounting(engine)


def test_short_first_turn_is_reused(tiny):
    """Case state-short-first-turn: a prompt under 64 tokens is cached too."""
    engine = make_engine(tiny)
    turn1 = words(21, seed=8)
    answer, _ = run(engine, turn1, greedy(5))
    _, last = run(engine, turn1 + answer + words(4, seed=9))
    assert last.num_cached_tokens >= len(turn1)


def test_branches_stay_isolated(tiny, cold):
    """Case state-branch-isolation: fork, continue both, then the original again."""
    engine = make_engine(tiny)
    br = run_branches(engine, cold)
    assert br.cached_a > len(br.history) and br.cached_b > len(br.history)
    assert_idle_accounting(engine)


def test_requests_in_one_step_never_read_unpublished_pages(tiny, cold):
    """Case state-publish-after-compute: 8 requests share a long prefix, arrive together."""
    engine = make_engine(tiny, max_batch_tokens=512)
    assert_one_step_batch_equals_cold(engine, cold)
    assert_idle_accounting(engine)


def test_concurrent_same_prefix_is_computed_a_bounded_number_of_times(tiny):
    """Case state-concurrent-same-prefix: 8 requests with a 1,500-token prefix at once.

    The prefix is computed once: the first request prefills it, the seven others wait for
    its pages (the scheduler defers a request whose prefix a running prefill is computing)
    and adopt all of it.
    """
    engine = make_engine(tiny, max_seq_len=2048, max_batch_tokens=256, max_num_seqs=8)
    cold = make_engine(tiny, prefix_cache=False, max_seq_len=2048, max_num_seqs=1)
    prefix = words(1500, seed=15)
    prompts = [prefix + words(4, seed=200 + i) for i in range(8)]
    outs = engine.run_until_idle([GenerationRequest(str(i), p, greedy(4))
                                  for i, p in enumerate(prompts)])
    cached = [outs[str(i)][-1].num_cached_tokens for i in range(8)]
    for i, p in enumerate(prompts):
        assert sum((o.token_ids for o in outs[str(i)]), []) == run(cold, p, greedy(4))[0]
    # the whole shared prefix: full pages plus a copy of the page where the suffixes part
    assert sorted(cached) == [0] + [1500] * 7, cached
    assert engine.stats()["prompt_tokens_cached_device_total"] == 7 * 1500
    assert_idle_accounting(engine)


def test_abort_mid_prefill_then_same_prompt_equals_cold(tiny, cold):
    """Case state-abort-mid-prefill, at several abort points."""
    prompt = words(400, seed=16)
    expected = run(cold, prompt)[0]
    for chunks_before_abort in (1, 2, 5):
        engine = make_engine(tiny, max_batch_tokens=64)
        engine.add_request(GenerationRequest("a", prompt, greedy()))
        for _ in range(chunks_before_abort):
            engine.step()
        published = engine.prefix_index.num_pages * PAGE
        engine.abort("a")
        engine.step()
        engine.check_integrity()
        got, last = run(engine, prompt)
        assert got == expected
        assert last.num_cached_tokens <= max(published, chunks_before_abort * 64)
        assert_idle_accounting(engine)


def test_eviction_under_a_small_pool_keeps_answers_correct(tiny, cold):
    engine = make_engine(tiny, max_seq_len=128, num_pages=16, max_num_seqs=2)
    for i in range(12):
        ids = words(40 + i, seed=300 + i)
        got, _ = run(engine, ids)
        assert got == run(cold, ids)[0]
        engine.check_integrity()
    assert engine.prefix_index.stats.evicted_pages > 0
    assert engine.stats()["prefix_cache_evicted_pages_total"] > 0
    assert_idle_accounting(engine)


def test_randomized_traffic_returns_every_pool_to_baseline(tiny):
    """200 requests: random lengths, shared prefixes, 30% aborted mid-way."""
    engine = make_engine(tiny, max_seq_len=256, num_pages=48, max_num_seqs=6,
                         max_batch_tokens=64)
    stats = assert_random_traffic_accounts(engine, n=200, trunks=5, length=120, suffix=30,
                                           max_tokens=20, seed=400, max_prompt=200)
    assert stats["reuse_lookups_total"] >= 150
    assert_idle_accounting(engine)


def test_counters_count_each_prompt_once_under_page_pressure(tiny, cold):
    """Case state-counters-under-pressure (issue 18): 5 concurrent prompts on a 24-page
    pool; re-lookups after waits and preemptions are retries, not more queries or hits."""
    from engine_helpers import assert_counters_once_per_request

    engine = make_engine(tiny, max_seq_len=256, num_pages=24, max_num_seqs=5,
                         max_batch_tokens=64)
    stats = assert_counters_once_per_request(engine, cold, PAGE)
    assert stats["num_preemptions"] > 0 or stats["prefix_cache_retries_total"] > 0
    assert_idle_accounting(engine)
