"""Row invariance of every kernel on the dense serving path, the way `batch_invariant_ops`
states it: row i of a batched call equals the call on row i alone, bit for bit
(`torch.equal`), whatever rows run beside it, however a prompt is chunked, on 1 thread
or 2. The linear kernels have their own (test_dense_kernels.py, test_q4.py); here the
fused float32 ops and the one attention routine (kernels/attention.cpp).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flare.models.attention import FUSED_ATTENTION_MAX_GROUP, fused_attention_fits

kernels = pytest.importorskip("flare.kernels")
OPS = kernels.fused_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="Flare's kernel module is unavailable")


def _rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i:i + 1].contiguous()) for i in range(x.shape[0])])


@pytest.mark.parametrize("h", [576, 64, 19])
def test_norms_and_silu_rows_do_not_depend_on_their_batch(h):
    torch.manual_seed(0)
    x, w = torch.randn(37, h), torch.rand(h) + 0.5
    assert torch.equal(OPS.rms_norm(x, w, 1e-5), _rows_alone(lambda r: OPS.rms_norm(r, w, 1e-5), x))
    gu = torch.randn(37, 2 * h)
    assert torch.equal(OPS.silu_mul(gu), _rows_alone(OPS.silu_mul, gu))
    r = torch.randn(37, h)
    batched, xb = OPS.add_rms_norm(x.clone(), r, w, 1e-5), x.clone()
    xb.add_(r)
    alone = torch.cat([OPS.add_rms_norm(x[i:i + 1].clone(), r[i:i + 1].contiguous(), w, 1e-5)
                       for i in range(37)])
    assert torch.equal(batched, alone)


def test_rope_store_rows_do_not_depend_on_their_batch():
    torch.manual_seed(1)
    t, h, kvh, d = 29, 6, 2, 32
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(64).float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    pos, slots = torch.randint(0, 64, (t,)), torch.randperm(64)[:t]
    norm = torch.rand(h + kvh, d) + 0.5
    kc, vc = torch.zeros(64, kvh, d), torch.zeros(64, kvh, d)
    q = OPS.rope_store(qkv, cos, sin, pos, kc, vc, slots, h, kvh, norm, 1e-6)
    k1, v1 = torch.zeros_like(kc), torch.zeros_like(vc)
    alone = torch.cat([OPS.rope_store(qkv[i:i + 1].contiguous(), cos, sin, pos[i:i + 1],
                                      k1, v1, slots[i:i + 1], h, kvh, norm, 1e-6)
                       for i in range(t)])
    assert torch.equal(q, alone) and torch.equal(kc, k1) and torch.equal(vc, v1)


def test_int8_activation_rounding_rows_do_not_depend_on_their_batch():
    torch.manual_seed(2)
    x = torch.randn(23, 576) * 3
    codes, scales = OPS.quantize_rows_q8(x)
    for i in range(23):
        c, s = OPS.quantize_rows_q8(x[i:i + 1].contiguous())
        assert torch.equal(c[0], codes[i]) and torch.equal(s[0], scales[i])


S, KVH, H, D = 1024, 3, 9, 64
SCALE = 1 / math.sqrt(D)


@pytest.fixture(scope="module")
def cache():
    torch.manual_seed(3)
    return torch.randn(S, KVH, D), torch.randn(S, KVH, D)


def _prefill(q, kc, vc, gather, start, end, scale=SCALE):
    """Rows [start, end) of a causal prompt whose positions 0..end-1 sit at `gather`."""
    return OPS.cached_attention(q[start:end].contiguous(), kc, vc,
                                gather[:end].contiguous().view(1, -1),
                                torch.tensor([end]), end - start, scale)


@pytest.mark.parametrize("d", [64, 32, 24])  # 24: the scalar path (D not a multiple of 8)
def test_attention_is_sdpa_within_rounding(d):
    torch.manual_seed(4)
    kc, vc = torch.randn(256, 2, d), torch.randn(256, 2, d)
    gather = torch.randperm(256)[:150]
    q = torch.randn(150, 4, d)
    o = _prefill(q, kc, vc, gather, 0, 150, 1 / math.sqrt(d))
    k = kc[gather].transpose(0, 1)[None]
    v = vc[gather].transpose(0, 1)[None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True,
                                         scale=1 / math.sqrt(d), enable_gqa=True)
    torch.testing.assert_close(o, ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 16, 50, 64, 300])  # 50: tiles of 13, 13, 13, 11
def test_attention_rows_equal_in_any_chunking(cache, chunk):
    kc, vc = cache
    torch.manual_seed(5)
    gather, q = torch.randperm(S)[:300], torch.randn(300, H, D)
    whole = _prefill(q, kc, vc, gather, 0, 300)
    parts = torch.cat([_prefill(q, kc, vc, gather, s, min(300, s + chunk))
                       for s in range(0, 300, chunk)])
    assert torch.equal(parts, whole)


def test_attention_decode_rows_equal_prefill_rows(cache):
    """A decode token (one row, `decode_attention_gather` / `decode_attention` over a
    span) is the prefill row at its position, beside any other decode rows."""
    kc, vc = cache
    torch.manual_seed(6)
    gather, q = torch.randperm(S)[:200], torch.randn(200, H, D)
    whole = _prefill(q, kc, vc, gather, 0, 200)
    for p in (0, 1, 15, 16, 17, 63, 64, 65, 199):
        alone = OPS.decode_attention_gather(q[p:p + 1].contiguous(), kc, vc,
                                            gather[:p + 1].contiguous().view(1, -1),
                                            torch.tensor([p + 1]), SCALE)
        assert torch.equal(alone[0], whole[p]), p
    # beside 7 others of other lengths, padded gathers
    others = [torch.randperm(S)[:n] for n in (3, 50, 100, 129, 150, 170, 190)]
    rows = [torch.cat([g, torch.zeros(200 - len(g), dtype=torch.int64)]) for g in others]
    g8 = torch.stack(rows + [gather]).contiguous()
    q8 = torch.cat([torch.randn(7, H, D), q[120:121]]).contiguous()
    lens = torch.tensor([len(g) for g in others] + [121])
    batched = OPS.decode_attention_gather(q8, kc, vc, g8, lens, SCALE)
    assert torch.equal(batched[7], whole[120])
    # beside 7 others of about its length (at most twice the shortest: attention.cpp then
    # takes all KV heads of a sequence as one work item)
    others = [torch.randperm(S)[:n] for n in (100, 110, 125, 140, 150, 170, 199)]
    rows = [torch.cat([g, torch.zeros(200 - len(g), dtype=torch.int64)]) for g in others]
    g8 = torch.stack(rows + [gather]).contiguous()
    lens = torch.tensor([len(g) for g in others] + [121])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            batched = OPS.decode_attention_gather(q8, kc, vc, g8, lens, SCALE)
            assert torch.equal(batched[7], whole[120]), threads
    finally:
        torch.set_num_threads(before)
    start = 100  # one sequence in consecutive slots: the span op
    span_q = torch.randn(1, H, D)
    span = OPS.decode_attention(span_q[0].contiguous(), kc, vc, start, 77, SCALE)
    gathered = OPS.decode_attention_gather(span_q, kc, vc, torch.arange(start, start + 77)
                                           .view(1, -1), torch.tensor([77]), SCALE)
    assert torch.equal(span, gathered[0])


def test_attention_rows_equal_on_one_thread_and_two(cache):
    kc, vc = cache
    torch.manual_seed(7)
    gather, q = torch.randperm(S)[:700], torch.randn(700, H, D)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _prefill(q, kc, vc, gather, 0, 700)
        torch.set_num_threads(2)
        two = _prefill(q, kc, vc, gather, 0, 700)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_attention_refuses_bad_arguments(cache):
    kc, vc = cache
    q = torch.randn(4, H, D)
    with pytest.raises(RuntimeError, match="lengths"):  # fewer keys than query rows
        OPS.cached_attention(q, kc, vc, torch.arange(8).view(1, -1), torch.tensor([3]), 4, SCALE)
    with pytest.raises(RuntimeError, match="outside the cache"):
        OPS.cached_attention(q, kc, vc, torch.tensor([[0, 1, 2, S]]), torch.tensor([4]), 4,
                             SCALE)
    with pytest.raises(RuntimeError, match="rows"):
        OPS.cached_attention(q, kc, vc, torch.arange(8).view(1, -1), torch.tensor([8]), 3,
                             SCALE)
    # more query heads a KV head than a tile holds: refused, never written past the tile
    wide = torch.randn(1, KVH * (FUSED_ATTENTION_MAX_GROUP + 1), D)
    with pytest.raises(RuntimeError, match="query heads a KV head"):
        OPS.decode_attention(wide[0], kc, vc, 0, 8, SCALE)
    widest = torch.randn(KVH * FUSED_ATTENTION_MAX_GROUP, D)  # the most a tile holds
    assert OPS.decode_attention(widest, kc, vc, 0, 8, SCALE).shape == widest.shape
    assert fused_attention_fits(KVH * FUSED_ATTENTION_MAX_GROUP, KVH)
    assert not fused_attention_fits(KVH * (FUSED_ATTENTION_MAX_GROUP + 1), KVH)
