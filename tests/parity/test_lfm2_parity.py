"""Parity of recipe `lfm2` (gated short convolutions + GQA attention) against transformers'
`Lfm2ForCausalLM` on a tiny random config saved with `save_pretrained`, in fp32.

Layers (conv, attention, conv, conv, attention) put KV layers at model layers 1 and 4;
the conv has biases and norms are randomised, so a dropped bias or swapped norm shows.
"""

from __future__ import annotations

import torch

from flare.models import lfm2
from flare.models.lfm2 import Lfm2Config, Lfm2Model, state_layout
from hybrid_driver import HybridParityChecks, tiny_fixture


# `hybrid_models.save_tiny_lfm2`: seed 2, layers conv, attention, conv, conv, attention
tiny = tiny_fixture("lfm2", Lfm2Model)


class TestTinyLfm2(HybridParityChecks):
    """Greedy tokens vs transformers, chunked/decode/batched/forked runs vs one-shot."""

    label, recipe, model_cls, kv_layers = "tiny-lfm2", lfm2, Lfm2Model, (1, 4)


def test_config_and_state_layout(tiny):
    _, model, ours, _ = tiny
    c = ours.config
    assert c.attention_layers == (1, 4) and c.conv_layers == (0, 2, 3)
    assert c.ff_dim == model.model.layers[0].feed_forward.w1.out_features == 64
    layout = state_layout(c, 16, torch.bfloat16)
    assert layout.head_dim == 16
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
