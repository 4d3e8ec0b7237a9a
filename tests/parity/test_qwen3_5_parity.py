"""Parity of recipe `qwen3_5` (Gated DeltaNet + gated full attention) against transformers'
`Qwen3_5ForCausalLM` on a tiny random config saved with `save_pretrained`, in fp32.

The layer pattern (linear, full, linear, linear, full) puts KV layers at model layers 1
and 4 (KV indices 0 and 1); value heads are twice the key heads (grouped); head dims of
keys and values differ; norms, gates and decays are randomised so a mix-up shows.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from flare.models import qwen3_5
from flare.models.gated_delta import gated_delta_rule, gated_delta_step
from flare.models.qwen3_5 import Qwen3_5Config, Qwen3_5Model, state_layout, text_model_tensors
from hybrid_driver import HybridParityChecks, Runner, tiny_fixture


# `hybrid_models.save_tiny_qwen3_5`: seed 35, layers linear, full, linear, linear, full
tiny = tiny_fixture("qwen3_5", Qwen3_5Model)


class TestTinyQwen3_5(HybridParityChecks):
    """Greedy tokens vs transformers, chunked/decode/batched/forked runs vs one-shot."""

    label, recipe, model_cls, kv_layers = "tiny-qwen3_5", qwen3_5, Qwen3_5Model, (1, 4)


def test_config_and_state_layout(tiny):
    c = tiny[2].config
    assert c.full_attention_layers == (1, 4) and c.linear_attention_layers == (0, 2, 3)
    assert (c.rotary_dim, c.conv_dim) == (4, 2 * 2 * 16 + 4 * 8)
    spec = state_layout(c, 16, torch.bfloat16).layer_states[0]
    assert (spec.conv_shape, spec.conv_dtype) == ((96, 3), torch.bfloat16)
    assert (spec.recurrent_shape, spec.recurrent_dtype) == ((4, 16, 8), torch.float32)
    assert state_layout(c, 16, torch.bfloat16).state_bytes_per_slot == (
        3 * (96 * 3 * 2 + 4 * 16 * 8 * 4))


def test_multimodal_checkpoint_names_map_to_the_text_model():
    t = torch.zeros(1)
    names = text_model_tensors({"model.language_model.layers.0.mlp.up_proj.weight": t,
                                "model.visual.blocks.0.attn.qkv.weight": t,
                                "mtp.fc.weight": t, "lm_head.weight": t})
    assert set(names) == {"model.layers.0.mlp.up_proj.weight", "lm_head.weight"}
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": True,
              "text_config": {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                              "num_hidden_layers": 4, "num_attention_heads": 2,
                              "head_dim": 4, "linear_key_head_dim": 4,
                              "linear_value_head_dim": 4, "linear_num_key_heads": 1,
                              "linear_num_value_heads": 2,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                  "partial_rotary_factor": 0.25,
                                                  "mrope_section": [11, 11, 10],
                                                  "mrope_interleaved": True}}}
    c = Qwen3_5Config.from_hf(nested)
    assert c.tie_word_embeddings and c.rope_theta == 1e7
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_gated_delta_rule_equals_token_loop():
    """Two sequences' runs (150 and 3 tokens) from their slots: the torch fallback is the
    step loop bit for bit; the kernel (where it builds) within float32 rounding."""
    from flare.kernels import fused_ops

    torch.manual_seed(0)
    t, hq, h, dk, dv = 153, 3, 6, 8, 5  # each q/k head serves two value heads
    q = torch.nn.functional.normalize(torch.randn(t, hq, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hq, dk), dim=-1)
    v = torch.randn(t, h, dv)
    g = -torch.rand(t, h) * 0.3
    beta = torch.rand(t, h)
    pool = torch.randn(4, h, dk, dv)
    starts, slots = torch.tensor([0, 150, 153]), torch.tensor([2, 0])
    o_ref, s_ref = torch.empty(t, h, dv), pool.clone()
    for n, slot in enumerate(slots.tolist()):
        s = pool[slot:slot + 1]
        for i in range(int(starts[n]), int(starts[n + 1])):
            o_i, s = gated_delta_step(q[i:i + 1].repeat_interleave(2, 1),
                                      k[i:i + 1].repeat_interleave(2, 1), v[i:i + 1],
                                      g[i:i + 1], beta[i:i + 1], s)
            o_ref[i] = o_i[0]
        s_ref[slot] = s[0]
    state = pool.clone()
    o = gated_delta_rule(q, k, v, g, beta, state, starts, slots)
    assert torch.equal(o, o_ref) and torch.equal(state, s_ref)
    ops = fused_ops()
    if ops is not None:
        state = pool.clone()
        o = gated_delta_rule(q, k, v, g, beta, state, starts, slots, ops)
        assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(state, s_ref, atol=1e-5)
        assert torch.equal(state[[1, 3]], pool[[1, 3]])  # slots not named are untouched


def test_flare_loader_reads_a_multimodal_folder(tiny, tmp_path):
    """A Qwen3.5 hub folder (`Qwen3_5ForConditionalGeneration`: config nested under
    `text_config`, text weights under `model.language_model.*`, a vision tower and an MTP
    head beside them) loads as the text model: same tensors, same logits."""
    import shutil

    from safetensors.torch import save_file

    from flare.loading.checkpoint import load_checkpoint

    folder, _, ours, prompts = tiny
    mm = tmp_path / "tiny-qwen3_5-mm"
    shutil.copytree(folder, mm)
    text = json.loads((folder / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "tie_word_embeddings": False, "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 8}}))
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k:
               v for k, v in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(renamed, str(mm / "model.safetensors"))
    ckpt = load_checkpoint(mm)
    assert set(ckpt.tensors) == set(tensors)
    assert ckpt.config.architecture == "Qwen3_5ForConditionalGeneration"
    assert (ckpt.config.vocab_size, ckpt.config.hidden_size) == (49152, 64)
    model = Qwen3_5Model.from_hf(ckpt.hf_config, ckpt.tensors, max_positions=64)
    assert model.config.layer_types == ours.config.layer_types
    runner = Runner(model, state_layout(model.config, 16, torch.float32))
    ref = Runner(ours, state_layout(ours.config, 16, torch.float32))
    a, b = runner.new_seq(prompts[0]), ref.new_seq(prompts[0])
    assert torch.equal(runner.prefill(a), ref.prefill(b))
