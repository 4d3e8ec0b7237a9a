"""Parity of recipe `qwen3_next` (Qwen3.5's Gated DeltaNet + gated attention, with a sparse
MoE MLP) against transformers' `Qwen3NextForCausalLM` on a tiny random config saved with
`save_pretrained`, in fp32.

The tiny model (`hybrid_models.save_tiny_qwen3_next`) has Qwen3.5's tiny layer pattern
(linear, full, linear, linear, full: KV layers at 1 and 4), value heads twice the key heads
(so the per-key-head grouping of `in_proj_qkvz` / `in_proj_ba` matters), 4 experts with 2
per token plus a shared expert on every layer but layer 2, which keeps a dense MLP.
"""

from __future__ import annotations

import torch

from flare.models import qwen3_next
from flare.models.qwen3_next import (Qwen3NextConfig, Qwen3NextModel, SparseMoE,
                                     load_in_proj, state_layout)
from flare.models.recipe import HYBRID_ARCHITECTURES, recipe_for
from hybrid_driver import HybridParityChecks, tiny_fixture


tiny = tiny_fixture("qwen3_next", Qwen3NextModel)


class TestTinyQwen3Next(HybridParityChecks):
    """Greedy tokens vs transformers, chunked/decode/batched/forked runs vs one-shot."""

    label, recipe, model_cls = "tiny-qwen3_next", qwen3_next, Qwen3NextModel
    kv_layers = (1, 4)


def test_config_and_state_layout(tiny):
    c = tiny[2].config
    assert isinstance(c, Qwen3NextConfig) and c.architecture == "Qwen3NextForCausalLM"
    assert c.full_attention_layers == (1, 4) and c.linear_attention_layers == (0, 2, 3)
    assert [c.is_sparse(i) for i in range(5)] == [True, True, False, True, True]
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size, c.norm_topk_prob) == (4, 2, 32, 48, True)
    assert state_layout(c, 16, torch.bfloat16).layer_states[0].recurrent_shape == (4, 16, 8)
    assert HYBRID_ARCHITECTURES["Qwen3NextForCausalLM"] == "qwen3_next"


def test_in_proj_regrouping_equals_transformers_ordering(tiny):
    """Our one projection, split as Qwen3.5 splits it, gives the q, k, v, z, b, a that
    transformers' `fix_query_key_value_ordering` derives from in_proj_qkvz / in_proj_ba."""
    _, hf, ours, _ = tiny
    net = hf.model.layers[0].linear_attn
    c = ours.config
    x = torch.randn(1, 6, c.hidden_size)
    with torch.no_grad():
        ref = net.fix_query_key_value_ordering(net.in_proj_qkvz(x), net.in_proj_ba(x))
        w = load_in_proj(net.in_proj_qkvz.weight, net.in_proj_ba.weight, c)
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        kd = c.linear_num_key_heads * c.linear_key_head_dim
        got = (x[0] @ w.T).split([kd, kd, hv * dv, hv * dv, hv, hv], dim=-1)
    for r, g in zip(ref, got):
        assert torch.allclose(r.reshape(6, -1), g, atol=1e-6)


def test_sparse_moe_equals_transformers_block(tiny):
    _, hf, ours, _ = tiny
    block = hf.model.layers[0].mlp
    moe = ours.blocks[0].mlp
    assert isinstance(moe, SparseMoE) and not isinstance(ours.blocks[2].mlp, SparseMoE)
    x = torch.randn(1, 40, ours.config.hidden_size)
    with torch.no_grad():
        ref = block(x)
        ref = ref[0] if isinstance(ref, tuple) else ref
    assert torch.allclose(moe(x[0]), ref[0], atol=1e-6)


def test_engine_serves_the_package(tiny, tmp_path, embedded_checkpoint):
    """The recipe is registered end to end: prepare_package, load_package and the engine's
    greedy tokens equal transformers'."""
    from flare.runtime.engine import Engine
    from flare.runtime.request import GenerationRequest, SamplingParams
    from hybrid_models import build_tiny_hybrid, hf_greedy

    h = build_tiny_hybrid("qwen3_next", tmp_path, embedded_checkpoint.tokenizer)
    assert h.package.manifest.recipe == "qwen3_next" == recipe_for(h.package.config)
    engine = Engine.from_package(h.package)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = tiny[3]
    outs = engine.run_until_idle([GenerationRequest(str(i), p, params)
                                  for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        got = sum((o.token_ids for o in outs[str(i)]), [])
        assert got == hf_greedy(h.hf_model, p, 12)
