"""RoPE tables hold cos and sin of their float32 angles computed in float64 and rounded
once to float32 (`flare.models.rope`), checked here against Python's `math.cos` and
`math.sin` element by element.

torch's own float32 cos on CPU (MKL's vector math) gives other last bits on about 5% of
a table's elements, and once in a while a whole thread's share at low accuracy (1.5e-4
off), which made a q4_k_m prompt's logits differ between two engines of one process;
tables built by torch's cos fail these tests.
"""

from __future__ import annotations

import math

import pytest
import torch

from flare.models import hybrid_common, rope
from flare.models.llama import rope_inv_freq
from flare.models.recipe import build_model


def _rounded_once(fn, angles: torch.Tensor) -> torch.Tensor:
    """fn (math.cos or math.sin) of each float32 angle in float64, rounded to float32."""
    values = [fn(a) for a in angles.double().flatten().tolist()]
    return torch.tensor(values, dtype=torch.float64).float().reshape(angles.shape)


def _angles(inv_freq: torch.Tensor, positions: int) -> torch.Tensor:
    """[positions, 2 * len(inv_freq)] float32: position * inv_freq, halves duplicated,
    as transformers computes them."""
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)


def test_cos_sin_are_float64_values_rounded_once():
    angles = torch.linspace(-300.0, 300.0, 20_001, dtype=torch.float32)
    cos, sin = rope.cos_sin(angles)
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, _rounded_once(math.cos, angles))
    assert torch.equal(sin, _rounded_once(math.sin, angles))


def test_cos_sin_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float64"):
        rope.cos_sin(torch.zeros(3, dtype=torch.float64))


@pytest.mark.slow
def test_llama_tables_are_rounded_once(embedded_checkpoint):
    """The embedded model's tables (512 positions): cos, and sin with its first half
    negated (`sin_signed`), each element the float64 value of its float32 angle."""
    ckpt = embedded_checkpoint
    model = build_model(ckpt.config, ckpt.tensors, max_positions=512)
    angles = _angles(rope_inv_freq(ckpt.config), 512)
    half = angles.shape[-1] // 2
    sin = _rounded_once(math.sin, angles)
    assert torch.equal(model.cos, _rounded_once(math.cos, angles))
    assert torch.equal(model.sin_signed, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1))


def test_hybrid_tables_are_rounded_once():
    """hybrid_common.rope_tables (partial RoPE over 8 channels, 300 positions)."""
    cos, sin = hybrid_common.rope_tables(10000.0, 8, 300, torch.float32, torch.device("cpu"))
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.int64).float() / 8))
    angles = _angles(inv, 300)
    assert torch.equal(cos, _rounded_once(math.cos, angles))
    assert torch.equal(sin, _rounded_once(math.sin, angles))
