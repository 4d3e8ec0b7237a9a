"""The model hyper-parameters a recipe needs, read from a Hugging Face style config dict."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, in Hugging Face naming.

    Built from a `config.json` dict with `ModelConfig.from_hf`; written to the manifest
    as that dict again (`to_hf`), so a package is self-describing.
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

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read a transformers `config.json` dict.

        Raises:
            ValueError: a required field is missing, naming it.
        """
        try:
            model_type = cfg["model_type"]
            arch = (cfg.get("architectures") or [_default_arch(model_type)])[0]
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_params = cfg.get("rope_parameters") or {}
            rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
            scaling = cfg.get("rope_scaling")
            if scaling is None and rope_params.get("rope_type", "default") != "default":
                scaling = dict(rope_params)
            return cls(
                architecture=arch,
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                rope_scaling=scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as exc:
            raise ValueError(f"model config lacks required field {exc.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """The config as a transformers `config.json` dict (loadable by `AutoConfig`)."""
        d = asdict(self)
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
