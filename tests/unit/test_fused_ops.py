"""Flare's fused float32 ops (`flare.kernels.fused_ops`) against their torch references,
and `LlamaModel` with the fused ops against its torch path on tiny random models."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flare.models.attention import AttentionBatch, DecodeGroup, PrefillChunk, paged_attention
from flare.models.config import ModelConfig
from flare.models.llama import LlamaModel

kernels = pytest.importorskip("flare.kernels")
OPS = kernels.fused_ops()
needs_ops = pytest.mark.skipif(OPS is None, reason="Flare's kernel module is unavailable")
pytestmark = needs_ops

ROWS = [1, 5, 40]
TOL = dict(rtol=1e-6, atol=1e-6)


def ref_norm(x, w, eps):
    """transformers' LlamaRMSNorm in fp32."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_tables(p: int, d: int):
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(p).float(), inv)] * 2, dim=-1)
    sin = emb.sin()
    return emb.cos(), torch.cat([-sin[:, :d // 2], sin[:, d // 2:]], dim=-1)


@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("h", [576, 19])
def test_rms_norm(t, h):
    torch.manual_seed(t + h)
    x, w = torch.randn(t, h) * 3, torch.rand(h) + 0.5
    torch.testing.assert_close(OPS.rms_norm(x, w, 1e-5), ref_norm(x, w, 1e-5), **TOL)


@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("h", [576, 19])
def test_add_rms_norm_updates_the_residual_in_place(t, h):
    torch.manual_seed(t * h)
    x, r, w = torch.randn(t, h), torch.randn(t, h), torch.rand(h) + 0.5
    want_x = x + r
    y = OPS.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(x, want_x)
    torch.testing.assert_close(y, ref_norm(want_x, w, 1e-6), **TOL)


@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("d", [64, 12])
def test_rope_store(t, qk_norm, d):
    torch.manual_seed(t + d)
    h, kvh, s, p, eps = 9, 3, 64, 100, 1e-6
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    cos, sin = rope_tables(p, d)
    pos = torch.randint(0, p, (t,))
    slots = torch.randperm(s)[:t]
    norm = torch.rand(h + kvh, d) + 0.5 if qk_norm else None
    kc, vc = torch.randn(s, kvh, d), torch.randn(s, kvh, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = OPS.rope_store(qkv, cos, sin, pos, kc, vc, slots, h, kvh, norm, eps)
    # the torch path of flare.models.llama
    qk = qkv[:, :(h + kvh) * d].view(t, h + kvh, d)
    if norm is not None:
        qk = ref_norm(qk, norm, eps)
    c, sn = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    qk = qk * c + qk.view(t, h + kvh, 2, d // 2).flip(2).view(t, h + kvh, d) * sn
    kc_ref.index_copy_(0, slots, qk[:, h:])
    vc_ref.index_copy_(0, slots, qkv[:, (h + kvh) * d:].view(t, kvh, d))
    exact = dict(rtol=0, atol=0) if norm is None else TOL  # RoPE alone is bit for bit
    torch.testing.assert_close(q, qk[:, :h], **exact)
    torch.testing.assert_close(kc, kc_ref, **exact)
    assert torch.equal(vc, vc_ref)


def test_rope_store_refuses_bad_inputs():
    cos, sin = rope_tables(8, 16)
    kc = torch.zeros(4, 1, 16)
    qkv = torch.randn(1, 3 * 16)
    with pytest.raises(RuntimeError, match="slot 4 outside"):
        OPS.rope_store(qkv, cos, sin, torch.tensor([0]), kc, kc.clone(), torch.tensor([4]),
                       1, 1, None, 1e-6)
    with pytest.raises(RuntimeError, match="position 8 outside"):
        OPS.rope_store(qkv, cos, sin, torch.tensor([8]), kc, kc.clone(), torch.tensor([0]),
                       1, 1, None, 1e-6)
    with pytest.raises(RuntimeError, match="expected"):
        OPS.rope_store(qkv, cos, sin, torch.tensor([0]), kc, kc.clone(), torch.tensor([0]),
                       2, 1, None, 1e-6)


@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("f", [1536, 13])
def test_silu_mul(t, f):
    torch.manual_seed(t + f)
    gu = torch.randn(t, 2 * f) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(OPS.silu_mul(gu), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_ops_refuse_other_dtypes():
    with pytest.raises(RuntimeError, match="float32"):
        OPS.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="even"):
        OPS.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("m", [1, 7, 100, 333])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_decode_attention(m, heads):
    h, kvh = heads
    d, s, start = 64, 400, 17
    torch.manual_seed(m + h)
    q = torch.randn(h, d) * 2
    kc, vc = torch.randn(s, kvh, d), torch.randn(s, kvh, d)
    o = OPS.decode_attention(q, kc, vc, start, m, 1 / math.sqrt(d))
    k = kc[start:start + m].double().repeat_interleave(h // kvh, dim=1)  # [M, H, D]
    v = vc[start:start + m].double().repeat_interleave(h // kvh, dim=1)
    p = torch.softmax(torch.einsum("hd,mhd->hm", q.double(), k) / math.sqrt(d), dim=-1)
    ref = torch.einsum("hm,mhd->hd", p, v).float()
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=2e-6)
    with pytest.raises(RuntimeError, match="outside the cache"):
        OPS.decode_attention(q, kc, vc, s - 1, 2, 0.125)


def test_paged_attention_uses_the_op_only_for_an_unmasked_span():
    torch.manual_seed(0)
    h, kvh, d, m = 6, 2, 16, 20
    kc, vc = torch.randn(64, kvh, d), torch.randn(64, kvh, d)
    q = torch.randn(1, h, d)
    gather = torch.arange(10, 10 + m).view(1, m)
    span = AttentionBatch(torch.tensor([10 + m - 1]), DecodeGroup(1, gather, None, span=10), ())
    ref = paged_attention(q, kc, vc, span, 0.25)
    torch.testing.assert_close(paged_attention(q, kc, vc, span, 0.25, OPS), ref, **TOL)
    # a decode token beside a prefill chunk: the op's output lands in row 0
    chunk = PrefillChunk(1, 3, torch.arange(40, 43), None)
    q2 = torch.randn(4, h, d)
    mixed = AttentionBatch(torch.tensor([29, 40, 41, 42]),
                           DecodeGroup(1, gather, None, span=10), (chunk,))
    torch.testing.assert_close(paged_attention(q2, kc, vc, mixed, 0.25, OPS),
                               paged_attention(q2, kc, vc, mixed, 0.25), **TOL)


# ---- LlamaModel: fused ops vs the torch path ----

def tiny_config(kind: str) -> ModelConfig:
    qwen3 = kind == "qwen3"
    return ModelConfig(
        architecture="Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM",
        model_type=kind, vocab_size=97, hidden_size=72, intermediate_size=88,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=16 if qwen3 else 12, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=not qwen3,
        attention_bias=kind == "qwen2", qk_norm=qwen3)


def tiny_tensors(c: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return torch.rand(n, generator=g) + 0.5

    hd, qd, kd = c.hidden_size, c.num_attention_heads * c.head_dim, \
        c.num_key_value_heads * c.head_dim
    t = {"model.embed_tokens.weight": rnd(c.vocab_size, hd, scale=1.0),
         "model.norm.weight": norm(hd)}
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = rnd(c.vocab_size, hd)
    for i in range(c.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        t |= {p + "input_layernorm.weight": norm(hd),
              p + "post_attention_layernorm.weight": norm(hd),
              a + "q_proj.weight": rnd(qd, hd), a + "k_proj.weight": rnd(kd, hd),
              a + "v_proj.weight": rnd(kd, hd), a + "o_proj.weight": rnd(hd, qd),
              p + "mlp.gate_proj.weight": rnd(c.intermediate_size, hd),
              p + "mlp.up_proj.weight": rnd(c.intermediate_size, hd),
              p + "mlp.down_proj.weight": rnd(hd, c.intermediate_size)}
        if c.attention_bias:
            t |= {a + "q_proj.bias": rnd(qd), a + "k_proj.bias": rnd(kd),
                  a + "v_proj.bias": rnd(kd)}
        if c.qk_norm:
            t |= {a + "q_norm.weight": norm(c.head_dim), a + "k_norm.weight": norm(c.head_dim)}
    return t


def new_cache(c: ModelConfig, slots: int = 128):
    shape = (c.num_hidden_layers, slots, c.num_key_value_heads, c.head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    return SimpleNamespace(k=k, v=v, k_layers=k.unbind(0), v_layers=v.unbind(0))


def generate(model: LlamaModel, kv, prompt: list[int], n: int, *, span: bool):
    """Prefill `prompt` at slots 0.., then n greedy decode steps (span view or gather);
    returns (tokens, every step's logits)."""
    t = len(prompt)
    slots = torch.arange(t)
    batch = AttentionBatch(slots, None, (PrefillChunk(0, t, slots, None),))
    logits = [model.logits(model.forward(torch.tensor(prompt), torch.arange(t), batch, kv))]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(n):
        pos = t + len(tokens) - 1
        dec = DecodeGroup(1, torch.arange(pos + 1).view(1, -1), None,
                          span=0 if span else None)
        batch = AttentionBatch(torch.tensor([pos]), dec, ())
        logits.append(model.logits(model.forward(torch.tensor(tokens[-1:]),
                                                 torch.tensor([pos]), batch, kv)))
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, logits


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("span", [True, False])
def test_forward_fused_equals_torch_path(kind, span):
    c = tiny_config(kind)
    tensors = tiny_tensors(c)
    fused = LlamaModel(c, tensors, max_positions=128)
    torch_path = LlamaModel(c, tensors, max_positions=128, fused=False)
    assert fused.fused_ops is OPS and torch_path.fused_ops is None
    prompt = [(7 * i + 3) % c.vocab_size for i in range(21)]
    kv_a, kv_b = new_cache(c), new_cache(c)
    toks_a, logits_a = generate(fused, kv_a, prompt, 12, span=span)
    toks_b, logits_b = generate(torch_path, kv_b, prompt, 12, span=span)
    assert toks_a == toks_b
    for a, b in zip(logits_a, logits_b):  # within 1e-5 of the logits' scale (~1.5e-6 seen)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    torch.testing.assert_close(kv_a.k, kv_b.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_a.v, kv_b.v, rtol=1e-5, atol=1e-5)


def test_forward_mixed_step_fused_equals_torch_path():
    """A decode token and a prefill chunk of another sequence in one step."""
    c = tiny_config("qwen3")
    tensors = tiny_tensors(c, seed=1)
    models = [LlamaModel(c, tensors, 128), LlamaModel(c, tensors, 128, fused=False)]
    outs = []
    for model in models:
        kv = new_cache(c)
        prompt = list(range(1, 11))
        slots = torch.arange(10)
        model.forward(torch.tensor(prompt), torch.arange(10),
                      AttentionBatch(slots, None, (PrefillChunk(0, 10, slots, None),)), kv)
        chunk_slots = torch.arange(64, 70)
        dec = DecodeGroup(1, torch.arange(11).view(1, -1), None, span=0)
        batch = AttentionBatch(torch.cat([torch.tensor([10]), chunk_slots]), dec,
                               (PrefillChunk(1, 6, chunk_slots, None),))
        ids = torch.tensor([5, 20, 21, 22, 23, 24, 25])
        pos = torch.tensor([10, 0, 1, 2, 3, 4, 5])
        outs.append(model.logits(model.forward(ids, pos, batch, kv)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5,
                               atol=1e-5 * float(outs[1].abs().max()))


def test_env_var_and_argument_force_the_torch_path(monkeypatch):
    c = tiny_config("llama")
    tensors = tiny_tensors(c)
    monkeypatch.setenv("FLARE_FUSED_OPS", "0")
    assert LlamaModel(c, tensors, 64).fused_ops is None
    with pytest.raises(ValueError, match="fused=True"):
        LlamaModel(c, tensors, 64, fused=True)
    monkeypatch.delenv("FLARE_FUSED_OPS")
    assert LlamaModel(c, tensors, 64, fused=True).fused_ops is OPS
    half = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    assert LlamaModel(c, half, 64).fused_ops is None  # bfloat16 serving: the torch path


def test_model_falls_back_to_torch_without_the_kernel(monkeypatch):
    import flare.kernels

    def unavailable():
        raise flare.kernels.KernelUnavailable("no C++ compiler")

    monkeypatch.setattr(flare.kernels, "qgemm", unavailable)
    c = tiny_config("llama")
    assert LlamaModel(c, tiny_tensors(c), 64).fused_ops is None


@needs_ops
@pytest.mark.parametrize("heads", [(4, 2), (9, 3)])
def test_decode_attention_gather_equals_masked_sdpa(heads):
    """B sequences of different lengths on scattered cache slots: each row equals SDPA over
    its own gathered keys (what the torch path computes with the padding mask)."""
    h, kvh = heads
    d, s = 64, 96
    torch.manual_seed(h)
    kc, vc = torch.randn(s, kvh, d), torch.randn(s, kvh, d)
    lengths = torch.tensor([5, 17, 1, 40])
    m = int(lengths.max())
    gather = torch.stack([torch.randperm(s)[:m] for _ in lengths])  # scattered slots
    q = torch.randn(len(lengths), h, d)
    o = OPS.decode_attention_gather(q, kc, vc, gather, lengths, 1 / math.sqrt(d))
    for b, n in enumerate(lengths.tolist()):
        k = kc[gather[b, :n]].transpose(0, 1)  # [KVH, n, D]
        v = vc[gather[b, :n]].transpose(0, 1)
        ref = F.scaled_dot_product_attention(
            q[b].unsqueeze(1), k.repeat_interleave(h // kvh, 0),
            v.repeat_interleave(h // kvh, 0)).squeeze(1)
        torch.testing.assert_close(o[b], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside the cache"):
        bad = gather.clone()
        bad[1, 3] = s
        OPS.decode_attention_gather(q, kc, vc, bad, lengths, 0.125)
    with pytest.raises(RuntimeError, match="lengths"):
        OPS.decode_attention_gather(q, kc, vc, gather, torch.tensor([5, 17, 0, 40]), 0.125)


@needs_ops
def test_decode_attention_non_finite_scores_give_nan_and_bad_arguments_raise():
    kc, vc = torch.randn(16, 2, 64), torch.randn(16, 2, 64)
    q = torch.randn(2, 4, 64)
    q[1, 0, 3] = float("nan")
    o = OPS.decode_attention_gather(q, kc, vc, torch.arange(16).repeat(2, 1),
                                    torch.tensor([16, 16]), 0.125)
    assert bool(o[1, 0].isnan().all())  # the one query head with the NaN
    assert bool(o[0].isfinite().all()) and bool(o[1, 1:].isfinite().all())
    with pytest.raises(RuntimeError, match="outside the cache"):
        OPS.decode_attention(q[0].contiguous(), kc, vc, 2 ** 63 - 1, 1, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KVH"):
        OPS.decode_attention(q[0].contiguous(), torch.randn(16, 0, 64), torch.randn(16, 0, 64),
                             0, 4, 0.125)
