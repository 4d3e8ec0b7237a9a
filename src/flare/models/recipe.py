"""The recipe interface: how one architecture family turns a config into state and a forward.

A recipe declares its *state layout* (what per-sequence state the forward reads and writes)
so that planning, pools and reuse treat KV-only and hybrid models through the same code.
"""

from __future__ import annotations

from typing import Any

import torch

from flare.models.config import ModelConfig
from flare.state.layout import StateLayout


# Hybrid recipes: conv / recurrent state slots besides KV pages.
HYBRID_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # real Qwen3.5 folders: text model only
    "Lfm2ForCausalLM": "lfm2",
    "Qwen3NextForCausalLM": "qwen3_next",
}
HYBRID_RECIPE_VERSIONS = {"qwen3_5": 1, "lfm2": 1, "qwen3_next": 1}

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    **HYBRID_ARCHITECTURES,
}
RECIPE_VERSIONS = {"llama": 1, **HYBRID_RECIPE_VERSIONS}


def recipe_for(config: ModelConfig) -> str:
    """Name of the recipe that runs `config`.

    Raises:
        ValueError: the architecture has no recipe, naming it and the supported ones.
    """
    try:
        return SUPPORTED_ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(
            f"architecture {config.architecture!r} has no recipe; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        ) from None


def is_hybrid_recipe(recipe: str) -> bool:
    return recipe in HYBRID_RECIPE_VERSIONS


def _hf_dict(config: ModelConfig) -> dict[str, Any]:
    """The original `config.json` dict a hybrid recipe reads its own config from."""
    if config.hf is None:
        raise ValueError(f"{config.architecture}: the model config carries no original "
                         f"config dict (build it with ModelConfig.from_hf)")
    return config.hf


def recipe_config(config: ModelConfig) -> Any:
    """The recipe's own config object: `config` itself for `llama`, a `Qwen3_5Config` /
    `Lfm2Config` / `Qwen3NextConfig` read from the original dict for the hybrids.

    Raises:
        ValueError: no recipe, or a config the recipe cannot read (named).
    """
    recipe = recipe_for(config)
    if recipe == "qwen3_5":
        from flare.models.qwen3_5 import Qwen3_5Config
        return Qwen3_5Config.from_hf(_hf_dict(config))
    if recipe == "lfm2":
        from flare.models.lfm2 import Lfm2Config
        return Lfm2Config.from_hf(_hf_dict(config))
    if recipe == "qwen3_next":
        from flare.models.qwen3_next import Qwen3NextConfig
        return Qwen3NextConfig.from_hf(_hf_dict(config))
    return config


def model_state_layout(config: ModelConfig, page_size: int, dtype: torch.dtype) -> StateLayout:
    """The state layout of whatever recipe runs `config` (KV-only or hybrid)."""
    recipe = recipe_for(config)
    if is_hybrid_recipe(recipe):
        return hybrid_state_layout(recipe, _hf_dict(config), page_size, dtype)
    return state_layout(config, page_size, dtype)


def build_model(config: ModelConfig, tensors: dict[str, torch.Tensor],
                max_positions: int) -> Any:
    """The model object of the recipe that runs `config`: `LlamaModel`, `Qwen3_5Model`,
    `Lfm2Model` or `Qwen3NextModel`. Dense models' `forward(ids, positions, batch, kv)`;
    hybrid models' `forward(ids, positions, batch, kv, states)` (see
    `StateLayout.is_hybrid`).

    Raises:
        ValueError: no recipe, an unreadable config, or a missing tensor (named).
    """
    recipe = recipe_for(config)
    if recipe == "qwen3_5":
        from flare.models.qwen3_5 import Qwen3_5Model, text_model_tensors
        return Qwen3_5Model(recipe_config(config), text_model_tensors(tensors), max_positions)
    if recipe == "lfm2":
        from flare.models.lfm2 import Lfm2Model
        return Lfm2Model(recipe_config(config), tensors, max_positions)
    if recipe == "qwen3_next":
        from flare.models.qwen3_5 import text_model_tensors
        from flare.models.qwen3_next import Qwen3NextModel
        return Qwen3NextModel(recipe_config(config), text_model_tensors(tensors), max_positions)
    from flare.models.llama import LlamaModel
    return LlamaModel(config, tensors, max_positions)


def expected_tensor_names(config: ModelConfig) -> set[str]:
    """Tensor names (Hugging Face naming, after the recipe's renames) a checkpoint of
    `config` must hold, for whichever recipe runs it."""
    recipe = recipe_for(config)
    if recipe == "qwen3_5":
        from flare.models.qwen3_5 import expected_tensor_names as names
        return names(recipe_config(config))
    if recipe == "lfm2":
        from flare.models.lfm2 import expected_tensor_names as names
        return names(recipe_config(config))
    if recipe == "qwen3_next":
        from flare.models.qwen3_next import expected_tensor_names as names
        return names(recipe_config(config))
    return dense_tensor_names(config)


def dense_tensor_names(config: ModelConfig) -> set[str]:
    """Hugging Face tensor names a dense Llama-family model of `config` must have."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{n}_proj.weight" for n in "qkvo"}
        names |= {f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        if config.attention_bias:
            names |= {f"{p}self_attn.{n}_proj.bias" for n in "qkv"}
        if config.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


def prepare_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """The recipe's renames of a folder's tensors (Qwen3.5's multimodal folders keep the
    text model under `model.language_model.*`, beside a vision tower and an MTP head that
    the text model does not use; Qwen3-Next folders carry such an MTP head too); other
    recipes' tensors pass unchanged."""
    if recipe_for(config) in ("qwen3_5", "qwen3_next"):
        from flare.models.qwen3_5 import text_model_tensors
        return text_model_tensors(tensors)
    return tensors


def state_layout(config: ModelConfig, page_size: int, dtype: torch.dtype) -> StateLayout:
    """The state layout of a dense recipe: every layer keeps KV pages."""
    return StateLayout(
        num_kv_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        page_size=page_size,
        dtype=dtype,
    )


def hybrid_state_layout(recipe: str, hf_config: dict[str, Any], page_size: int,
                        dtype: torch.dtype) -> StateLayout:
    """The state layout of a hybrid recipe, from the model's `config.json` dict.

    Args:
        recipe: "qwen3_5", "lfm2" or "qwen3_next" (a value of `HYBRID_ARCHITECTURES`).
        hf_config: the transformers config dict (`Checkpoint.hf_config`).
        page_size: tokens per KV page; dtype: serving dtype (KV pool and conv states;
            recurrent states are float32 whatever the serving dtype).

    Raises:
        ValueError: an unknown recipe, or a config the recipe cannot read (named).
    """
    if recipe == "qwen3_5":
        from flare.models.qwen3_5 import Qwen3_5Config, state_layout as layout
        return layout(Qwen3_5Config.from_hf(hf_config), page_size, dtype)
    if recipe == "lfm2":
        from flare.models.lfm2 import Lfm2Config, state_layout as layout
        return layout(Lfm2Config.from_hf(hf_config), page_size, dtype)
    if recipe == "qwen3_next":
        from flare.models.qwen3_next import Qwen3NextConfig, state_layout as layout
        return layout(Qwen3NextConfig.from_hf(hf_config), page_size, dtype)
    raise ValueError(f"recipe {recipe!r} is not a hybrid recipe; "
                     f"hybrid: {sorted(HYBRID_RECIPE_VERSIONS)}")
