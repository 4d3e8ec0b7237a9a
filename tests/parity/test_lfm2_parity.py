"""Parity of recipe `lfm2` (gated short convolutions + GQA attention) against transformers'
`Lfm2ForCausalLM` on a tiny random config saved with `save_pretrained`, in fp32.

Layers (conv, attention, conv, conv, attention) put KV layers at model layers 1 and 4;
the conv has biases and norms are randomised, so a dropped bias or swapped norm shows.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Lfm2Config as HfLfm2Config

from flare.models.lfm2 import Lfm2Config, Lfm2Model, expected_tensor_names, state_layout
from hybrid_driver import (CHUNK, PROMPTS, Runner, check_batched_equals_alone,
                           check_chunked_prefill_equals_one_shot,
                           check_copied_slot_continues_identically,
                           check_decode_path_equals_prefill, check_greedy_equals_transformers)

LAYER_TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_checkpoint):
    """(folder, transformers model, our model, prompts as token ids)."""
    torch.manual_seed(2)
    cfg = HfLfm2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        layer_types=LAYER_TYPES, num_attention_heads=4, num_key_value_heads=2,
        conv_L_cache=3, conv_bias=True, block_multiple_of=32, norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    folder = tmp_path_factory.mktemp("tiny-lfm2") / "tiny-lfm2"
    model.save_pretrained(folder)
    tok = embedded_checkpoint.tokenizer
    tok.save_pretrained(folder)
    hf_config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    ours = Lfm2Model.from_hf(hf_config, tensors, max_positions=512)
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    return folder, model, ours, prompts


def _runner(tiny):
    ours = tiny[2]
    return lambda: Runner(ours, state_layout(ours.config, 16, torch.float32))


def test_config_and_tensor_names_match_the_saved_folder(tiny):
    folder, model, ours, _ = tiny
    c = ours.config
    assert c.attention_layers == (1, 4) and c.conv_layers == (0, 2, 3)
    assert c.ff_dim == model.model.layers[0].feed_forward.w1.out_features == 64
    assert set(load_file(str(folder / "model.safetensors"))) == expected_tensor_names(c)
    layout = state_layout(c, 16, torch.bfloat16)
    assert (layout.num_kv_layers, layout.kv_layers, layout.head_dim) == (2, (1, 4), 16)
    assert [s.conv_shape for s in layout.layer_states] == [(64, 2)] * 3
    assert all(not s.recurrent_shape for s in layout.layer_states)
    assert layout.state_bytes_per_slot == 3 * 64 * 2 * 2


def test_original_release_config_keys():
    c = Lfm2Config.from_hf({"architectures": ["Lfm2ForCausalLM"], "vocab_size": 65536,
                            "hidden_size": 2048, "block_ff_dim": 12288,
                            "num_hidden_layers": 4, "num_attention_heads": 32,
                            "num_key_value_heads": 8, "full_attn_idxs": [2],
                            "tie_embedding": True, "rope_theta": 1e6, "conv_L_cache": 3})
    assert c.layer_types == ("conv", "conv", "full_attention", "conv")
    assert c.ff_dim == 8192 and c.tie_word_embeddings and c.head_dim == 64


def test_tiny_lfm2_greedy_tokens_equal_transformers(tiny):
    check_greedy_equals_transformers(_runner(tiny), tiny[1], tiny[3], "tiny-lfm2")


def test_chunked_prefill_equals_one_shot(tiny):
    check_chunked_prefill_equals_one_shot(_runner(tiny), tiny[3][2], CHUNK, "tiny-lfm2")


def test_decode_path_equals_prefill_path(tiny):
    check_decode_path_equals_prefill(_runner(tiny), tiny[3][2][:40], "tiny-lfm2")


def test_batched_steps_equal_each_sequence_alone(tiny):
    check_batched_equals_alone(_runner(tiny), tiny[3], CHUNK, "tiny-lfm2")


def test_state_copied_to_another_slot_continues_identically(tiny):
    check_copied_slot_continues_identically(_runner(tiny), tiny[3][2], CHUNK, "tiny-lfm2")


def test_flare_loader_reads_the_folder(tiny):
    from flare.loading.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tiny[0])
    ours = Lfm2Model.from_hf(ckpt.hf_config, ckpt.tensors, max_positions=64)
    assert set(ckpt.tensors) == expected_tensor_names(ours.config)
