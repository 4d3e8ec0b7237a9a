"""Random hybrid checkpoints for the tests and the bench: a Qwen3.5 (Gated DeltaNet + gated
attention), an LFM2 (short conv + attention) and a Qwen3-Next (Qwen3.5 with a sparse MoE
MLP), built by transformers, saved with `save_pretrained` together with the embedded
model's tokenizer (a real 49,152 vocabulary), so they load through flare's loader like a
downloaded folder. One config builder per recipe (`qwen3_5_config`, ...) serves the
parity tests, the engine tests and `bench/bench_hybrid.py`.

Tiny layer patterns put the KV layers at model layers 1 and 4, the recurrent/conv layers
at 0, 2 and 3; norms, gates, decays and conv biases are randomised so a mix-up shows.
`size="embedded"` builds Qwen3.5 / LFM2 of the embedded model's geometry (for figures)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

RECIPES = ("qwen3_5", "lfm2")
PAGE = 16


SIZES = ("tiny", "embedded")
# the embedded model's (SmolLM2-135M) geometry, for figures at a realistic size
EMBEDDED = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                intermediate_size=1536, tie_word_embeddings=True)
# LFM2's published 16-layer pattern (attention at 2, 5, 8, 10, 12, 14), tiled over 30 layers
LFM2_PATTERN = [i in (2, 5, 8, 10, 12, 14) for i in range(16)]


def qwen3_5_config(size: str = "tiny"):
    """transformers' `Qwen3_5TextConfig` of the tiny test model, or (`size="embedded"`) one
    of the embedded model's geometry with Qwen3.5's layout: every 4th layer full attention
    (7 of 30), DeltaNet with 3 key heads x 9 value heads of 64 channels.

    Raises:
        ValueError: an unknown size.
    """
    from transformers import Qwen3_5TextConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    common = dict(linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
                  initializer_range=0.05, rope_parameters=rope)
    if size == "tiny":
        return Qwen3_5TextConfig(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "linear_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, tie_word_embeddings=False, **common)
    if size == "embedded":
        n = EMBEDDED["num_hidden_layers"]
        return Qwen3_5TextConfig(
            **EMBEDDED, layer_types=["full_attention" if (i + 1) % 4 == 0
                                     else "linear_attention" for i in range(n)],
            linear_num_key_heads=3, linear_num_value_heads=9, linear_key_head_dim=64,
            linear_value_head_dim=64, **common)
    raise ValueError(f"unknown size {size!r}; sizes: {SIZES}")


def lfm2_config(size: str = "tiny"):
    """transformers' `Lfm2Config` of the tiny test model, or (`size="embedded"`) one of the
    embedded model's geometry with LFM2's conv/attention pattern (11 attention layers of 30)
    and an MLP width of exactly 1536.

    Raises:
        ValueError: an unknown size.
    """
    from transformers import Lfm2Config

    rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    common = dict(conv_L_cache=3, norm_eps=1e-5, max_position_embeddings=4096,
                  initializer_range=0.05, rope_parameters=rope)
    if size == "tiny":
        return Lfm2Config(
            vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
            layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2, conv_bias=True,
            block_multiple_of=32, tie_word_embeddings=True, **common)
    if size == "embedded":
        kw = {k: v for k, v in EMBEDDED.items() if k != "head_dim"}  # hidden / heads = 64
        return Lfm2Config(
            **kw, layer_types=["full_attention" if LFM2_PATTERN[i % 16] else "conv"
                               for i in range(EMBEDDED["num_hidden_layers"])],
            conv_bias=False, block_auto_adjust_ff_dim=False, **common)
    raise ValueError(f"unknown size {size!r}; sizes: {SIZES}")


def qwen3_next_config(size: str = "tiny"):
    """transformers' `Qwen3NextConfig`: the tiny Qwen3.5's geometry and layer pattern with
    Qwen3-Next's sparse MLP (4 experts, 2 per token, a shared expert) on every layer but
    layer 2 (`mlp_only_layers`, dense). Tiny only.

    Raises:
        ValueError: a size other than "tiny".
    """
    from transformers import Qwen3NextConfig

    if size != "tiny":
        raise ValueError(f"qwen3_next: only size 'tiny' is built, not {size!r}")
    q = qwen3_5_config("tiny").to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "layer_types", "num_attention_heads", "num_key_value_heads", "head_dim",
            "linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings", "initializer_range",
            "rope_parameters")
    return Qwen3NextConfig(**{k: q[k] for k in keep}, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48,
                           decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True)


def _random_model(cfg, seed: int, rules):
    """transformers' model of `cfg` (fp32, eval, seeded), then each parameter whose name
    ends with a rule's suffix re-drawn by the first such rule, in parameter order."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            for suffix, draw in rules:
                if name.endswith(suffix):
                    draw(p)
                    break
    return model


QWEN3_5_RULES = (
    ("linear_attn.norm.weight", lambda p: p.uniform_(0.5, 1.5)),  # plain-scale gated norm
    ("norm.weight", lambda p: p.uniform_(-0.5, 0.5)),  # zero-centred norms: scale 1 + w
    ("A_log", lambda p: p.copy_(torch.empty_like(p).uniform_(0.02, 0.4).log())),  # long memory
    ("dt_bias", lambda p: p.uniform_(-1.0, 1.0)),
)
QWEN3_NEXT_RULES = QWEN3_5_RULES + (
    # decisive routing and shared-expert gates: no near-ties between experts
    ("mlp.gate.weight", lambda p: p.normal_(0, 0.5)),
    ("shared_expert_gate.weight", lambda p: p.normal_(0, 0.5)),
)
LFM2_RULES = (
    ("norm.weight", lambda p: p.uniform_(0.5, 1.5)),
    ("bias", lambda p: p.normal_(0, 0.1)),
)


def _save(model, folder: Path, tokenizer):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def save_tiny_qwen3_5(folder: Path, tokenizer, seed: int = 35, size: str = "tiny"):
    """Save a random Qwen3.5 (`qwen3_5_config(size)`, norms, decays and gates randomised)
    and `tokenizer` into `folder`. Returns the transformers model (fp32, eval)."""
    return _save(_random_model(qwen3_5_config(size), seed, QWEN3_5_RULES), folder, tokenizer)


def save_tiny_lfm2(folder: Path, tokenizer, seed: int = 2, size: str = "tiny"):
    """Save a random LFM2 (`lfm2_config(size)`, norms and biases randomised) and
    `tokenizer` into `folder`. Returns the transformers model (fp32, eval)."""
    return _save(_random_model(lfm2_config(size), seed, LFM2_RULES), folder, tokenizer)


def save_tiny_qwen3_next(folder: Path, tokenizer, seed: int = 80, size: str = "tiny"):
    """Save a random Qwen3-Next (`qwen3_next_config(size)`, randomised like Qwen3.5's, plus
    routers and shared-expert gates) and `tokenizer` into `folder`. Returns the
    transformers model (fp32, eval)."""
    return _save(_random_model(qwen3_next_config(size), seed, QWEN3_NEXT_RULES), folder,
                 tokenizer)


# qwen3_next is built on demand (its parity test, the bench), not in RECIPES' suites
BUILDERS = {"qwen3_5": save_tiny_qwen3_5, "lfm2": save_tiny_lfm2,
            "qwen3_next": save_tiny_qwen3_next}


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
    from flare.prepare.package import prepare_package
    from flare.package.reader import load_package

    folder = root / f"tiny-{recipe}"
    model = BUILDERS[recipe](folder, tokenizer)
    kw = {"max_seq_len": 512, "max_num_seqs": 4, "page_size": PAGE, "max_batch_tokens": 128,
          **plan_kw}
    out = root / f"pkg-{recipe}"
    prepare_package(folder, out, progress=False, **kw)
    return TinyHybrid(recipe, folder, model, out, load_package(out))


def tiny_hybrid_fixture(tag: str, recipes: tuple[str, ...] = RECIPES, **plan_kw):
    """A module-scoped fixture over `recipes`: each one's tiny model prepared by
    `build_tiny_hybrid(..., **plan_kw)` with the embedded model's tokenizer, in a folder
    named `tag`-recipe; assign it to the fixture's name in a test module."""
    @pytest.fixture(scope="module", params=recipes)
    def tiny(request, tmp_path_factory, embedded_checkpoint) -> TinyHybrid:
        root = tmp_path_factory.mktemp(f"{tag}-{request.param}")
        return build_tiny_hybrid(request.param, root, embedded_checkpoint.tokenizer,
                                 **plan_kw)

    return tiny


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy `generate` of exactly `n` tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()
