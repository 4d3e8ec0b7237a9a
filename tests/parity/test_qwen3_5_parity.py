"""Parity of recipe `qwen3_5` (Gated DeltaNet + gated full attention) against transformers'
`Qwen3_5ForCausalLM` on a tiny random config saved with `save_pretrained`, in fp32.

The layer pattern (linear, full, linear, linear, full) puts KV layers at model layers 1
and 4 (KV indices 0 and 1); value heads are twice the key heads (grouped); head dims of
keys and values differ; norms, gates and decays are randomised so a mix-up shows.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

from flare.models.qwen3_5 import (Qwen3_5Config, Qwen3_5Model, expected_tensor_names,
                                  gated_delta_chunked, gated_delta_step, state_layout,
                                  text_model_tensors)
from hybrid_driver import (CHUNK, PROMPTS, Runner, check_batched_equals_alone,
                           check_chunked_prefill_equals_one_shot,
                           check_copied_slot_continues_identically,
                           check_decode_path_equals_prefill, check_greedy_equals_transformers)

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
               "full_attention"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_checkpoint):
    """(folder, transformers model, our model, prompts as token ids)."""
    torch.manual_seed(35)
    cfg = Qwen3_5TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
        layer_types=LAYER_TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)  # plain-scale gated norm
            elif name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)  # zero-centred norms: scale 1 + w
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.4).log())  # long memory
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
    folder = tmp_path_factory.mktemp("tiny-qwen3_5") / "tiny-qwen3_5"
    model.save_pretrained(folder)
    tok = embedded_checkpoint.tokenizer
    tok.save_pretrained(folder)
    hf_config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    ours = Qwen3_5Model.from_hf(hf_config, tensors, max_positions=512)
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    return folder, model, ours, prompts


def _runner(tiny):
    ours = tiny[2]
    return lambda: Runner(ours, state_layout(ours.config, 16, torch.float32))


def test_config_and_tensor_names_match_the_saved_folder(tiny):
    folder, _, ours, _ = tiny
    c = ours.config
    assert c.full_attention_layers == (1, 4) and c.linear_attention_layers == (0, 2, 3)
    assert (c.rotary_dim, c.conv_dim) == (4, 2 * 2 * 16 + 4 * 8)
    assert set(load_file(str(folder / "model.safetensors"))) == expected_tensor_names(c)
    layout = state_layout(c, 16, torch.bfloat16)
    assert (layout.num_kv_layers, layout.kv_layers) == (2, (1, 4))
    spec = layout.layer_states[0]
    assert (spec.conv_shape, spec.conv_dtype) == ((96, 3), torch.bfloat16)
    assert (spec.recurrent_shape, spec.recurrent_dtype) == ((4, 16, 8), torch.float32)
    assert layout.state_bytes_per_slot == 3 * (96 * 3 * 2 + 4 * 16 * 8 * 4)


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


def test_gated_delta_chunked_equals_token_loop():
    torch.manual_seed(0)
    t, h, dk, dv = 150, 3, 8, 5  # several 64-token chunks and a ragged last one
    q = torch.nn.functional.normalize(torch.randn(t, h, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk), dim=-1)
    v = torch.randn(t, h, dv)
    g = -torch.rand(t, h) * 0.3
    beta = torch.rand(t, h)
    s0 = torch.randn(h, dk, dv)
    o_ref, s = torch.empty(t, h, dv), s0.unsqueeze(0)
    for i in range(t):
        o_i, s = gated_delta_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1],
                                  beta[i:i + 1], s)
        o_ref[i] = o_i[0]
    o, s_end = gated_delta_chunked(q, k, v, g, beta, s0)
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(s_end, s[0], atol=1e-5)


def test_tiny_qwen3_5_greedy_tokens_equal_transformers(tiny):
    check_greedy_equals_transformers(_runner(tiny), tiny[1], tiny[3], "tiny-qwen3_5")


def test_chunked_prefill_equals_one_shot(tiny):
    check_chunked_prefill_equals_one_shot(_runner(tiny), tiny[3][2], CHUNK, "tiny-qwen3_5")


def test_decode_path_equals_prefill_path(tiny):
    check_decode_path_equals_prefill(_runner(tiny), tiny[3][2][:40], "tiny-qwen3_5")


def test_batched_steps_equal_each_sequence_alone(tiny):
    check_batched_equals_alone(_runner(tiny), tiny[3], CHUNK, "tiny-qwen3_5")


def test_state_copied_to_another_slot_continues_identically(tiny):
    check_copied_slot_continues_identically(_runner(tiny), tiny[3][2], CHUNK, "tiny-qwen3_5")


def test_flare_loader_reads_the_folder(tiny):
    from flare.loading.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tiny[0])
    ours = Qwen3_5Model.from_hf(ckpt.hf_config, ckpt.tensors, max_positions=64)
    assert set(ckpt.tensors) == expected_tensor_names(ours.config)


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
