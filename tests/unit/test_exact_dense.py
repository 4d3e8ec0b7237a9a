"""Exact by default, recipe `llama`: in each model's default weight format, a token's fp32
logits are bit-identical (`torch.equal`) across chunk sizes 1, 7, 16, 64 and the whole
prompt; after a reuse at a page boundary, one token either side of it, and at a whole
previous turn; alone and beside 3 and 7 other sequences of different lengths.

Models: the embedded SmolLM2 (GGUF, its default format), a tiny random Llama and the
tiny random Qwen3 (safetensors, their default format). See exactness.py for how the
engine's own sampled logits are recorded.
"""

from __future__ import annotations

import pytest

from engine_helpers import words
from exactness import check_batch_neighbours, check_chunkings, check_reuse_positions
from flare.loading.checkpoint import load_checkpoint
from flare.models.quant.formats import default_weight_format
from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.engine import Engine

PAGE = 16
NEW_TOKENS = 6


def _maker(ckpt):
    """make(max_batch_tokens, max_num_seqs) -> an Engine over `ckpt` in its default
    weight format (the format `flare prepare` picks for it)."""
    fmt = default_weight_format(dtype="float32", device="cpu", recipe="llama",
                                source=ckpt.source)
    stored = convert_tensors(ckpt.tensors, fmt)

    def make(max_batch_tokens: int, max_num_seqs: int) -> Engine:
        plan = make_plan(ckpt.config, max_seq_len=256, max_num_seqs=max_num_seqs,
                         max_batch_tokens=max_batch_tokens, page_size=PAGE)
        return Engine(ckpt.config, plan, stored, ckpt.tokenizer)

    make.fmt = fmt
    return make


@pytest.fixture(scope="module", params=["embedded", "tiny_llama", "tiny_qwen3"])
def make(request, embedded_checkpoint, tiny_qwen3_dir):
    if request.param == "embedded":
        return _maker(embedded_checkpoint)
    if request.param == "tiny_llama":
        return _maker(request.getfixturevalue("tiny_llama"))
    return _maker(load_checkpoint(tiny_qwen3_dir))


PROMPT = words(70, seed=3)  # 4 full pages and a partial one


def test_logits_equal_across_chunk_sizes(make):
    check_chunkings(make, PROMPT, NEW_TOKENS)


def test_logits_equal_after_reuse_at_any_position(make):
    check_reuse_positions(make, PROMPT, NEW_TOKENS, PAGE)


def test_logits_equal_alone_and_beside_other_sequences(make):
    check_batch_neighbours(make, PROMPT, NEW_TOKENS)


def test_embedded_default_format_is_the_native_q4x8(embedded_checkpoint):
    """The embedded Q4_1 GGUF is served as stored: its default format is `q4x8`."""
    assert _maker(embedded_checkpoint).fmt == "q4x8"
