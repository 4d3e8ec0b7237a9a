"""Tiny random hybrid checkpoints for engine tests: a Qwen3.5 (Gated DeltaNet + gated
attention) and an LFM2 (short conv + attention), built by transformers, saved with
`save_pretrained` together with the embedded model's tokenizer (a real 49,152 vocabulary),
so they load through flare's loader like a downloaded folder.

Layer patterns put the KV layers at model layers 1 and 4, the recurrent/conv layers at 0,
2 and 3; norms, gates, decays and conv biases are randomised so a mix-up shows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

RECIPES = ("qwen3_5", "lfm2")
PAGE = 16


def save_tiny_qwen3_5(folder: Path, tokenizer, seed: int = 35):
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)  # zero-centred norms: scale 1 + w
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.4).log())  # long memory
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def save_tiny_lfm2(folder: Path, tokenizer, seed: int = 2):
    from transformers import AutoModelForCausalLM, Lfm2Config

    torch.manual_seed(seed)
    cfg = Lfm2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, conv_bias=True,
        block_multiple_of=32, norm_eps=1e-5, max_position_embeddings=4096,
        tie_word_embeddings=True, initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


BUILDERS = {"qwen3_5": save_tiny_qwen3_5, "lfm2": save_tiny_lfm2}


@dataclass
class TinyHybrid:
    recipe: str
    folder: Path
    hf_model: Any
    package_path: Path
    package: Any  # LoadedPackage
    extra: dict[str, Any] = field(default_factory=dict)


def build_tiny_hybrid(recipe: str, root: Path, tokenizer, **plan_kw) -> TinyHybrid:
    """Save the tiny `recipe` model, prepare it into a package (fp32) and load it."""
    from flare.prepare.package import load_package, prepare_package

    folder = root / f"tiny-{recipe}"
    model = BUILDERS[recipe](folder, tokenizer)
    kw = {"max_seq_len": 512, "max_num_seqs": 4, "page_size": PAGE, "max_batch_tokens": 128,
          **plan_kw}
    out = root / f"pkg-{recipe}"
    prepare_package(folder, out, progress=False, **kw)
    return TinyHybrid(recipe, folder, model, out, load_package(out))


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy `generate` of exactly `n` tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()
