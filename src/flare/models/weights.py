"""Reading a recipe's weights by their checkpoint names."""

from __future__ import annotations

from collections.abc import Callable

import torch


def tensor_getter(tensors: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """`get(name)` for a recipe's weights, raising `ValueError` that names a missing tensor."""

    def get(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise ValueError(f"weights lack tensor {name!r}") from None

    return get
