"""Bytes a served dense model's weights take, per format and layout."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flare.models.quant.dense import dense_kernels
from flare.models.quant.formats import is_stored_low


def dense_panel_bytes(out_features: int, in_features: int, element_size: int) -> int:
    """Bytes of one weight in Flare's dense panel layout ([ceil(out/16), in, 16] of
    `element_size`-byte values: the output axis padded to a multiple of 16)."""
    return -(-out_features // 16) * 16 * in_features * element_size


def fp16_packed_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one float16 weight as `fp16` serves it on CPU with Flare's kernels: the
    panel layout of `dense_panel_bytes` (float16, output axis padded to 16)."""
    return dense_panel_bytes(out_features, in_features, 2)


def fbgemm_fp16_packed_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one weight in fbgemm's packed fp16 layout (the fallback where Flare's
    kernels cannot be had): float16, with the input axis padded to a multiple of 512
    (fbgemm's row block; torch packs with its default) and the output axis to a multiple
    of 16. For the embedded model's 576-wide inputs that is 1024 rows."""
    return -(-in_features // 512) * 512 * -(-out_features // 16) * 16 * 2


def serving_weight_bytes(tensors: Mapping[str, torch.Tensor], fmt: str,
                         tied_embeddings: bool, *, device: str = "cpu",
                         kernels: bool | None = None) -> int:
    """Bytes of weights a served dense model holds for `tensors` stored in format `fmt`.

    `q4`, `q4x8` and `q8x8`: the stored bytes (fused q/k/v and gate/up replace their
    parts; a float embedding / output layer of a GGUF's `q4x8` / `q8x8` counts as
    `fp16` / `full` count it; with `q4` a tied output layer runs on the embedding's own
    q8 blocks; the float32 scratch
    buffer prefill dequantizes into, the largest layer weight's size per thread, is not
    counted). `fp16` and float32 `full` on CPU with Flare's kernels: each 2-D weight in
    the panel layout (`dense_panel_bytes`), the token embedding as stored for lookups
    plus, with tied embeddings, a panel copy of it for the output layer. `fp16` without
    the kernels: fbgemm's packed layout (`fbgemm_fp16_packed_bytes`) in the same way.
    `full` otherwise (another dtype or device, or no kernels): the stored bytes (a tied
    output layer shares the table). 1-D tensors as stored. Padding is counted per stored
    weight (fused parts whose row counts are multiples of 16 pad alike).

    Args:
        device: the serving device ("cpu", "cuda", ...); only CPU packs.
        kernels: whether Flare's dense kernels run; None looks it up (`dense_kernels`).
    """
    on_cpu = torch.device(device).type == "cpu"
    if fmt not in ("full", "fp16"):
        floats = [n for n, t in tensors.items() if is_stored_low(n, t)]
        if not floats:  # every 2-D weight in blocks
            return sum(t.numel() * t.element_size() for t in tensors.values())
        # `q4x8` / `q8x8` from a GGUF whose embedding / output layer is float: those are
        # packed like `fp16` / `full` ones, the rest counted as stored
        if kernels is None:
            kernels = on_cpu and dense_kernels() is not None
        total = sum(t.numel() * t.element_size() for n, t in tensors.items()
                    if n not in floats)
        for n in floats:
            t = tensors[n]
            panel = dense_panel_bytes(*t.shape, t.element_size()) if kernels else (
                fbgemm_fp16_packed_bytes(*t.shape) if t.dtype == torch.float16 else 0)
            if n == "model.embed_tokens.weight":
                total += t.numel() * t.element_size() + (panel if tied_embeddings else 0)
            else:
                total += panel or t.numel() * t.element_size()
        return total
    if kernels is None:
        kernels = on_cpu and dense_kernels() is not None
    if fmt == "full":
        if not (on_cpu and kernels):
            return sum(t.numel() * t.element_size() for t in tensors.values())

        def packed(t: torch.Tensor) -> int:
            return dense_panel_bytes(*t.shape, 4)
    elif kernels:
        def packed(t: torch.Tensor) -> int:
            return fp16_packed_bytes(*t.shape)
    else:
        def packed(t: torch.Tensor) -> int:
            return fbgemm_fp16_packed_bytes(*t.shape)
    total = 0
    for name, t in tensors.items():
        if not is_stored_low(name, t) or (fmt == "full" and t.dtype != torch.float32):
            total += t.numel() * t.element_size()
        elif name == "model.embed_tokens.weight":
            total += t.numel() * t.element_size() + (packed(t) if tied_embeddings else 0)
        else:
            total += packed(t)
    return total
