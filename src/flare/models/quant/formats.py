"""Which weight formats exist, which one a model gets, and what each needs to run.

The formats themselves are described in `flare.models.quant`; the stored parts' names are
in `flare.models.quant.storage`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

WEIGHT_FORMATS = ("full", "fp16", "q4", "q4x8", "q8x8", "kx8")
# the formats whose weights are int8-activation blocks (`Q4x8Weight`, `Q8x8Weight`)
INT8_FORMATS = ("q4x8", "q8x8", "kx8")
# the weights `q4` stores Q8_0-style (embedding lookups need them row by row)
Q8_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def check_weight_format(fmt: str, *, dtype: str, device: str, recipe: str) -> None:
    """Refuse a weight format the serving setup cannot run.

    `q4`, `q4x8` and `q8x8` also need Flare's C++ kernel (`flare.kernels.qgemm`):
    checking builds it once (about a minute on 2 cores; cached on disk after).

    Raises:
        ValueError: unknown format; `fp16`, `q4`, `q4x8` or `q8x8` with a serving dtype
            other than float32, a device other than CPU, or a recipe other than `llama`
            (all named); `q4`/`q4x8`/`q8x8` where the kernel cannot be had (CPU without
            AVX2/FMA, no C++ compiler or ninja, failed build: the reason is in the message).
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {list(WEIGHT_FORMATS)}")
    if fmt in ("fp16", "q4") + INT8_FORMATS:
        kernel = f"Flare's {fmt} kernel"
        why = []
        if dtype != "float32":
            why.append(f"serving dtype {dtype!r} (needs float32 activations)")
        if torch.device(device).type != "cpu":
            why.append(f"device {device!r} ({kernel} runs on CPU)")
        if recipe != "llama":
            why.append(f"recipe {recipe!r} (only 'llama' reads {fmt} weights)")
        if why:
            raise ValueError(f"weight format {fmt!r} does not apply to " + ", ".join(why)
                             + "; use --weights full")
    if fmt in ("q4",) + INT8_FORMATS:
        from flare.kernels import qgemm_problem

        problem = qgemm_problem()  # builds the kernel once (about a minute), then cached
        if problem is not None:
            raise ValueError(f"weight format {fmt!r} is not available on this machine: "
                             f"{problem}; use --weights fp16")


# GGUF tensor types whose values a format holds exactly when it is built from the file's
# blocks (`convert_tensors(..., blocks=)`; norms stay float32):
# - `q4x8` layers: Q4_1 blocks are its own (codes, float16 scale and min); a Q4_0 block
#   (d, codes q, value d * (q - 8)) is its scale d and codes with no min held (the kernel
#   and the lookups compute -8d, exact in float32). Re-quantizing Q4_0's floats as Q4_1 would move a
#   block that does not use both extreme codes, so they are never re-quantized.
# - `q8x8` layers: Q8_0 blocks are its own; a Q4_0 block is the Q8_0 block with scale d
#   and codes q - 8.
# - either format's token embedding and output layer ("other"): Q8_0 kept as Q8_0, Q4_0
#   and Q4_1 as `Q4x8Weight`, F16 / BF16 / F32 as float16 where every value converts
#   exactly, else in the serving dtype (run by the dense kernels).
# - `q8x8` also takes Q5_0 blocks when asked for (codes q - 16, scale d: exact).
# - `kx8` (any mix of these, layers and embedding / output layer alike): Q4_K as
#   `Q4Kx8Weight`, Q5_K as `Q5Kx8Weight`, Q6_K as `Q6Kx8Weight`, Q5_0 / Q5_1 as
#   `Q5x8Weight`, Q8_0 as `Q8x8Weight`, Q4_0 / Q4_1 as `Q4x8Weight`; weights of two kinds
#   in one fused
#   projection (a Q4_K_M file's q/k Q4_K beside a Q6_K v) run as `StackedWeight`.
Q4X8_NATIVE_LAYER_TYPES = frozenset({"Q4_0", "Q4_1"})
Q8X8_NATIVE_LAYER_TYPES = frozenset({"Q8_0", "Q4_0"})
NATIVE_OTHER_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"})
KX8_NATIVE_LAYER_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0", "Q4_0",
                                    "Q4_1"})
KX8_NATIVE_OTHER_TYPES = NATIVE_OTHER_TYPES | {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"}
Q4X8_NATIVE_OTHER_TYPES = NATIVE_OTHER_TYPES  # kept for callers of the older name


def native_format(source: Mapping | None) -> str | None:
    """The int8-activation format that holds a checkpoint's weights as stored, or None.

    `source["weight_types"]` ({"layers": [...], "other": [...]}, GGUF type names, written
    by the GGUF loader) decides: `q4x8` for a GGUF whose layer weights are all Q4_1 or
    Q4_0, `q8x8` for one whose layers are Q8_0 (Q4_0 beside them allowed), in
    both cases with the embedding / output layer among `NATIVE_OTHER_TYPES`; else `kx8`
    where every layer type is in `KX8_NATIVE_LAYER_TYPES` and every other one in
    `KX8_NATIVE_OTHER_TYPES` (K-quant files such as Q4_K_M, Q5_K_M and Q6_K, Q5_0 / Q5_1
    files, and mixes the two formats above do not fuse). Anything else (a safetensors
    folder, F16, Q2_K, Q3_K or other layer types): None."""
    if not source or source.get("format") != "gguf":
        return None
    types = source.get("weight_types") or {}
    layers, other = set(types.get("layers", ())), set(types.get("other", ()))
    if not layers:
        return None
    if other <= NATIVE_OTHER_TYPES:
        if layers <= Q4X8_NATIVE_LAYER_TYPES:
            return "q4x8"
        if layers <= Q8X8_NATIVE_LAYER_TYPES:
            return "q8x8"
    if layers <= KX8_NATIVE_LAYER_TYPES and other <= KX8_NATIVE_OTHER_TYPES:
        return "kx8"
    return None


def native_q4x8(source: Mapping | None) -> bool:
    """Whether a checkpoint's weights are stored as `q4x8` holds them (`native_format`):
    a GGUF of Q4_1 / Q4_0 layers."""
    return native_format(source) == "q4x8"


def native_q8x8(source: Mapping | None) -> bool:
    """Whether a checkpoint's weights are stored as `q8x8` holds them (`native_format`):
    a GGUF of Q8_0 layers."""
    return native_format(source) == "q8x8"


def default_weight_format(*, dtype: str, device: str, recipe: str,
                          source: Mapping | None = None) -> str:
    """The fastest exact format for a model (docs/preparation-contract.md, "Exactness").

    - `q4x8` for a GGUF of Q4_1 or Q4_0 layers (the embedded model is Q4_1), `q8x8` for
      one of Q8_0 layers, `kx8` for K-quant files (Q4_K_M, Q5_K_M, Q6_K, ...),
      Q5_0 / Q5_1 files and other
      mixes of those types (`native_format(source)`), where the format applies (CPU,
      float32, recipe `llama`) and Flare's kernel builds: the file's own blocks, the
      fastest decode and prefill measured;
    - else `fp16` where it applies: half the bytes of `full` per decoded token, run by
      Flare's row-invariant kernel;
    - else `full`.

    Every one of them is batch- and chunk-invariant on CPU with Flare's kernels.
    `source` is the checkpoint's (or a package manifest's) source identity; None or a
    safetensors folder never picks `q4x8` or `q8x8`.
    """
    native = native_format(source)
    if native is not None:
        try:
            check_weight_format(native, dtype=dtype, device=device, recipe=recipe)
        except ValueError:
            pass
        else:
            return native
    try:
        check_weight_format("fp16", dtype=dtype, device=device, recipe=recipe)
    except ValueError:
        return "full"
    return "fp16"


def default_kv_dtype(fmt: str, *, dtype: str, device: str) -> str | None:
    """The KV pool dtype a package gets when none is asked for (`CapacityPlan.kv_dtype`).

    "float16" for the int8-activation formats (`INT8_FORMATS`) serving float32 on CPU:
    their kernels round every activation to int8 blocks before a product, so rounding K
    and V to float16 adds nothing measurable (teacher-forced on 400 agent-corpus tokens,
    q4x8's KL to the float32 weights is 3.54e-3 with the float16 pool and 3.50e-3 with the
    float32 one; tests/unit/test_kv_float16.py), while decode attention reads half the
    bytes (1.6x at 2,048 cached tokens, bench/bench_kv_dtype.py). llama.cpp's default
    cache type is f16 as well. Reuse == recompute and batch invariance hold either way.
    Else None: the serving dtype (`full` and `fp16` keep float32 activations exact).
    """
    if fmt in INT8_FORMATS and dtype == "float32" and torch.device(device).type == "cpu":
        return "float16"
    return None


def is_stored_low(name: str, t: torch.Tensor) -> bool:
    # the 2-D weights: projections, embedding, output layer (norms and biases are 1-D)
    return t.dim() == 2 and name.endswith(".weight")


FP16_MAX = 65504.0  # largest finite float16


def fp16_overflow(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The first 2-D weight with a value beyond float16's finite range (it would become
    infinite), or None. Weights trained in bfloat16 or float32 are far inside it, and
    bfloat16 values of normal magnitude convert to float16 exactly."""
    for name, t in tensors.items():
        if is_stored_low(name, t) and t.is_floating_point() and (
                float(t.abs().max()) > FP16_MAX):
            return name
    return None

