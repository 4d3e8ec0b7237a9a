"""Flare's row-invariant dense kernels (`flare.kernels`, dense.cpp: `dense_pack`,
`f16_linear`, `f32_linear`) and `Linear` running on them for formats `fp16` and `full`.

Invariance is checked the batch_invariant_ops way: row i of a call with M rows equals,
bit for bit (`torch.equal`), the same row computed alone, for many M (each picks other
register tiles and work splits) and for 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flare.kernels import KernelUnavailable, qgemm
from flare.models.quant.linear import Linear
from flare.models.quant.sizes import (
    dense_panel_bytes,
    fbgemm_fp16_packed_bytes,
    fp16_packed_bytes,
)

try:
    K = qgemm()
except KernelUnavailable as exc:  # pragma: no cover - machines without AVX2/F16C
    pytest.skip(f"Flare's kernels are unavailable: {exc}", allow_module_level=True)

ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 64, 100, 512]
SHAPES = [(1000, 576), (72, 40), (17, 3)]  # (N, K): N off a multiple of 16 / 64


def _linear(dtype: torch.dtype):
    return K.f16_linear if dtype == torch.float16 else K.f32_linear


def _case(n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g)
    x = torch.randn(max(ROWS), k, generator=g)
    return w, b, x


def test_pack_layout_is_zero_padded_panels():
    w = torch.randn(20, 5).half()
    p = K.dense_pack(w)
    assert p.shape == (2, 5, 16) and p.dtype == torch.float16 and p.is_contiguous()
    for n in range(20):
        assert torch.equal(p[n // 16, :, n % 16], w[n])
    assert not p[1, :, 4:].any()  # rows 20..31 are zeros
    assert K.dense_pack(w.float()).dtype == torch.float32
    assert torch.equal(K.dense_pack(w.float().t().contiguous().t()), K.dense_pack(w.float()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_are_bitwise_invariant_to_the_batch(dtype, n, k, with_bias):
    w, b, x = _case(n, k, dtype)
    panels, fn = K.dense_pack(w), _linear(dtype)
    bias = b if with_bias else None
    alone = torch.cat([fn(x[i:i + 1].contiguous(), panels, n, bias) for i in range(len(x))])
    for m in ROWS:
        y = fn(x[:m].contiguous(), panels, n, bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert torch.equal(y, alone[:m]), f"M={m}: rows differ from the single-row calls"
    # any window of rows, not only a prefix
    assert torch.equal(fn(x[37:50].contiguous(), panels, n, bias), alone[37:50])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_results_do_not_depend_on_the_thread_count(dtype):
    w, b, x = _case(1000, 576, dtype, seed=1)
    panels, fn = K.dense_pack(w), _linear(dtype)
    before = torch.get_num_threads()
    try:
        out = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out[threads] = [fn(x[:m].contiguous(), panels, 1000, b) for m in (1, 7, 512)]
    finally:
        torch.set_num_threads(before)
    for a, c in zip(out[1], out[2]):
        assert torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES + [(576, 1536)])
def test_accuracy_against_the_float64_product(dtype, n, k):
    # an in-order float32 FMA chain of k terms: error <= k * 2^-24 * sum|x w| (+ bias
    # rounding); the bound below is that, and the measured error is far inside it
    w, b, x = _case(n, k, dtype, seed=2)
    y = _linear(dtype)(x, K.dense_pack(w), n, b)
    exact = x.double() @ w.double().T + b.double()
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 2.0 ** -24 * exact.abs()
    assert ((y.double() - exact).abs() <= bound + 1e-30).all()
    assert (y.double() - exact).abs().max() < 2e-5  # the figure measured is ~5e-6 at k=576


def test_degenerate_sizes():
    w = torch.randn(5, 8).half()
    p = K.dense_pack(w)
    assert K.f16_linear(torch.empty(0, 8), p, 5, None).shape == (0, 5)
    b = torch.randn(3)
    y = K.f32_linear(torch.randn(4, 0), K.dense_pack(torch.empty(3, 0)), 3, b)
    assert torch.equal(y, b.expand(4, 3))  # K = 0: the bias alone


def test_bad_inputs_raise_clear_errors():
    w = torch.randn(20, 8)
    p16, p32 = K.dense_pack(w.half()), K.dense_pack(w)
    x = torch.randn(3, 8)
    cases = [
        (lambda: K.dense_pack(torch.randn(4)), "must be 2-D"),
        (lambda: K.dense_pack(w.double()), "float16 or float32"),
        (lambda: K.f16_linear(x.double(), p16, 20, None), "x must be float32"),
        (lambda: K.f16_linear(x[None], p16, 20, None), "x must be 2-D"),
        (lambda: K.f16_linear(torch.randn(8, 3).t(), p16, 20, None), "contiguous"),
        (lambda: K.f16_linear(x, p32, 20, None), "panels must be Half"),
        (lambda: K.f32_linear(x, p16, 20, None), "panels must be Float"),
        (lambda: K.f16_linear(x, p16.view(2, 16, 8), 20, None), r"panels must be \[ceil"),
        (lambda: K.f16_linear(x, p16, 40, None), "N = 40 needs 3 panels"),
        (lambda: K.f16_linear(torch.randn(3, 9), p16, 20, None), "K = 9"),
        (lambda: K.f16_linear(x, p16, 20, torch.randn(19)), r"bias must be \[20\]"),
        (lambda: K.f16_linear(x, p16, 20, torch.randn(20).double()), "bias must be float32"),
        (lambda: K.f16_linear(x, p16.transpose(0, 1), 20, None), "panels must be"),
    ]
    for call, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            call()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_linear_serves_the_kernel_and_counts_its_panels(dtype):
    w, b, x = _case(72, 40, dtype, seed=3)
    lin = Linear(w, b, torch.float32)
    assert lin.panels is not None and lin.weight is None
    assert lin.nbytes == dense_panel_bytes(72, 40, w.element_size()) + b.nbytes
    y = lin(x[:31])
    assert torch.equal(y, torch.cat([lin(x[i:i + 1]) for i in range(31)]))
    torch.testing.assert_close(y, F.linear(x[:31], w.float(), b), rtol=0, atol=1e-5)
    # a non-contiguous input is copied, not refused
    assert torch.equal(lin(x[:8, :].t().contiguous().t()), y[:8])


def test_packed_byte_figures():
    assert fp16_packed_bytes(960, 576) == 960 * 576 * 2
    assert fp16_packed_bytes(17, 512) == 32 * 512 * 2
    assert dense_panel_bytes(17, 3, 4) == 32 * 3 * 4
    assert fbgemm_fp16_packed_bytes(960, 576) == 1024 * 960 * 2
