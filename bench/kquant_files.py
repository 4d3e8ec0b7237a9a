"""K-quant GGUF files made from another GGUF by llama.cpp's own quantizer, for benchmarks.

`kquant_file(src, "Q4_K_M")` returns `<flare cache>/bench-kquant/<model>.Q4_K_M.gguf`,
writing it first when it is not there yet (a few seconds on 2 cores), through
llama-cpp-python's `llama_model_quantize` with `llama_model_quantize_default_params()`.
A source whose 2-D weights are already quantized (the embedded model is Q4_1) is
requantized (`allow_requantize`): the values are not the original model's, the layouts
are what hub files hold. Without the binding there is no quantizer, and the call says so.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections import Counter
from pathlib import Path

from flare.cache_dir import default_cache_dir

# llama.cpp's ftype constant for each file kind the benchmarks write
FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
          "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
          "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
FLOAT_TYPES = ("F32", "F16", "BF16")  # what llama.cpp quantizes without allow_requantize


def default_out_dir() -> Path:
    """Where the files are kept between runs: `<flare cache>/bench-kquant`."""
    return default_cache_dir() / "bench-kquant"


def kind_of(name: str) -> str:
    """The canonical file kind for `name` ("q4_k_m" -> "Q4_K_M"). Raises ValueError
    for a kind with no ftype in `FTYPES`."""
    kind = name.strip().upper()
    if kind not in FTYPES:
        raise ValueError(f"unknown K-quant file kind {name!r}; known: {', '.join(FTYPES)}")
    return kind


def weight_types(path: Path) -> Counter:
    """GGUF type name -> number of 2-D tensors of that type in the file at `path`."""
    from gguf import GGUFReader

    return Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors
                   if len([d for d in t.shape if d > 1]) == 2)


def needs_requantize(types: Counter) -> bool:
    """Whether a file of 2-D weight `types` (`weight_types`) holds any quantized weight,
    which llama.cpp's quantizer converts only with `allow_requantize`."""
    return any(t not in FLOAT_TYPES for t in types)


def write_kquant(src: Path, out: Path, kind: str, threads: int) -> str | None:
    """`src` quantized to `kind` (a key of `FTYPES`) at `out` by llama.cpp's quantizer
    (written beside it, renamed into place when complete); why not, or None."""
    try:
        import llama_cpp
    except ImportError:
        return "llama-cpp-python is not installed: no quantizer to write the file"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.allow_requantize = needs_requantize(weight_types(src))
    params.nthread = threads
    with contextlib.suppress(ImportError, AttributeError):  # no line per fallback tensor
        from llama_cpp._logger import set_verbose

        set_verbose(False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        return f"llama_model_quantize returned {rc}"
    tmp.rename(out)
    return None


def kquant_file(src: Path, kind: str, threads: int, out_dir: Path | None = None
                ) -> Path | str:
    """The `kind` file made from `src` in `out_dir` (default `default_out_dir()`),
    written now when missing; or why it cannot be had (a sentence)."""
    out = (out_dir or default_out_dir()) / f"{src.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if out.is_file():
        return out
    why = write_kquant(src, out, kind, threads)
    return out if why is None else why
