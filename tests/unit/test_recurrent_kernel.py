"""The hybrids' sequence mixers in isolation, bit for bit: the gated delta rule
(`flare.models.gated_delta.gated_delta_rule`: recurrent.cpp's kernel and its torch fallback)
and the causal depthwise conv (`flare.models.hybrid_common.causal_conv`).

For each: a sequence's outputs and final state are `torch.equal` whether its tokens run
in one call, in chunks of 1, 7, 16 or 64, one token per call, or beside other sequences
of other lengths in the same call (decode runs of one token and prefill chunks mixed).
"""

from __future__ import annotations

import pytest
import torch

from flare.models.attention import AttentionBatch, DecodeGroup, PrefillChunk
from flare.models.gated_delta import gated_delta_rule, gated_delta_step
from flare.models.hybrid_common import causal_conv

CHUNKS = (1, 7, 16, 64, None)  # None: the whole sequence in one call


def _kernel():
    from flare.kernels import fused_ops

    ops = fused_ops()
    if ops is None or not hasattr(ops, "gated_delta_rule"):
        pytest.skip("Flare's kernel module is unavailable here")
    return ops


@pytest.fixture(params=["kernel", "torch"])
def ops(request):
    return _kernel() if request.param == "kernel" else None


def _inputs(t: int, hq: int, h: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, hq, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hq, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.5
    beta = torch.rand(t, h, generator=gen)
    return q, k, v, g, beta


def _run(ops, x, pool, runs):
    """gated_delta_rule over `runs` [(slot, lo, hi)] of the token arrays `x` (laid out
    in that order): returns o and advances `pool`."""
    q, k, v, g, beta = (torch.cat([a[lo:hi] for _, lo, hi in runs]) for a in x)
    starts = torch.tensor([0] + list(torch.tensor([hi - lo for _, lo, hi in runs]).cumsum(0)))
    slots = torch.tensor([s for s, _, _ in runs])
    return gated_delta_rule(q, k, v, g, beta, pool, starts, slots, ops)


@pytest.mark.parametrize("dims", [(2, 4, 16, 8), (1, 3, 8, 13), (2, 2, 64, 64)])
def test_delta_rule_chunked_and_batched_equal_one_call(ops, dims):
    hq, h, dk, dv = dims
    t = 150
    x = _inputs(t, hq, h, dk, dv, seed=1)
    pool0 = torch.randn(6, h, dk, dv)
    ref_pool = pool0.clone()
    ref = _run(ops, x, ref_pool, [(3, 0, t)])
    for chunk in CHUNKS[:-1]:
        pool = pool0.clone()
        outs = [_run(ops, x, pool, [(3, a, min(a + chunk, t))]) for a in range(0, t, chunk)]
        assert torch.equal(torch.cat(outs), ref), chunk
        assert torch.equal(pool, ref_pool), chunk
    # beside others: two decode-like runs of one token of other sequences, then this
    # sequence's chunk, then a long chunk of a fourth, in one call per step
    others = [_inputs(t, hq, h, dk, dv, seed=s) for s in (2, 3, 4)]
    pool = pool0.clone()
    outs = []
    for a in range(0, t, 7):
        b = min(a + 7, t)
        parts = [tuple(o[i][a:a + 1] for i in range(5)) for o in others[:2]]
        parts += [tuple(xi[a:b] for xi in x), tuple(o[a:a + 20] for o in others[2])]
        lens = [1, 1, b - a, parts[3][0].shape[0]]
        cat = tuple(torch.cat([p[i] for p in parts]) for i in range(5))
        starts = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
        o = gated_delta_rule(*cat, pool, starts, torch.tensor([0, 5, 3, 1]), ops)
        outs.append(o[2:2 + b - a])
    assert torch.equal(torch.cat(outs), ref)
    assert torch.equal(pool[3], ref_pool[3])


def test_kernel_is_close_to_the_torch_step_loop():
    ops = _kernel()
    t, hq, h, dk, dv = 90, 2, 4, 16, 12
    x = _inputs(t, hq, h, dk, dv, seed=5)
    pool0 = torch.randn(2, h, dk, dv)
    pk, pt = pool0.clone(), pool0.clone()
    ok = _run(ops, x, pk, [(1, 0, t)])
    ot = _run(None, x, pt, [(1, 0, t)])
    assert torch.allclose(ok, ot, atol=1e-5) and torch.allclose(pk, pt, atol=1e-5)
    # one step of the rule by hand for head 0 of the first token
    q, k, v, g, beta = (a[:1] for a in x)
    o1, s1 = gated_delta_step(q.repeat_interleave(2, 1), k.repeat_interleave(2, 1), v, g, beta,
                              pool0[1:2])
    assert torch.allclose(ok[:1], o1, atol=1e-6)


def test_kernel_refuses_bad_arguments():
    ops = _kernel()
    q, k, v, g, beta = _inputs(4, 1, 2, 8, 8, seed=0)
    pool = torch.zeros(3, 2, 8, 8)
    starts = torch.tensor([0, 2, 4])
    with pytest.raises(RuntimeError, match="named twice"):
        gated_delta_rule(q, k, v, g, beta, pool, starts, torch.tensor([1, 1]), ops)
    with pytest.raises(RuntimeError, match="out of range"):
        gated_delta_rule(q, k, v, g, beta, pool, starts, torch.tensor([0, 3]), ops)
    with pytest.raises(RuntimeError, match="from 0 to T"):
        gated_delta_rule(q, k, v, g, beta, pool, torch.tensor([0, 2, 3]),
                         torch.tensor([0, 1]), ops)
    with pytest.raises(RuntimeError, match="state must be"):
        gated_delta_rule(q, k, v, g, beta, torch.zeros(3, 2, 8, 4), starts,
                         torch.tensor([0, 1]), ops)
    with pytest.raises(RuntimeError, match="float32"):
        gated_delta_rule(q.double(), k, v, g, beta, pool, starts, torch.tensor([0, 1]), ops)


# ---- the causal depthwise conv ------------------------------------------------------------

def _conv_step(x_groups, weight, bias, states, decode_slots, chunks):
    """One causal_conv call: decode tokens (one row of each `decode_slots` sequence's
    inputs), then `chunks` [(slot, rows)]. Returns the outputs of each group."""
    parts = [r for r in x_groups] + [rows for _, rows in chunks]
    x = torch.cat(parts) if parts else torch.empty(0, weight.shape[0])
    b = len(x_groups)
    dec = None
    if b:
        dec = DecodeGroup(b, torch.zeros(b, 1, dtype=torch.int64), None,
                          torch.tensor(decode_slots, dtype=torch.int64))
    pre, off = [], b
    for slot, rows in chunks:
        pre.append(PrefillChunk(off, rows.shape[0], torch.zeros(1, dtype=torch.int64), None,
                                slot))
        off += rows.shape[0]
    batch = AttentionBatch(torch.zeros(x.shape[0], dtype=torch.int64), dec, tuple(pre))
    return causal_conv(x, weight, bias, batch, states)


@pytest.mark.parametrize("kernel,bias", [(4, False), (3, True)])
def test_conv_chunked_decode_and_batched_equal_one_call(kernel, bias):
    torch.manual_seed(0)
    c, t = 40, 100
    weight, b = torch.randn(c, kernel), (torch.randn(c) if bias else None)
    x = torch.randn(t, c)
    states0 = torch.randn(5, c, kernel - 1)
    ref_states = states0.clone()
    ref = _conv_step([], weight, b, ref_states, [], [(2, x)])
    # transformers' form: conv1d over the state window and the inputs
    window = torch.cat([states0[2], x.T], dim=-1)
    conv = torch.nn.functional.conv1d(window[None], weight[:, None], b, groups=c)[0].T
    assert torch.allclose(ref, conv, atol=1e-5)
    assert torch.equal(ref_states[2], x[-(kernel - 1):].T)
    for chunk in CHUNKS[:-1]:
        st = states0.clone()
        outs = [_conv_step([], weight, b, st, [], [(2, x[a:a + chunk])])
                for a in range(0, t, chunk)]
        assert torch.equal(torch.cat(outs), ref) and torch.equal(st, ref_states), chunk
    # token by token through the decode group, beside another decoding sequence and a
    # prefill chunk of a third
    st = states0.clone()
    other, third = torch.randn(t, c), torch.randn(t, c)
    outs = []
    for i in range(t):
        y = _conv_step([other[i:i + 1], x[i:i + 1]], weight, b, st, [4, 2],
                       [(0, third[i:i + 3])])
        outs.append(y[1:2])
    assert torch.equal(torch.cat(outs), ref) and torch.equal(st[2], ref_states[2])
