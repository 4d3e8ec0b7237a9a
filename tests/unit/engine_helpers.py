"""Helpers of the engine unit tests on tiny checkpoints: a small engine, a request's
generated tokens, greedy runs to the end, random token ids, and the one-step
shared-prefix batch compared with a cold engine (no reuse) of the prefix-reuse tests
(test_prefix_reuse.py, KV only; test_hybrid_reuse.py, KV plus layer-state checkpoints),
and a prompt's last-position logits through the model's prefill (the parity tests)."""

from __future__ import annotations

import random

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
