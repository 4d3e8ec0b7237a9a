"""Recipe `qwen3_next`: Qwen3-Next (transformers' `Qwen3NextForCausalLM`).

The same hybrid decoder as Qwen3.5 (`flare.models.qwen3_5`: Gated DeltaNet layers, every
few layers a gated full-attention layer with partial RoPE, zero-centred RMSNorms), with
two differences, both handled here at load or in the MLP:

- each DeltaNet layer stores its input projections as `in_proj_qkvz` and `in_proj_ba`,
  grouped by key head (per key head: q, k, then its value heads' v and z; then b and a per
  key head); `load_in_proj` regroups the rows into Qwen3.5's q | k | v | z | b | a order
  once, so the DeltaNet forward is Qwen3.5's;
- the MLP of the layers `Qwen3NextConfig.is_sparse` names is a sparse mixture of experts:
  a softmax router picks `num_experts_per_tok` of `num_experts` SwiGLU experts per token
  (weights renormalised when `norm_topk_prob`), plus a shared SwiGLU expert scaled by
  sigmoid(`shared_expert_gate`). Other layers keep a dense SwiGLU MLP.

Weights load in the hub's naming (`mlp.experts.E.gate_proj.weight`, ...), which is also
what transformers' `save_pretrained` writes; the multi-token-prediction head (`mtp.*`) is
dropped as for Qwen3.5. State layout and per-sequence state are Qwen3.5's.

Exact by default, as Qwen3.5: the router, every expert and the shared expert are
row-invariant `flare.models.quant.linear.Linear`s built at load, and each token's expert outputs
are summed in ascending expert order whatever other tokens the step holds, so a token's
result does not depend on the batch or the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from flare.models.hybrid_common import sigmoid
from flare.models.hybrid_decoder import SwiGLU, linear
from flare.models.quant.linear import Linear
from flare.models.qwen3_5 import (LINEAR, DeltaNetWeights, Qwen3_5Config, Qwen3_5Model,
                                  load_delta_net, state_layout)
from flare.models.qwen3_5 import expected_tensor_names as _qwen3_5_names

__all__ = ["Qwen3NextConfig", "Qwen3NextModel", "SparseMoE", "expected_tensor_names",
           "load_in_proj", "state_layout"]


@dataclass(frozen=True)
class Qwen3NextConfig(Qwen3_5Config):
    """Qwen3.5's hyper-parameters plus the sparse MLP's, in transformers' naming."""

    RECIPE: ClassVar[str] = "qwen3_next"
    DEFAULT_ARCHITECTURE: ClassVar[str] = "Qwen3NextForCausalLM"

    num_experts: int = 0  # 0: every MLP is dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def _extra_from_hf(cls, text: dict[str, Any]) -> dict[str, Any]:
        """The MoE fields (transformers' defaults where optional).

        Raises:
            KeyError: experts without `num_experts_per_tok`, `moe_intermediate_size` or
                `shared_expert_intermediate_size`.
        """
        experts = int(text.get("num_experts") or 0)
        if not experts:
            return {}
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(text["num_experts_per_tok"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in text.get("mlp_only_layers") or ()))

    def is_sparse(self, layer: int) -> bool:
        """Whether model layer `layer` (0-based) has the MoE MLP, as transformers decides:
        experts exist, the layer is not in `mlp_only_layers`, and (layer + 1) is a multiple
        of `decoder_sparse_step`."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


def expected_tensor_names(config: Qwen3NextConfig) -> set[str]:
    """Tensor names of a `Qwen3NextForCausalLM` of `config` (hub / `save_pretrained`
    naming, experts one by one)."""
    names = _qwen3_5_names(config)
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        if kind == LINEAR:
            a = p + "linear_attn."
            names -= {f"{a}in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")}
            names |= {a + "in_proj_qkvz.weight", a + "in_proj_ba.weight"}
        if config.is_sparse(i):
            m = p + "mlp."
            swiglu = ("gate", "up", "down")
            names -= {f"{m}{n}_proj.weight" for n in swiglu}
            names |= {m + "gate.weight", m + "shared_expert_gate.weight"}
            names |= {f"{m}shared_expert.{n}_proj.weight" for n in swiglu}
            names |= {f"{m}experts.{e}.{n}_proj.weight"
                      for e in range(config.num_experts) for n in swiglu}
    return names


def load_in_proj(qkvz: torch.Tensor, ba: torch.Tensor, config: Qwen3_5Config) -> torch.Tensor:
    """Qwen3-Next's DeltaNet input projections regrouped as Qwen3.5's one `in_proj`.

    Args:
        qkvz: [Hk * (2 Dk + 2 r Dv), hidden], r = Hv / Hk; per key head its q [Dk], k [Dk],
            then v and z of its r value heads [r Dv] each.
        ba: [Hk * 2r, hidden]; per key head b, then a, of its r value heads.
        config: head counts and dims.

    Returns:
        [2 Hk Dk + 2 Hv Dv + 2 Hv, hidden], rows q | k | v | z | b | a, each head-major
        (value head j of key head g is head g*r + j, as transformers reshapes them).
    """
    c = config
    hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // hk
    hidden = qkvz.shape[-1]
    parts = qkvz.view(hk, 2 * dk + 2 * r * dv, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    parts += ba.view(hk, 2 * r, hidden).split([r, r], dim=1)
    return torch.cat([x.reshape(-1, hidden) for x in parts])


@dataclass
class SparseMoE:
    """Qwen3-Next's sparse MoE MLP.

    Attributes:
        router: weight [E, hidden] (`mlp.gate.weight`).
        experts: the E experts (dense SwiGLUs: gate_up [2 I, hidden], down [hidden, I]).
        top_k: experts per token; norm_topk_prob: renormalise their weights to sum 1.
        shared: the shared expert (dense SwiGLU); shared_gate: weight [1, hidden].
    """

    router: Linear
    experts: list[SwiGLU]
    top_k: int
    norm_topk_prob: bool
    shared: SwiGLU
    shared_gate: Linear

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """[T, hidden] normalized inputs -> [T, hidden], dtype of `y`. Each token's expert
        outputs are summed in expert order, then the gated shared expert is added."""
        probs = self.router(y).softmax(dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(y.dtype)
        out = torch.zeros_like(y)
        for e in experts.unique().tolist():  # ascending
            tok, slot = (experts == e).nonzero(as_tuple=True)
            h = self.experts[e](y[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, h)
        return out + sigmoid(self.shared_gate(y)) * self.shared(y)


class Qwen3NextModel(Qwen3_5Model):
    """The Qwen3-Next decoder: `Qwen3_5Model` with Qwen3-Next's DeltaNet projections and
    sparse MoE MLPs (see the module docstring).

    Args:
        config: model hyper-parameters.
        tensors: `Qwen3NextForCausalLM`-named weights in the serving dtype, on the serving
            device (each expert's gate and up rows are joined into one new tensor at load).
        max_positions: size of the RoPE table (the plan's max sequence length).

    Raises:
        ValueError: a tensor is missing (named).
    """

    CONFIG = Qwen3NextConfig
    config: Qwen3NextConfig

    def _load_delta_net(self, w: Callable[[str], torch.Tensor], prefix: str) -> DeltaNetWeights:
        in_proj = load_in_proj(w(prefix + "in_proj_qkvz.weight"),
                               w(prefix + "in_proj_ba.weight"), self.config)
        return load_delta_net(w, prefix, in_proj)

    def _load_mlp(self, w: Callable[[str], torch.Tensor], prefix: str,
                  layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        c = self.config
        if not c.is_sparse(layer):
            return super()._load_mlp(w, prefix, layer)

        def swiglu(p: str) -> SwiGLU:
            return SwiGLU.of(w(p + "gate_proj.weight"), w(p + "up_proj.weight"),
                             w(p + "down_proj.weight"))

        return SparseMoE(
            router=linear(w(prefix + "gate.weight")),
            experts=[swiglu(f"{prefix}experts.{e}.") for e in range(c.num_experts)],
            top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
            shared=swiglu(prefix + "shared_expert."),
            shared_gate=linear(w(prefix + "shared_expert_gate.weight")))
