"""Kernels writing into a caller's buffer (`out=`, kernels/ops.h): the int8 linears,
attention, add_rms_norm, silu_mul and rope_store give the same bytes into `out` as into
a new tensor, return `out` itself (its storage, so the native step's buffers are really
reused), and refuse an `out` of another shape or dtype with an error naming it. The
native step (kernels/layers.cpp) reuses its buffers this way; test_native_layers checks
its logits against the Python path's bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

K = pytest.importorskip("flare.kernels")
from flare.kernels import probe

pytestmark = pytest.mark.skipif(K.qgemm_problem() is not None,
                                reason=f"Flare's kernels: {K.qgemm_problem()}")

TAKES_OUT = ("q4x8_linear", "q8x8_linear", "q4kx8_linear", "q6kx8_linear", "q5x8_linear",
             "q5kx8_linear", "cached_attention")


class WithOut:
    """A kernel module whose every function is called with `out=` the given tensor."""

    def __init__(self, module, out: torch.Tensor):
        self.module, self.out = module, out

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        return lambda *args, **kwargs: fn(*args, out=self.out, **kwargs)


def _same_into_out(call, module) -> None:
    want = call(module)
    out = torch.full_like(want, math.nan)
    got = call(WithOut(module, out))
    assert got.data_ptr() == out.data_ptr()
    assert probe.same_bytes(got, want)


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_linears_and_attention_write_the_same_bytes_into_out(rows):
    module = K.qgemm()
    calls = [(name, call) for name, call in probe.problem(rows, seed=rows)
             if name.split(" ")[0] in TAKES_OUT]
    assert {name.split(" ")[0] for name, _ in calls} == set(TAKES_OUT)
    for name, call in calls:
        _same_into_out(call, module)


@pytest.mark.parametrize("t", [1, 40])
def test_fused_ops_write_the_same_bytes_into_out(t):
    ops = K.fused_ops()
    g = torch.Generator().manual_seed(t)
    h, kvh, d, hidden, f, slots = 9, 3, 64, 576, 96, 64
    x, r, w = (torch.randn(t, hidden, generator=g) for _ in range(3))
    x2 = x.clone()
    want = ops.add_rms_norm(x, r, w[0], 1e-6)
    out = torch.full_like(want, math.nan)
    assert ops.add_rms_norm(x2, r, w[0], 1e-6, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, want) and torch.equal(x2, x)

    gu = torch.randn(t, 2 * f, generator=g)
    out = torch.full((t, f), math.nan)
    assert ops.silu_mul(gu, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, ops.silu_mul(gu))

    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    cos, sin = torch.randn(128, d, generator=g), torch.randn(128, d, generator=g)
    pos, where = torch.arange(t) + 3, torch.randperm(slots, generator=g)[:t]
    caches = [torch.zeros(slots, kvh, d) for _ in range(4)]
    want = ops.rope_store(qkv, cos, sin, pos, caches[0], caches[1], where, h, kvh, None, 1e-6)
    out = torch.full((t, h, d), math.nan)
    got = ops.rope_store(qkv, cos, sin, pos, caches[2], caches[3], where, h, kvh, None, 1e-6,
                         out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("length", [5, 300])
def test_decode_attention_takes_one_row_of_a_step_and_writes_out(length):
    """q [H, D] or [1, H, D] (the step's lone row, as its q buffer holds it): the same o."""
    g = torch.Generator().manual_seed(length)
    h, kvh, d, s = 9, 3, 64, 400
    q = torch.randn(h, d, generator=g)
    kc, vc = torch.randn(s, kvh, d, generator=g), torch.randn(s, kvh, d, generator=g)
    ops = K.fused_ops()
    want = ops.decode_attention(q, kc, vc, 7, length, 0.125)
    out = torch.full((1, h, d), math.nan)
    got = ops.decode_attention(q.unsqueeze(0), kc, vc, 7, length, 0.125, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out[0], want)
    with pytest.raises(RuntimeError, match=r"3-dim q must be \[1, H, D\]"):
        ops.decode_attention(torch.randn(2, h, d), kc, vc, 7, length, 0.125)


def test_an_out_of_another_shape_or_dtype_is_refused():
    ops = K.fused_ops()
    module = K.qgemm()
    gu = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=r"out must be a contiguous float32 CPU tensor of "
                                           r"shape \[2, 8\], got \[2, 9\]"):
        ops.silu_mul(gu, out=torch.empty(2, 9))
    with pytest.raises(RuntimeError, match="out must be a contiguous float32"):
        ops.silu_mul(gu, out=torch.empty(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="out must be a contiguous float32"):
        ops.silu_mul(gu, out=torch.empty(8, 2).t())
    (_, linear), = [(n, c) for n, c in probe.problem(3) if n == "q8x8_linear"]
    with pytest.raises(RuntimeError, match=r"shape \[3, 24\], got \[3, 23\]"):
        linear(WithOut(module, torch.empty(3, 23)))
