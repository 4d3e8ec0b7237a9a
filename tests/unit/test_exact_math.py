"""RoPE tables hold cos and sin of their float32 angles computed in float64 and rounded
once to float32 (`flare.models.exact_math`), checked here against Python's `math.cos` and
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

from flare.models import exact_math, hybrid_common
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
    cos, sin = exact_math.cos_sin(angles)
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, _rounded_once(math.cos, angles))
    assert torch.equal(sin, _rounded_once(math.sin, angles))


def test_cos_sin_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float64"):
        exact_math.cos_sin(torch.zeros(3, dtype=torch.float64))


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


def test_exp_and_log1p_are_row_invariant_and_close_to_float64():
    """exp and log1p of each element alone equal the whole call's (a row's values never
    depend on the rest of the buffer, its last elements included), within 2 float32 ulp
    of the float64 values; overflow gives inf without a warning."""
    x = torch.linspace(-30.0, 30.0, 1_037, dtype=torch.float32)
    for fn, ref, xs in ((exact_math.exp, torch.exp, x), (exact_math.log1p, torch.log1p, x.abs())):
        whole = fn(xs)
        assert torch.equal(torch.cat([fn(xs[i:i + 1]) for i in range(len(xs))]), whole)
        assert torch.equal(fn(xs[5:18]), whole[5:18])
        want = ref(xs.double())
        assert bool(((whole.double() - want).abs() <= 2 * torch.finfo(torch.float32).eps
                     * want.abs()).all())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert exact_math.exp(torch.tensor([100.0])).item() == math.inf


@pytest.mark.parametrize("width", [64, 512, 49_152, 151_936])
def test_softmax_rows_do_not_depend_on_their_batch(width):
    """torch's CPU softmax and log_softmax (sampling's probabilities and log-probabilities,
    qwen3_next's router) are not VML: ATen's own vectorized loop with SLEEF's exp (perf on
    this Xeon: Sleef_finz_expf16_u10avx512f, no mkl_vml symbol), and a row's values do not
    depend on the rows beside it or on the thread that computed them. Widths: a router's
    experts, a small and the embedded and Qwen vocabularies; 1 to 9 rows on 2 threads."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g) * 8
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for fn in (torch.softmax, torch.log_softmax):
            alone = torch.cat([fn(x[i:i + 1], dim=-1) for i in range(9)])
            for rows in (2, 5, 9):
                assert torch.equal(fn(x[:rows], dim=-1), alone[:rows])
    finally:
        torch.set_num_threads(threads)
