"""A GGUF served in its own blocks (weight formats `q4x8` and `q8x8`, issue 17).

Tiny random Llamas are written as GGUF files with the `gguf` package's writer and
quantizer (Q4_0, Q8_0, mixes, float16 / float32 output layers), with the embedded model's
tokenizer. Checked: the block readers give gguf's own dequantization exactly; each file's
default format; the served weights dequantize exactly to the file's values (never
re-quantized); the engine's exactness checks (chunkings, batch neighbours) in the
default format; greedy tokens equal transformers on the dequantized weights with each
int8-fed linear layer's input rounded to int8 blocks; a prepared package of each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize
from gguf_files import (
    ServedGGUFChecks,
    T,
    needs_kernel,
    served_gguf_fixtures,
    write_llama_gguf,
)

from flare.models.quant.blocks import quantize_q4, quantize_q8
from flare.models.quant.formats import native_format
from flare.models.quant.gguf_blocks import GGUFBlocks, q4_from_gguf, q8_from_gguf
from flare.models.quant.interleaved import Q4x8Weight, Q8x8Weight, interleave, q4_mins
from flare.models.quant.linear import Linear
from flare.models.quant.storage import convert_tensors, weight_getter


def _blocks(a: np.ndarray, kind: str) -> tuple[GGUFBlocks, np.ndarray]:
    """`a` [N, K] quantized by gguf to `kind`: the blocks and gguf's dequantized floats."""
    raw = quantize(a, T[kind])
    return GGUFBlocks(kind, torch.from_numpy(raw.copy())), dequantize(raw, T[kind])


# ---- block readers -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_readers_give_ggufs_dequantization_exactly(kind):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((16, 256)) * rng.uniform(0.01, 3, (16, 1))).astype(np.float32)
    a[3, 32:64] = 0.0  # an all-zero block
    b, ref = _blocks(a, kind)
    ref = torch.from_numpy(ref)
    if kind in ("Q4_0", "Q4_1"):
        codes, d, m = q4_from_gguf(b)
        q = torch.cat([codes.view(16, -1, 16) & 0xF, codes.view(16, -1, 16) >> 4], -1)
        assert m.shape == ((16, 0) if kind == "Q4_0" else d.shape)  # Q4_0: no mins held
        got = (q.float() * d.float().unsqueeze(-1) + q4_mins(d, m).unsqueeze(-1)).view(16, 256)
        assert torch.equal(got, ref)
        packed = Q4x8Weight.of(codes, d, m, "w")
        assert isinstance(packed, Q4x8Weight)
        assert torch.equal(packed.dequantize(), ref)
        ids = torch.tensor([0, 9, 3, 15])
        assert torch.equal(packed[ids], ref[ids])  # the embedding lookup
    if kind in ("Q4_0", "Q8_0"):
        codes, d = q8_from_gguf(b)
        got = (codes.view(16, -1, 32).float() * d.float().unsqueeze(-1)).view(16, 256)
        assert torch.equal(got, ref)


def test_requantizing_q8_0_floats_gives_back_their_blocks_and_q4_0_would_move():
    """Q8_0 as gguf (and llama.cpp) quantize it: re-quantizing the dequantized floats gives
    back the file's codes and float16 scales exactly. Q4_0 as Q4_1 does not: a block that
    does not span both extreme codes moves, which is why Q4_0 is read from its blocks."""
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((32, 512)) * 0.05).astype(np.float32)
    b, floats = _blocks(a, "Q8_0")
    codes, d = q8_from_gguf(b)
    q = quantize_q8(torch.from_numpy(floats))
    assert torch.equal(q.codes, codes) and torch.equal(q.scales, d.float())
    b4, floats4 = _blocks(a, "Q4_0")
    requantized = quantize_q4(torch.from_numpy(floats4)).dequantize()
    assert not torch.equal(requantized, torch.from_numpy(floats4))


@needs_kernel
def test_q8x8_kernel_takes_a_file_code_of_minus_128():
    """llama.cpp's quantizer writes codes in -127..127, but a file may hold -128: the
    kernel's |w| (as unsigned 128) and sign trick still give the exact integer sums."""
    torch.manual_seed(5)
    w = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    w[0, :32], w[3, 5] = -128, -128
    scales = torch.rand(8, 2).half()
    q = Q8x8Weight(interleave(w, 4), interleave(scales, 1))
    x = torch.randn(3, 64)
    x_int8 = quantize_q8(x).dequantize().double()
    ref = F.linear(x_int8, q.dequantize().double()).float()
    torch.testing.assert_close(Linear(q, None, torch.float32)(x), ref, rtol=0, atol=1e-4)


# ---- tiny GGUFs ----------------------------------------------------------------------------

# name: (layer type, down_proj type, embedding type, output type or None = tied, default)
FILES = {
    "q4_0": ("Q4_0", "Q4_0", "Q4_0", None, "q4x8"),
    "q4_0_f16_out": ("Q4_0", "Q4_1", "Q8_0", "F16", "q4x8"),
    "q8_0": ("Q8_0", "Q8_0", "Q8_0", None, "q8x8"),
    "q8_0_mix": ("Q8_0", "Q4_0", "Q4_0", "F32", "q8x8"),
}


def write_spec_gguf(path, spec: tuple, tok: dict, seed: int = 3) -> None:
    """A random 2-layer Llama (hidden 64, FFN 128, SmolLM2's vocabulary) as a GGUF of the
    types in `spec`."""
    layer_t, down_t, embed_t, out_t, _ = spec

    def kind_of(name: str) -> str:
        return (embed_t if "embed" in name else out_t if "lm_head" in name
                else down_t if "down_proj" in name else layer_t)

    write_llama_gguf(path, tok, hidden=64, ffn=128, tied=out_t is None, kind_of=kind_of,
                     seed=seed)


gguf_file, loaded = served_gguf_fixtures(FILES, write_spec_gguf)


def _served(stored: dict[str, torch.Tensor], names) -> dict[str, object]:
    get = weight_getter(stored)
    return {n: get(n) for n in names}


def test_served_weights_are_the_files_own_values(loaded):
    """Every 2-D weight, in the file's native format, dequantizes to exactly the floats
    gguf dequantizes the file to (the loader's tensors, Q/K rows un-permuted); the
    embedding lookup reads the same rows; nothing is re-quantized."""
    name, ckpt = loaded
    fmt = FILES[name][-1]
    assert native_format(ckpt.source) == fmt
    stored = convert_tensors(ckpt.tensors, fmt, ckpt.blocks)
    two_d = [n for n, t in ckpt.tensors.items() if t.dim() == 2]
    served = _served(stored, two_d)
    for n in two_d:
        w = served[n]
        value = w.dequantize() if hasattr(w, "dequantize") else w.float()
        assert torch.equal(value, ckpt.tensors[n]), n
    emb = served["model.embed_tokens.weight"]
    ids = torch.tensor([0, 7, 8, 100, 49151])
    assert torch.equal(emb[ids].float(), ckpt.tensors["model.embed_tokens.weight"][ids])
    kinds = {n: type(w).__name__ for n, w in served.items()}
    layer = kinds["model.layers.0.self_attn.q_proj.weight"]
    assert layer == ("Q4x8Weight" if fmt == "q4x8" else "Q8x8Weight")
    out_t = FILES[name][3]
    if out_t == "F16":
        assert served["lm_head.weight"].dtype == torch.float16
    elif out_t == "F32":  # random float32 values do not fit float16: kept as they are
        assert served["lm_head.weight"].dtype == torch.float32
    if name == "q4_0":  # re-quantizing the Q4_0 floats would have moved blocks
        requantized = convert_tensors(ckpt.tensors, fmt)
        w = weight_getter(requantized)("model.layers.0.mlp.up_proj.weight")
        assert not torch.equal(w.dequantize(), ckpt.tensors["model.layers.0.mlp.up_proj.weight"])


def test_checkpoint_blocks_name_every_2d_weight(loaded):
    """`Checkpoint.blocks`: each 2-D weight's type; bytes (HF row order: the q/k rows
    un-permuted, checked above through their values) for Q4_0 / Q4_1 / Q8_0 only."""
    name, ckpt = loaded
    assert set(ckpt.blocks) == {n for n, t in ckpt.tensors.items() if t.dim() == 2}
    assert ckpt.blocks["model.embed_tokens.weight"].kind == FILES[name][2]
    k = ckpt.blocks["model.layers.1.self_attn.k_proj.weight"]
    assert k.data.dtype == torch.uint8 and k.data.shape[0] == 32
    if FILES[name][3] in ("F16", "F32"):
        assert ckpt.blocks["lm_head.weight"].data is None


def test_a_k_quant_or_mixed_file_is_kx8():
    """Files neither q4x8 nor q8x8 hold whole go to kx8 (test_kquant.py), which keeps
    every weight in its own type."""
    src = {"format": "gguf", "weight_types": {"layers": ["Q4_K", "Q6_K"], "other": ["Q6_K"]}}
    assert native_format(src) == "kx8"
    src["weight_types"] = {"layers": ["Q4_1", "Q8_0"], "other": ["Q8_0"]}
    assert native_format(src) == "kx8"  # q/k/v of two kinds: stacked, not fused
    src["weight_types"] = {"layers": ["Q4_0"], "other": ["Q6_K"]}
    assert native_format(src) == "kx8"  # the output layer kept as Q6_K
    src["weight_types"] = {"layers": ["Q4_0", "Q4_1"], "other": ["F16", "Q4_0"]}
    assert native_format(src) == "q4x8"
    assert native_format({"format": "safetensors"}) is None


# ---- engines ------------------------------------------------------------------------------

class TestServedGGUF(ServedGGUFChecks):
    files = FILES
    # summation order alone (about 2e-7), except where an activation sits at an int8
    # rounding midpoint and last-bit differences move it a whole step: seen once in
    # these 12 prompts (q4_0, 17 tokens: 2.9e-3), tokens still equal
    max_diff = 1e-2


@pytest.mark.slow
def test_embedded_q4x8_from_blocks_equals_the_requantized_package(embedded_checkpoint):
    """The embedded Q4_1 GGUF: `q4x8` built from the file's blocks stores the very bytes
    re-quantizing its floats gave (so its packages and figures are unchanged)."""
    ckpt = embedded_checkpoint
    from_blocks = convert_tensors(ckpt.tensors, "q4x8", ckpt.blocks)
    requantized = convert_tensors(ckpt.tensors, "q4x8")
    assert set(from_blocks) == set(requantized)
    for k, v in from_blocks.items():
        assert torch.equal(v, requantized[k]), k
