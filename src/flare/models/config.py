"""The model hyper-parameters a recipe needs, read from a Hugging Face style config dict."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

# model types whose whole config `ModelConfig` holds (the dense `llama` recipe); any other
# model (a hybrid recipe reads its own config class) keeps its original config dict
DENSE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, in Hugging Face naming.

    Built from a `config.json` dict with `ModelConfig.from_hf`; written to the manifest
    as that dict again (`to_hf`), so a package is self-describing.

    For a hybrid recipe (Qwen3.5, LFM2) these fields are a summary that planning, the
    engine's request checks and the loader read (vocabulary, widths, context, EOS ids);
    the recipe builds its own config from `hf`, the original dict, which `to_hf` returns
    unchanged so that serve rebuilds exactly the model prepare loaded.
    """

    architecture: str  # e.g. "LlamaForCausalLM", "Qwen3ForCausalLM"
    model_type: str  # e.g. "llama", "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def is_dense(self) -> bool:
        """True for the model types the dense `llama` recipe reads from these fields."""
        return self.model_type in DENSE_MODEL_TYPES

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read a transformers `config.json` dict.

        Raises:
            ValueError: a required field is missing, naming it.
        """
        # multimodal folders (Qwen3.5) nest the text model's fields under `text_config`;
        # top-level fields (architectures, tie_word_embeddings, eos) still apply
        text = cfg.get("text_config") or {}

        def get(key: str, default: Any = None) -> Any:
            if key in text and text[key] is not None:
                return text[key]
            return cfg.get(key, default)

        def req(key: str) -> Any:
            value = get(key)
            if value is None:
                raise KeyError(key)
            return value

        try:
            model_type = cfg["model_type"]
            arch = (cfg.get("architectures") or [_default_arch(model_type)])[0]
            heads = int(req("num_attention_heads"))
            hidden = int(req("hidden_size"))
            eos = get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_params = get("rope_parameters") or {}
            rope_theta = get("rope_theta", rope_params.get("rope_theta", 10000.0))
            scaling = get("rope_scaling")
            if scaling is None and rope_params.get("rope_type", "default") != "default":
                scaling = dict(rope_params)
            # LFM2 names the MLP width `block_ff_dim` in its original release
            inter = get("intermediate_size", get("block_ff_dim"))
            if inter is None:
                raise KeyError("intermediate_size")
            if "rms_norm_eps" in text or "rms_norm_eps" in cfg:
                eps = get("rms_norm_eps", 1e-6)
            else:  # LFM2: `norm_eps`
                eps = get("norm_eps", 1e-6)
            tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))
            if tie is None:
                tie = cfg.get("tie_embedding", False)
            return cls(
                architecture=arch,
                model_type=model_type,
                vocab_size=int(req("vocab_size")),
                hidden_size=hidden,
                intermediate_size=int(inter),
                num_hidden_layers=int(req("num_hidden_layers")),
                num_attention_heads=heads,
                num_key_value_heads=int(get("num_key_value_heads") or heads),
                head_dim=int(get("head_dim") or hidden // heads),
                rms_norm_eps=float(eps),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(tie),
                attention_bias=bool(get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                rope_scaling=scaling,
                bos_token_id=get("bos_token_id"),
                eos_token_ids=eos_ids,
                hf=copy.deepcopy(cfg),
            )
        except KeyError as exc:
            raise ValueError(f"model config lacks required field {exc.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """The config as a transformers `config.json` dict (loadable by `AutoConfig`): for
        a dense model rebuilt from these fields, for any other the original dict."""
        if not self.is_dense and self.hf is not None:
            return copy.deepcopy(self.hf)
        d = asdict(self)
        d.pop("hf")
        eos = list(d.pop("eos_token_ids"))
        d.pop("qk_norm")
        d["architectures"] = [d.pop("architecture")]
        d["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        if d["rope_scaling"] is None:
            d.pop("rope_scaling")
        return d


def _default_arch(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}.get(model_type, model_type)
