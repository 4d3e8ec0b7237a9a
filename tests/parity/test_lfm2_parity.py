"""Parity of recipe `lfm2` (gated short convolutions + GQA attention) against transformers'
`Lfm2ForCausalLM` on a tiny random config saved with `save_pretrained`, in fp32.

Layers (conv, attention, conv, conv, attention) put KV layers at model layers 1 and 4;
the conv has biases and norms are randomised, so a dropped bias or swapped norm shows.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flare.models import lfm2
from flare.models.lfm2 import Lfm2Config, Lfm2Model, expected_tensor_names, state_layout
from hybrid_driver import HybridParityChecks, build_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_checkpoint):
    """(folder, transformers model, our model, prompts as token ids); the model is
    `hybrid_models.save_tiny_lfm2` (seed 2, layers conv, attention, conv, conv, attention)."""
    folder = tmp_path_factory.mktemp("tiny-lfm2") / "tiny-lfm2"
    return build_tiny("lfm2", Lfm2Model, folder, embedded_checkpoint.tokenizer)


class TestTinyLfm2(HybridParityChecks):
    """Greedy tokens vs transformers, chunked/decode/batched/forked runs vs one-shot."""

    label, recipe, model_cls = "tiny-lfm2", lfm2, Lfm2Model


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
