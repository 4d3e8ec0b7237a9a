"""Helpers of the engine unit tests on tiny checkpoints: a small engine, a request's
generated tokens, greedy runs to the end, random token ids, and the one-step
shared-prefix batch and the forked branches compared with a cold engine (no reuse) of
the prefix-reuse tests
(test_prefix_reuse.py, KV only; test_hybrid_reuse.py, KV plus layer-state checkpoints),
and a prompt's last-position logits through the model's prefill (the parity tests)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from flare.models.attention import AttentionBatch, PrefillChunk
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, RequestOutput, SamplingParams


def small_engine(ckpt) -> Engine:
    """An Engine over `ckpt`: 256-token sequences, 4 of them, 64 tokens a step."""
    plan = make_plan(ckpt.config, max_seq_len=256, max_num_seqs=4, max_batch_tokens=64)
    return Engine(ckpt.config, plan, ckpt.tensors, ckpt.tokenizer)


def position_logits(engine: Engine, ids: list[int], last_only: bool = True) -> torch.Tensor:
    """fp32 logits of one prefill of the whole prompt `ids` through `engine.model`, on
    pages borrowed from its pool (released after, so the pool's accounting is unchanged):
    [vocab] at the last position, or with `last_only=False` [len(ids), vocab] at every
    position (row t predicts token t + 1)."""
    pages = engine.pool.allocate(-(-len(ids) // engine.plan.page_size))
    try:
        slots = engine.kv.slots(pages, 0, len(ids))
        batch = AttentionBatch(slots, None, (PrefillChunk(0, len(ids), slots, None),))
        hidden = engine.model.forward(torch.tensor(ids), torch.arange(len(ids)), batch,
                                      engine.kv)
        return engine.model.logits(hidden[-1:])[0] if last_only else engine.model.logits(hidden)
    finally:
        engine.pool.release(pages)


def last_position_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """fp32 logits [vocab] at the last position of prompt `ids` (see `position_logits`)."""
    return position_logits(engine, ids)


def output_tokens(outs: list[RequestOutput]) -> list[int]:
    """The token ids of a request's outputs, joined."""
    return sum((o.token_ids for o in outs), [])


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def run(engine: Engine, ids: list[int], params: SamplingParams | None = None):
    """The token ids generated for `ids` alone on `engine` and the last RequestOutput."""
    outs = engine.run_until_idle([GenerationRequest("r", ids, params or greedy())])["r"]
    return output_tokens(outs), outs[-1]


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def assert_one_step_batch_equals_cold(engine: Engine, cold: Engine) -> None:
    """8 requests that share a 128-token prefix arrive together on `engine`: each answer
    equals its answer alone on `cold` (case state-publish-after-compute)."""
    prefix = words(128, seed=14)
    prompts = [prefix + words(5, seed=100 + i) for i in range(8)]
    outs = engine.run_until_idle([GenerationRequest(str(i), p, greedy(16))
                                  for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert output_tokens(outs[str(i)]) == run(cold, p, greedy(16))[0]


def assert_previous_turn_reused(engine: Engine, cold: Engine) -> RequestOutput:
    """A 37-token turn and its 20-token answer, then the next turn (11 more tokens): all
    of the previous turn but the last answer token (sampled, never computed) is reused,
    and the answer equals `cold`'s. Returns the next turn's last output."""
    turn1 = words(37, seed=3)
    answer, _ = run(engine, turn1, greedy(20))
    turn2 = turn1 + answer + words(11, seed=4)
    got, last = run(engine, turn2)
    assert last.num_cached_tokens == len(turn1) + len(answer) - 1
    assert got == run(cold, turn2)[0]
    return last


@dataclass
class Branches:
    """What `run_branches` ran: the history, the trunk (history + its answer), branch `a`
    and its answer, and the cached prompt tokens of `a`, of `b` and of `a` continued."""

    history: list[int]
    trunk: list[int]
    a: list[int]
    got_a: list[int]
    cached_a: int
    cached_b: int
    cached_again: int


def run_branches(engine: Engine, cold: Engine) -> Branches:
    """Case state-branch-isolation: a 50-token history and its 10-token answer, two
    branches of it (7 and 9 more tokens, 16 generated each), then branch a continued
    (its answer and 3 more tokens): each answer on `engine` is asserted equal to `cold`'s
    for the same history. Returns what ran, for the caller's reuse assertions."""
    history = words(50, seed=10)
    answer, _ = run(engine, history, greedy(10))
    trunk = history + answer
    a = trunk + words(7, seed=11)
    b = trunk + words(9, seed=12)
    got_a, last_a = run(engine, a, greedy(16))
    got_b, last_b = run(engine, b, greedy(16))
    assert got_a == run(cold, a, greedy(16))[0]
    assert got_b == run(cold, b, greedy(16))[0]
    again = a + got_a + words(3, seed=13)
    got, last = run(engine, again)
    assert got == run(cold, again)[0]
    return Branches(history, trunk, a, got_a, last_a.num_cached_tokens,
                    last_b.num_cached_tokens, last.num_cached_tokens)


def assert_random_traffic_accounts(engine: Engine, *, n: int, trunks: int, length: int,
                                   suffix: int, max_tokens: int, seed: int,
                                   max_prompt: int | None = None,
                                   check_every_step: bool = False) -> dict[str, int]:
    """`n` requests (random.Random(17)): a random prefix (under `length` tokens) of one of
    `trunks` shared trunks plus up to `suffix` fresh tokens, cut to `max_prompt`, asking
    for up to `max_tokens` greedy tokens; 0-2 steps after each arrival and ~30% of them
    aborted mid-way; integrity checked after each arrival (and each draining step with
    `check_every_step`). Asserts that some reuse was admitted and that every lookup ended
    as a hit or no match; returns the engine's stats."""
    rng = random.Random(17)
    shared = [words(rng.randrange(10, length), seed=seed + i) for i in range(trunks)]
    live: list[str] = []
    for i in range(n):
        ids = (rng.choice(shared)[:rng.randrange(1, length)]
               + words(rng.randrange(1, suffix), seed + 100 + i))
        engine.add_request(GenerationRequest(f"q{i}", ids[:max_prompt],
                                             greedy(rng.randrange(1, max_tokens))))
        live.append(f"q{i}")
        for _ in range(rng.randrange(0, 3)):
            engine.step()
        if rng.random() < 0.3:
            engine.abort(rng.choice(live))
        engine.check_integrity()
    while engine.scheduler.has_work() or engine._inbox or engine._aborts:
        engine.step()
        if check_every_step:
            engine.check_integrity()
    stats = engine.stats()
    assert stats["reuse_outcome_admitted_total"] > 0
    assert (stats["reuse_lookups_total"]
            == stats["reuse_outcome_no_match_total"] + stats["reuse_hits_total"])
    return stats


def assert_counters_once_per_request(engine: Engine, cold: Engine, page_size: int,
                                     new_tokens: int = 40) -> dict[str, int]:
    """Five prompts sharing a 100-token prefix, all at once, on an engine whose pool is
    too small for them (queue heads wait for pages, sequences are preempted, lookups
    repeat): each request's prompt counts once in `prefix_cache_queries` (= the prompt
    tokens sent) and in the lookup and outcome counters, repeats count as retries, the
    hit ratio equals reused / prompt tokens within one page per request, the counters are
    conserved, and every answer equals a cold engine's. Returns the engine's stats."""
    shared = words(100, seed=70)
    prompts = {f"p{i}": shared + words(40 + 7 * i, seed=71 + i) for i in range(5)}
    reqs = [GenerationRequest(rid, ids, greedy(new_tokens)) for rid, ids in prompts.items()]
    outs = engine.run_until_idle(reqs)
    stats = engine.stats()
    sent = sum(len(ids) for ids in prompts.values())
    assert stats["prefix_cache_queries_total"] == sent
    assert stats["reuse_lookups_total"] == len(prompts)
    assert stats["prefix_cache_retries_total"] > 0  # the pressure made lookups repeat
    cached = sum(outs[rid][-1].num_cached_tokens for rid in prompts)
    assert stats["reuse_reused_tokens_total"] == cached
    assert abs(stats["prefix_cache_hits_total"] - cached) <= page_size * len(prompts)
    assert stats["reuse_hits_total"] + stats["reuse_outcome_no_match_total"] == len(prompts)
    engine.reuse_counters.check_conservation()
    want = cold.run_until_idle([GenerationRequest(r.request_id, r.prompt_token_ids,
                                                  greedy(new_tokens)) for r in reqs])
    for rid in prompts:
        assert output_tokens(outs[rid]) == output_tokens(want[rid]), rid
    engine.check_integrity()
    return stats
