"""What a package stores for each weight format (`convert_tensors`) and how the stored
parts read back as weights (`weight_getter`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from flare.models.quant.blocks import (
    QBLOCK,
    Q4Weight,
    Q8Weight,
    quantize_q4,
    quantize_q8,
)
from flare.models.quant.formats import (
    FP16_MAX,
    INT8_FORMATS,
    Q8_NAMES,
    WEIGHT_FORMATS,
    fp16_overflow,
    is_stored_low,
)
from flare.models.quant.gguf_blocks import GGUFBlocks, native_weight
from flare.models.quant.interleaved import Q4x8Weight, Q8x8Weight
from flare.models.quant.kquants import Q4Kx8Weight, Q6Kx8Weight
from flare.models.quant.q5 import Q5Kx8Weight, Q5x8Weight
from flare.models.quant.stacked import QuantizedWeight

Q4_SUFFIXES = (".q4_codes", ".q4_scales", ".q4_mins")  # uint8 [N, K/2], f32 [N, K/32] x 2
Q8_SUFFIXES = (".q8_codes", ".q8_scales")  # int8 [N, K], float32 [N, K/32]
# format `q4x8`: the same parts in the 8-row interleaved layout (`Q4x8Weight`, `Q8x8Weight`)
Q4X8_SUFFIXES = (".q4x8_codes", ".q4x8_scales", ".q4x8_mins")
Q8X8_SUFFIXES = (".q8x8_codes", ".q8x8_scales")
# format `kx8`: a GGUF's Q4_K and Q6_K weights as stored (`Q4Kx8Weight`, `Q6Kx8Weight`)
Q4KX8_SUFFIXES = (".q4kx8_codes", ".q4kx8_scales", ".q4kx8_mins", ".q4kx8_d", ".q4kx8_dmin")
Q6KX8_SUFFIXES = (".q6kx8_codes", ".q6kx8_scales", ".q6kx8_d")
# ... and its 5-bit blocks: Q5_0 / Q5_1 (`Q5x8Weight`), Q5_K (`Q5Kx8Weight`)
Q5X8_SUFFIXES = (".q5x8_codes", ".q5x8_high", ".q5x8_scales", ".q5x8_mins")
Q5KX8_SUFFIXES = (".q5kx8_codes", ".q5kx8_high", ".q5kx8_scales", ".q5kx8_mins", ".q5kx8_d",
                  ".q5kx8_dmin")

_SUFFIXES = ((Q4_SUFFIXES, Q4Weight), (Q8_SUFFIXES, Q8Weight), (Q4X8_SUFFIXES, Q4x8Weight),
             (Q8X8_SUFFIXES, Q8x8Weight), (Q4KX8_SUFFIXES, Q4Kx8Weight),
             (Q6KX8_SUFFIXES, Q6Kx8Weight), (Q5X8_SUFFIXES, Q5x8Weight),
             (Q5KX8_SUFFIXES, Q5Kx8Weight))


_KX8_SUFFIXES = {Q4Kx8Weight: Q4KX8_SUFFIXES, Q6Kx8Weight: Q6KX8_SUFFIXES,
                 Q5x8Weight: Q5X8_SUFFIXES, Q5Kx8Weight: Q5KX8_SUFFIXES}


def weight_getter(tensors: Mapping[str, torch.Tensor]
                  ) -> Callable[[str], torch.Tensor | QuantizedWeight]:
    """`get(name)` over stored tensors: the tensor itself, or the quantized weight
    assembled from `name` + its kind's suffixes where the weight is stored in parts
    (`Q4Weight`, `Q8Weight` for format `q4`; `Q4x8Weight`, `Q8x8Weight` for `q4x8`). The names are listed once (a package mapping reads a tensor per
    access, so membership is never tested by reading).

    Raises (from get):
        ValueError: neither the tensor nor its parts are there, naming it.
    """
    names = set(tensors)

    def get(name: str) -> torch.Tensor | QuantizedWeight:
        if name in names:
            return tensors[name]
        for suffixes, kind in _SUFFIXES:
            if name + suffixes[0] in names:
                return kind(*(tensors[name + sfx] for sfx in suffixes))
        raise ValueError(f"weights lack tensor {name!r}")

    return get



def convert_tensors(tensors: Mapping[str, torch.Tensor], fmt: str,
                    blocks: Mapping[str, GGUFBlocks] | None = None) -> dict[str, torch.Tensor]:
    """The tensors a package of format `fmt` stores: `full` returns them as they are;
    `fp16` casts every 2-D `*.weight` to float16 (round to nearest even), same names;
    `q4` replaces every 2-D `*.weight` by its parts (`quantize_q4`, or `quantize_q8` for
    the `Q8_NAMES`), stored as `name` + `Q4_SUFFIXES` / `Q8_SUFFIXES`; `q4x8` stores the
    same blocks in the 8-row interleaved layout (`Q4x8Weight.pack`, `Q8x8Weight.pack`)
    under `Q4X8_SUFFIXES` / `Q8X8_SUFFIXES`; `q8x8` stores every 2-D weight as
    `Q8x8Weight` (`quantize_q8`); `kx8` stores a GGUF's blocks as they are (`Q4Kx8Weight`
    under `Q4KX8_SUFFIXES`, `Q6Kx8Weight` under `Q6KX8_SUFFIXES`, `Q5x8Weight` /
    `Q5Kx8Weight` under `Q5X8_SUFFIXES` / `Q5KX8_SUFFIXES`, the others as `q8x8` /
    `q4x8` store them) and re-quantizes any other weight as `q8x8` does. 1-D tensors
    (norms, biases) are kept as they are.

    `blocks` (a GGUF checkpoint's `Checkpoint.blocks`): for `q4x8`, `q8x8` and `kx8`, each weight
    the format can hold as the file stores it is built from the file's own blocks or
    values (`native_weight`: exact, never re-quantized); the rest is re-quantized from
    `tensors` as above.

    Raises:
        ValueError: unknown format; for `fp16` a weight beyond float16's range; for `q4`,
            `q4x8` and `q8x8` a weight whose input axis is not a multiple of 32, for
            `q4x8` and `q8x8` one whose output axis is not a multiple of 8 (each named).
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {list(WEIGHT_FORMATS)}")
    if fmt == "full":
        return dict(tensors)
    if fmt in ("q4",) + INT8_FORMATS:
        blocks = blocks or {}
        out: dict[str, torch.Tensor] = {}
        for k, v in tensors.items():
            if not is_stored_low(k, v):
                out[k] = v
                continue
            if v.shape[1] % QBLOCK:
                raise ValueError(f"weight {k!r} has shape {tuple(v.shape)}: weight format "
                                 f"{fmt!r} needs an input axis that is a multiple of "
                                 f"{QBLOCK}; use --weights fp16")
            w = None
            if fmt in INT8_FORMATS and k in blocks:
                w = native_weight(k, blocks[k], fmt, v)
                if isinstance(w, torch.Tensor):  # a float embedding / output layer
                    out[k] = w
                    continue
            q8 = k in Q8_NAMES or fmt in ("q8x8", "kx8")
            if w is None:
                w = (quantize_q8 if q8 else quantize_q4)(v, k)
                if fmt in INT8_FORMATS:
                    w = (Q8x8Weight if q8 else Q4x8Weight).pack(w, k)
            if type(w) in _KX8_SUFFIXES:
                suffixes = _KX8_SUFFIXES[type(w)]
            elif isinstance(w, Q4x8Weight):
                suffixes = Q4X8_SUFFIXES
            elif isinstance(w, Q8x8Weight):
                suffixes = Q8X8_SUFFIXES
            else:
                suffixes = Q8_SUFFIXES if q8 else Q4_SUFFIXES
            out.update(zip((k + sfx for sfx in suffixes), w.parts()))
        return out
    bad = fp16_overflow(tensors)
    if bad is not None:
        raise ValueError(f"weight {bad!r} has values beyond float16's range "
                         f"(+-{FP16_MAX:g}); use weight format 'full'")
    return {k: v.to(torch.float16) if is_stored_low(k, v) else v for k, v in tensors.items()}
