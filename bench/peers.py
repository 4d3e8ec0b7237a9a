"""Flare beside its local peers and this machine's limits, on the embedded model: one table.

Columns: Flare's engine (prefix cache off) in each weight format asked for; transformers'
`generate` on the same fp32 weights; llama.cpp through llama-cpp-python on the very same
GGUF file, when it is importable. Rows: decode tokens/s at batch 1, aggregate decode
tokens/s at 8 concurrent streams, prefill tokens/s on 512- and 2,048-token prompts, and
the time to first token when a cached 2,048-token prompt is extended by 50 new tokens
(an agent's next turn: Flare's prefix cache; llama.cpp's own KV cache, which keeps the
prompt it evaluated last). Each throughput is followed by its fraction of the machine's
limit:

- decode: bytes read per step (the weights in the column's storage, plus the KV cache of
  the context) x steps/s, over the measured memory bandwidth;
- prefill: FLOPs per token (2 x linear parameters + attention over the causal context)
  x tokens/s, over the measured fp32 GEMM rate (torch.mm of 2048 x 2048 matrices).

Nothing is installed here. llama.cpp's Python binding: `pip install llama-cpp-python`
(a source build, about 11 minutes on 2 cores); transformers is a dependency of Flare.
Every column runs with the same thread count. Figures drift on a shared machine, so
`--repeat` rounds run every measurement of every column in turn and the table shows the
medians: compare the columns of one run.

    .venv/bin/python bench/peers.py [--threads 2] [--decode-tokens 64] [--weights fp16,full,q4,q4x8]
        [--repeat 3] [--quick] [--skip-transformers] [--skip-llama-cpp]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import (_prompt, _run, flare_decode, flare_engine,  # noqa: E402
                          flare_prefill, hf_decode, hf_model, hf_prefill)

from flare.loading.checkpoint import load_checkpoint  # noqa: E402
from flare.loading.embedded import embedded_model_path  # noqa: E402
from flare.runtime.request import GenerationRequest, SamplingParams  # noqa: E402

SHORT_PROMPT = 32  # tokens before decode starts
EXTEND_BASE, EXTEND_NEW = 2048, 50  # the cached prompt, and the turn that extends it


def new_tokens(round_: int, n: int, vocab: int) -> list[int]:
    """`n` token ids no earlier round used after the same prefix (each extension must be
    computed, not found in the cache), the same in every column for one round."""
    g = torch.Generator().manual_seed(round_)
    return torch.randint(1000, vocab, (n,), generator=g).tolist()


# ---- machine limits ---------------------------------------------------------------------

def gemm_gflops(n: int = 2048, reps: int = 3) -> float:
    """fp32 GFLOP/s of torch.mm on n x n matrices (median of `reps`)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def bandwidth_gbs(nbytes: int = 256 << 20, reps: int = 5) -> tuple[float, float]:
    """(copy, read) GB/s over a buffer of `nbytes`: copy counts bytes read plus written
    (STREAM's convention), read is a sum over the buffer. Medians of `reps`."""
    src = torch.empty(nbytes // 4).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    copies, reads = [], []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
        t = time.perf_counter()
        src.sum()
        reads.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(copies) / 1e9, nbytes / statistics.median(reads) / 1e9


# ---- what one token costs -----------------------------------------------------------------

def linear_params(cfg) -> tuple[int, int]:
    """(parameters of the decoder's linear layers, of the output layer)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    attn += cfg.num_attention_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * (attn + mlp), cfg.vocab_size * h


def decode_bytes_per_step(cfg, weight_bytes: float, batch: int, context: int) -> float:
    """Bytes one decode step reads: every linear weight once (output layer included) at
    `weight_bytes` per parameter, plus each sequence's fp32 K and V over `context`."""
    layers, out = linear_params(cfg)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    return (layers + out) * weight_bytes + batch * context * kv


def prefill_flops_per_token(cfg, n: int) -> float:
    """FLOPs per prompt token of an n-token prefill: 2 x linear parameters, plus QK^T and
    PV over n/2 keys on average (causal) in every layer; the output layer is left out (one
    row per prompt)."""
    layers, _ = linear_params(cfg)
    attn = 2 * 2 * (n / 2) * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 2 * layers + attn


def flare_bytes_per_param(cfg, fmt: str) -> float:
    """Weight bytes per linear parameter a decode step of Flare reads in format `fmt`:
    4 (full), 2 (fp16); per block of 32, for q4 24 bytes in the layers (16 of codes,
    float32 scale and min) and 36 in the output layer (32 int8 codes, a float32 scale),
    for q4x8 20 and 34 (float16 scales, as the GGUF); averaged over the parameters."""
    if fmt not in ("q4", "q4x8"):
        return 2.0 if fmt == "fp16" else 4.0
    layer_block, out_block = (24, 36) if fmt == "q4" else (20, 34)
    layers, out = linear_params(cfg)
    return (layers * layer_block / 32 + out * out_block / 32) / (layers + out)


# ---- llama.cpp ------------------------------------------------------------------------------

def flare_extend(engine, base: list[int], suffixes) -> float:
    """ms from submitting `base` + the next of `suffixes` to its first token, with `base`
    already in the engine's prefix cache."""
    t0, r = _run(engine, [GenerationRequest("x", base + next(suffixes),
                                            SamplingParams(max_tokens=1, temperature=0))])
    return (r["first"]["x"] - t0) / 1e6


def llama_cpp_measures(gguf: Path, ids_of, threads: int, decode_tokens: int,
                       lengths: tuple[int, ...], suffixes=None
                       ) -> dict[str, Callable[[], float]] | str:
    """llama.cpp's measurements through llama-cpp-python (row -> a call returning the
    figure), or why there are none. Prefill is one `eval` of the prompt (batches of
    512); decode evaluates one token per step (a fixed id: the sampler is not timed). The
    binding runs one sequence: no batch-8 figure."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return "not installed (pip install llama-cpp-python; a source build, ~11 min)"
    llm = Llama(model_path=str(gguf), n_ctx=4096, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    llm.reset()
    llm.eval(ids_of(16))  # warm-up

    def prefill(n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids_of(n))
        return n / (time.perf_counter() - t)

    def decode() -> float:
        llm.reset()
        llm.eval(ids_of(SHORT_PROMPT))
        t = time.perf_counter()
        for _ in range(decode_tokens):
            llm.eval([42])
        return decode_tokens / (time.perf_counter() - t)

    def extend() -> float:
        # the base prompt evaluated (llama.cpp keeps its KV), then only the new tokens
        llm.reset()
        llm.eval(ids_of(EXTEND_BASE))
        t = time.perf_counter()
        llm.eval(next(suffixes))
        return (time.perf_counter() - t) * 1e3

    out = {"decode_b1": decode, **{f"prefill_{n}": functools.partial(prefill, n)
                                   for n in lengths}}
    if suffixes is not None:
        out["extend"] = extend
    return out


# ---- the table ------------------------------------------------------------------------------

def interleaved_samples(measures: dict, rows: list[str], repeat: int
                        ) -> dict[tuple[str, str], list[float]]:
    """(column, row) -> the figures of `repeat` rounds, each round measuring every row of
    every column in turn (so a slow spell of the shared machine hits all columns alike);
    a column that is a string (why it was skipped) is passed over."""
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeat):
        for row in rows:
            for col, m in measures.items():
                if not isinstance(m, str) and row in m:
                    samples.setdefault((col, row), []).append(m[row]())
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for every column (default: the cores this process may use)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--weights", default="fp16,full,q4,q4x8",
                    help="Flare weight formats, comma-separated (default fp16,full,q4,q4x8)")
    ap.add_argument("--quick", action="store_true",
                    help="skip the 2,048-token prefill and decode 24 tokens")
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds over every column; the table shows medians (default 3)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n_dec = 24 if args.quick else args.decode_tokens
    lengths = (512,) if args.quick else (512, 2048)

    gguf = embedded_model_path()
    ckpt = load_checkpoint(gguf)
    cfg, tok = ckpt.config, ckpt.tokenizer

    def ids_of(n: int) -> list[int]:
        return _prompt(tok, n)

    short = ids_of(SHORT_PROMPT)
    extend = not args.quick
    rows = (["decode_b1", "decode_b8"] + [f"prefill_{n}" for n in lengths]
            + (["extend"] if extend else []))
    labels = {"decode_b1": "decode batch 1, tok/s", "decode_b8": "decode 8 streams, agg tok/s",
              **{f"prefill_{n}": f"prefill {n} tokens, tok/s" for n in lengths},
              "extend": f"+{EXTEND_NEW} on cached {EXTEND_BASE}, ms"}
    base = ids_of(EXTEND_BASE)

    def suffix_stream():
        # every column draws the same suffixes round by round
        for k in range(1 << 30):
            yield new_tokens(k, EXTEND_NEW, cfg.vocab_size)
    # every column's measurements (row -> a call returning the figure), made first; then
    # `--repeat` rounds run every measurement of every column in turn, so a slower spell
    # of the shared machine falls on all columns alike; the table shows medians
    measures: dict[str, dict[str, Callable[[], float]] | str] = {}
    bytes_per_param: dict[str, float] = {}
    for fmt in [w for w in args.weights.split(",") if w]:
        engine = flare_engine(ckpt, fmt)
        flare_decode(engine, short, 1, 8)  # warm-up
        measures[f"flare {fmt}"] = {
            "decode_b1": functools.partial(flare_decode, engine, short, 1, n_dec),
            "decode_b8": functools.partial(flare_decode, engine, short, 8, n_dec),
            **{f"prefill_{n}": functools.partial(flare_prefill, engine, ids_of(n))
               for n in lengths}}
        if extend:
            cached = flare_engine(ckpt, fmt, prefix_cache=True)
            flare_prefill(cached, base)  # the cached turn
            measures[f"flare {fmt}"]["extend"] = functools.partial(
                flare_extend, cached, base, suffix_stream())
        bytes_per_param[f"flare {fmt}"] = flare_bytes_per_param(cfg, fmt)
    if not args.skip_transformers:
        model = hf_model(ckpt)
        hf_prefill(model, ids_of(64))  # warm-up
        measures["transformers fp32"] = {
            "decode_b1": functools.partial(hf_decode, model, short, 1, n_dec),
            "decode_b8": functools.partial(hf_decode, model, short, 8, n_dec),
            **{f"prefill_{n}": functools.partial(hf_prefill, model, ids_of(n))
               for n in lengths}}
        bytes_per_param["transformers fp32"] = 4.0
    if not args.skip_llama_cpp:
        measures["llama.cpp"] = llama_cpp_measures(gguf, ids_of, args.threads, n_dec, lengths,
                                                   suffix_stream() if extend else None)
        layers, out = linear_params(cfg)
        # the GGUF's tensor bytes per parameter (Q4_1 layers, Q8_0 embedding / output)
        bytes_per_param["llama.cpp"] = gguf.stat().st_size / (layers + out)

    samples = interleaved_samples(measures, rows, args.repeat)
    columns: dict[str, dict[str, float | None] | str] = {
        col: m if isinstance(m, str) else
        {row: statistics.median(samples[col, row]) if (col, row) in samples else None
         for row in rows}
        for col, m in measures.items()}
    del measures
    gc.collect()

    gflops = gemm_gflops()
    copy_bw, read_bw = bandwidth_gbs()
    bw = max(copy_bw, read_bw)  # the larger: fractions are never overstated

    def fraction(col: str, row: str, value: float) -> float:
        if row.startswith("prefill"):
            n = int(row.split("_")[1])
            return value * prefill_flops_per_token(cfg, n) / (gflops * 1e9)
        batch = 8 if row == "decode_b8" else 1
        steps = value / batch
        per_step = decode_bytes_per_step(cfg, bytes_per_param[col], batch,
                                         SHORT_PROMPT + n_dec // 2)
        return steps * per_step / (bw * 1e9)

    print(f"embedded model {gguf.name}; {args.threads} threads; torch {torch.__version__}; "
          f"decode {n_dec} tokens after a {SHORT_PROMPT}-token prompt; medians of "
          f"{args.repeat} rounds")
    width = 22
    print(f"{'figure':30}" + "".join(f"{c:>{width}}" for c in columns))
    for row in rows:
        cells = []
        for col, figs in columns.items():
            value = None if isinstance(figs, str) else figs.get(row)
            if value is None:
                cells.append("-")
            elif row == "extend":
                cells.append(f"{value:7.1f}        ")
            else:
                cells.append(f"{value:7.1f} ({100 * fraction(col, row, value):4.1f}%)")
        print(f"{labels[row]:30}" + "".join(f"{c:>{width}}" for c in cells))
    for col, figs in columns.items():
        if isinstance(figs, str):
            print(f"{col}: {figs}")
    print(f"limits: fp32 GEMM {gflops:.0f} GFLOP/s (2048^3 torch.mm); memory copy "
          f"{copy_bw:.1f} GB/s (read+write), read {read_bw:.1f} GB/s; (%) = share of "
          f"{bw:.1f} GB/s for decode, of the GEMM rate for prefill")
    print("decode bytes per parameter: " + ", ".join(
        f"{c} {b:.2f}" for c, b in bytes_per_param.items())
          + "; llama.cpp has no 8-stream figure (its binding runs one sequence)")


if __name__ == "__main__":
    main()
