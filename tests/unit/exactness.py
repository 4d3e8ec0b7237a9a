"""The exactness checks of a served model, shared by the dense and hybrid tests.

A token's fp32 logits must be bit-identical (`torch.equal`) whether it is computed in one
prefill, in any chunking, after a reuse of a cached prefix at any position, or beside
other sequences of any length. The checks run the real engine (scheduler, prefix cache,
chunked prefill, continuous batching) and record the logits row each sequence samples
from, per step, by wrapping the engine's own `_sample`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from engine_helpers import greedy, output_tokens, words
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest

MakeEngine = Callable[..., Engine]  # make(max_batch_tokens=..., max_num_seqs=...)


def record_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """From now on, each sampled row of `engine`'s fp32 logits [vocab], per request id in
    step order (a copy, taken before constraints or penalties touch it)."""
    got: dict[str, list[torch.Tensor]] = defaultdict(list)
    sample = engine._sample

    def spy(sampling, logits):
        for row, seq in enumerate(sampling):
            got[seq.request.request_id].append(logits[row].detach().clone().cpu())
        return sample(sampling, logits)

    engine._sample = spy
    return got


def run_recorded(engine: Engine, prompts: dict[str, list[int]], new_tokens: int):
    """Greedy runs of `prompts` (id -> token ids), all submitted at once: per id the
    generated tokens, the logits rows they came from, and the final RequestOutput."""
    got = record_logits(engine)
    outs = engine.run_until_idle([GenerationRequest(rid, ids, greedy(new_tokens))
                                  for rid, ids in prompts.items()])
    engine._sample = type(engine)._sample.__get__(engine)  # unwrap
    return {rid: (output_tokens(outs[rid]), got[rid], outs[rid][-1]) for rid in prompts}


def assert_same_logits(a: list[torch.Tensor], b: list[torch.Tensor], label: str) -> None:
    assert len(a) == len(b), f"{label}: {len(a)} steps against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x, y):
            raise AssertionError(f"{label}: step {i} logits differ, max abs diff "
                                 f"{float((x - y).abs().max()):.3e}")


def check_chunkings(make: MakeEngine, prompt: list[int], new_tokens: int,
                    chunk_sizes=(1, 7, 16, 64)) -> None:
    """The prompt whole (one prefill) and in chunks of each size: the same logits at every
    sampled step, the same tokens."""
    whole = make(max_batch_tokens=max(len(prompt), 64), max_num_seqs=1)
    ref_tokens, ref, _ = run_recorded(whole, {"x": prompt}, new_tokens)["x"]
    for c in chunk_sizes:
        engine = make(max_batch_tokens=c, max_num_seqs=min(c, 4))
        tokens, got, _ = run_recorded(engine, {"x": prompt}, new_tokens)["x"]
        assert_same_logits(got, ref, f"chunk size {c}")
        assert tokens == ref_tokens
        engine.check_integrity()


def check_reuse_positions(make: MakeEngine, prompt: list[int], new_tokens: int,
                          page_size: int) -> None:
    """A cached prefix of `prompt` reused at a page boundary, one token before and after
    it, and at a whole previous turn (prompt + answer): the same logits as cold."""
    cold = make(max_batch_tokens=64, max_num_seqs=4)
    boundary = 2 * page_size
    for cut in (boundary, boundary - 1, boundary + 1):
        engine = make(max_batch_tokens=64, max_num_seqs=4)
        run_recorded(engine, {"first": prompt[:cut]}, 1)
        _, got, last = run_recorded(engine, {"x": prompt}, new_tokens)["x"]
        assert last.num_cached_tokens > 0, f"reuse at {cut}: nothing was reused"
        _, ref, _ = run_recorded(cold, {"x": prompt}, new_tokens)["x"]
        assert_same_logits(got, ref, f"reuse at {cut} ({last.num_cached_tokens} cached)")
        engine.check_integrity()
    # the whole previous turn: its prompt and answer, then a new user turn
    engine = make(max_batch_tokens=64, max_num_seqs=4)
    answer, _, _ = run_recorded(engine, {"turn1": prompt}, new_tokens)["turn1"]
    turn2 = prompt + answer + words(9, seed=77)
    _, got, last = run_recorded(engine, {"turn2": turn2}, new_tokens)["turn2"]
    assert last.num_cached_tokens >= len(prompt) - page_size, last.num_cached_tokens
    _, ref, _ = run_recorded(cold, {"turn2": turn2}, new_tokens)["turn2"]
    assert_same_logits(got, ref, f"whole previous turn ({last.num_cached_tokens} cached)")


def check_batch_neighbours(make: MakeEngine, prompt: list[int], new_tokens: int,
                           neighbours=(3, 7)) -> None:
    """The sequence alone, and beside 3 and 7 others of different lengths (submitted
    together: mixed prefill chunks and decode steps): the same logits at every step."""
    alone = make(max_batch_tokens=64, max_num_seqs=8)
    ref_tokens, ref, _ = run_recorded(alone, {"x": prompt}, new_tokens)["x"]
    for n in neighbours:
        engine = make(max_batch_tokens=64, max_num_seqs=8)
        others = {f"o{i}": words(5 + 13 * i, seed=500 + i) for i in range(n)}
        tokens, got, _ = run_recorded(engine, {**others, "x": prompt}, new_tokens)["x"]
        assert_same_logits(got, ref, f"beside {n} others")
        assert tokens == ref_tokens
        engine.check_integrity()
