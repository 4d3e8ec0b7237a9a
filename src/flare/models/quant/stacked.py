"""The kinds of quantized weight, and fusing weights along the output axis (q/k/v,
gate/up), into a `StackedWeight` where their kinds differ."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.models.quant.blocks import Q4Weight, Q8Weight
from flare.models.quant.interleaved import Q4x8Weight, Q8x8Weight
from flare.models.quant.kquants import Q4Kx8Weight, Q6Kx8Weight
from flare.models.quant.q5 import Q5Kx8Weight, Q5x8Weight


@dataclass(frozen=True)
class StackedWeight:
    """Weights [N_i, K] of different kinds stacked along the output axis (a fused q/k/v
    whose parts a GGUF stores in two types, as Q4_K_M files do): `Linear` runs each part
    in its own kernel and concatenates the outputs, so each output row is what the part
    alone gives (row invariance kept).

    Attributes:
        parts_: the weights, in output order (adjacent ones of one kind already fused).
    """

    parts_: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts_), self.parts_[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts_)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return torch.cat([p.dequantize() if hasattr(p, "dequantize") else p.float()
                          for p in self.parts_])


QuantizedWeight = (Q4Weight | Q8Weight | Q4x8Weight | Q8x8Weight | Q4Kx8Weight | Q6Kx8Weight
                   | Q5x8Weight | Q5Kx8Weight)
BLOCK_KINDS = (Q4Weight, Q8Weight, Q4x8Weight, Q8x8Weight, Q4Kx8Weight, Q6Kx8Weight,
               Q5x8Weight, Q5Kx8Weight)
# the kinds a `StackedWeight` may hold (the int8-activation ones)
_INT8_KINDS = BLOCK_KINDS[2:]


def cat_weights(weights: list[torch.Tensor | QuantizedWeight]
                ) -> torch.Tensor | QuantizedWeight:
    """Weights [N_i, K] of one kind stacked along the output axis (fused q/k/v, gate/up).

    Weights of several int8-activation kinds (`Q4x8Weight`, `Q8x8Weight`, `Q4Kx8Weight`,
    `Q6Kx8Weight`, `Q5x8Weight`, `Q5Kx8Weight`: a GGUF that stores q/k and v in two
    types) give a `StackedWeight` of
    the runs of one kind, each fused.

    Raises:
        ValueError: the weights mix kinds otherwise (tensor, q4, q8 or an int8 kind).
    """
    if len(weights) == 1:
        return weights[0]
    kinds = {type(w) for w in weights}
    if len(kinds) != 1:
        if not all(k in _INT8_KINDS for k in kinds):
            raise ValueError(f"cannot fuse weights stored as "
                             f"{sorted(k.__name__ for k in kinds)}")
        runs: list[list] = []
        for w in weights:
            if runs and type(runs[-1][0]) is type(w):
                runs[-1].append(w)
            else:
                runs.append([w])
        return StackedWeight(tuple(cat_weights(r) for r in runs))
    kind = kinds.pop()
    if kind in (Q4x8Weight, Q5x8Weight) and len({w.mins.shape[1] for w in weights}) > 1:
        weights = [w.with_mins() for w in weights]  # Q4_0 / Q5_0 beside Q4_1 / Q5_1
    if kind in BLOCK_KINDS:  # groups stack as rows
        return kind(*(torch.cat(p) for p in zip(*(w.parts() for w in weights))))
    return torch.cat(weights)
