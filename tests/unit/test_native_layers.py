"""All decoder layers in one native call (`flare.models.native_layers`, kernels/layers.cpp):
the engine's fp32 logits are bit-identical (`torch.equal`) to the Python fused path's
(`LlamaModel._forward_fused`'s per-op loop), step by step, for prefill chunks of 1, 7 and
64 tokens, decode at batch 1 and at batch 5 over different lengths (mixed with prefill
chunks), on 1 and 2 threads.

Models: the embedded SmolLM2 (its default `q4x8`), a tiny random Llama and the tiny
random Qwen3 (per-head q/k norm) in `q4x8`, `q8x8` and `full` (dense panels).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import words
from exactness import assert_same_logits, run_recorded

from flare.loading.checkpoint import load_checkpoint
from flare.models import llama
from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.engine import Engine

PAGE = 16
NEW_TOKENS = 4
PROMPT = words(70, seed=5)  # 4 full pages and a partial one
BATCH = {f"s{i}": words(9 + 17 * i, seed=300 + i) for i in range(5)}  # 9 .. 77 tokens


CASES = [("embedded", "q4x8"), ("tiny_llama", "q4x8"), ("tiny_llama", "q8x8"),
         ("tiny_qwen3", "q4x8"), ("tiny_qwen3", "q8x8"), ("tiny_qwen3", "full")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{f}" for m, f in CASES])
def make(request, embedded_checkpoint, tiny_qwen3_dir):
    """make(max_batch_tokens, max_num_seqs, native) -> an Engine; native=False keeps the
    Python fused path (the reference)."""
    name, fmt = request.param
    ckpt = {"embedded": lambda: embedded_checkpoint,
            "tiny_llama": lambda: request.getfixturevalue("tiny_llama"),
            "tiny_qwen3": lambda: load_checkpoint(tiny_qwen3_dir)}[name]()
    stored = convert_tensors(ckpt.tensors, fmt, getattr(ckpt, "blocks", None))

    def build(max_batch_tokens: int, max_num_seqs: int, native: bool) -> Engine:
        plan = make_plan(ckpt.config, max_seq_len=256, max_num_seqs=max_num_seqs,
                         max_batch_tokens=max_batch_tokens, page_size=PAGE)
        engine = Engine(ckpt.config, plan, stored, ckpt.tokenizer)
        assert engine.model.native is not None, f"{name} in {fmt}: no native layers"
        if not native:
            engine.model.native = None
        return engine

    return build


@pytest.fixture
def native_calls(monkeypatch):
    """How many steps ran through the native call, and how many fell back to the Python
    loop (a counter around the real `native_forward`)."""
    calls = {"native": 0, "fallback": 0}
    real = llama.native_forward

    def counted(*args, **kwargs):
        y = real(*args, **kwargs)
        calls["native" if y is not None else "fallback"] += 1
        return y

    monkeypatch.setattr(llama, "native_forward", counted)
    return calls


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _compare(make, prompts: dict[str, list[int]], max_batch_tokens: int,
             max_num_seqs: int, label: str) -> None:
    ref = run_recorded(make(max_batch_tokens, max_num_seqs, native=False), prompts,
                       NEW_TOKENS)
    got = run_recorded(make(max_batch_tokens, max_num_seqs, native=True), prompts,
                       NEW_TOKENS)
    for rid in prompts:
        assert_same_logits(got[rid][1], ref[rid][1], f"{label}, {rid}")
        assert got[rid][0] == ref[rid][0]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_chunks_and_decode_at_batch_1(make, chunk, threads, native_calls):
    _compare(make, {"x": PROMPT}, chunk, 1, f"chunk {chunk}, {threads} threads")
    assert native_calls["native"] > 0 and native_calls["fallback"] == 0, native_calls


def test_decode_at_batch_5_over_different_lengths(make, threads, native_calls):
    _compare(make, BATCH, 64, 5, f"batch 5, {threads} threads")
    assert native_calls["native"] > 0 and native_calls["fallback"] == 0, native_calls
