"""Flare beside its local peers and this machine's limits, on the embedded model: one table.

Columns: Flare's engine (prefix cache off) in each weight format asked for (`*` marks the
default format, what `flare prepare` picks); transformers' `generate` on the same fp32
weights; llama.cpp through llama-cpp-python on the very same GGUF file, when it is
importable. Rows: decode tokens/s at batch 1, aggregate decode tokens/s at 8 concurrent
streams, decode tokens/s at batch 1 after a 2,048-token prompt (an agent's long context:
each step also reads the context's K and V), prefill tokens/s on 512- and 2,048-token
prompts, and the time to first token when a cached 2,048-token prompt is extended by 50
new tokens (an agent's next turn: Flare's prefix cache; llama.cpp's own KV cache, which
keeps the prompt it evaluated last).

Then the same rows for Flare's default format and llama.cpp on K-quant files (Q4_K_M and
Q6_K, `--kquants`) that llama.cpp's quantizer writes from the embedded GGUF
(`kquant_files`, kept in Flare's cache folder), with the weights each format holds
against the file's size; and the 20-turn agent session (`bench_agent_session`): median
TTFT over turns 2-20 of `flare serve` on the default package (prefix cache on) beside
llama.cpp's server with its prompt cache (`--cache true`), both started here, the turns
bounded by `--session-budget` seconds; after the turns, that server's peak RSS (VmHWM)
against its package's memory report, whose bound is the report + 300 MiB.

Each throughput is followed by its share of the machine's limit (`machine_limits`,
measured after the rounds, printed with the CPU model, its instruction-set flags and
Flare's kernel variant):

- decode: bytes read per step (the weights in the column's storage, plus the KV cache of
  the context) x steps/s, over the measured read bandwidth;
- prefill: tokens/s x the time a token takes at the peaks: its linear FLOPs (2 x linear
  parameters) at the int8 kernel peak for a column whose products run on int8
  activations (q4x8, q8x8, kx8, llama.cpp's quantized types), else at the fp32 peak,
  plus its attention FLOPs (over the causal context) at the fp32 peak.

Nothing is installed here. llama.cpp's Python binding: `pip install
'llama-cpp-python[server]'` (a source build, about 11 minutes on 2 cores); transformers
is a dependency of Flare. Every column runs with the same thread count. Figures drift on
a shared machine, so `--repeat` rounds run every measurement of every column in turn and
the tables show the medians: compare the columns of one run. `--quick` (a smoke, about 3
minutes): one round, 24 decode tokens, no 2,048-token rows, a 4-turn session.

    .venv/bin/python bench/peers.py [--threads 2] [--decode-tokens 64] [--weights fp16,full,q4,q4x8]
        [--repeat 3] [--quick] [--skip-transformers] [--skip-llama-cpp]
        [--kquants q4_k_m,q6_k | --skip-kquants] [--session-turns 20]
        [--session-budget 600] [--skip-session]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import (
    _prompt,
    _run,
    flare_decode,
    flare_engine,
    flare_prefill,
    hf_decode,
    hf_model,
    hf_prefill,
)
from bench_memory import TARGET_MIB  # peak RSS may pass the memory report by this (MiB)
from kquant_files import kind_of, kquant_file, weight_types
from machine_limits import Limits, measure_limits

from flare.loading.checkpoint import load_checkpoint
from flare.loading.embedded import embedded_model_path
from flare.models.quant.formats import INT8_FORMATS, default_weight_format
from flare.models.quant.sizes import serving_weight_bytes
from flare.models.quant.storage import convert_tensors
from flare.runtime.boot import freeze_startup_objects
from flare.runtime.request import GenerationRequest, SamplingParams

SHORT_PROMPT = 32  # tokens before decode starts
EXTEND_BASE, EXTEND_NEW = 2048, 50  # the cached prompt, and the turn that extends it
MIB = 2 ** 20


def new_tokens(round_: int, n: int, vocab: int) -> list[int]:
    """`n` token ids no earlier round used after the same prefix (each extension must be
    computed, not found in the cache), the same in every column for one round."""
    g = torch.Generator().manual_seed(round_)
    return torch.randint(1000, vocab, (n,), generator=g).tolist()


# ---- what one token costs -----------------------------------------------------------------

def linear_params(cfg) -> tuple[int, int]:
    """(parameters of the decoder's linear layers, of the output layer)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    attn += cfg.num_attention_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * (attn + mlp), cfg.vocab_size * h


def decode_bytes_per_step(cfg, weight_bytes: float, batch: int, context: int,
                          kv_bytes: int = 4) -> float:
    """Bytes one decode step reads: every linear weight once (output layer included) at
    `weight_bytes` per parameter, plus each sequence's K and V over `context` at
    `kv_bytes` an element (4: float32, 2: float16)."""
    layers, out = linear_params(cfg)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_bytes
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


def prefill_share(cfg, n: int, tokens_per_s: float, linear_ops: float, fp32_ops: float
                  ) -> float:
    """Share of the machine's limit an n-token prefill at `tokens_per_s` reaches: the
    seconds a token takes at the peaks (its 2 x linear parameters at `linear_ops`, its
    attention FLOPs at `fp32_ops`, both per second) x tokens/s."""
    layers, _ = linear_params(cfg)
    attention = prefill_flops_per_token(cfg, n) - 2 * layers
    return tokens_per_s * (2 * layers / linear_ops + attention / fp32_ops)


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

    def decode(prompt: int) -> float:
        llm.reset()
        llm.eval(ids_of(prompt))
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

    out = {"decode_b1": functools.partial(decode, SHORT_PROMPT),
           **{f"prefill_{n}": functools.partial(prefill, n) for n in lengths}}
    if suffixes is not None:
        out["extend"] = extend
        out["decode_long"] = functools.partial(decode, EXTEND_BASE)
    return out


# ---- the rounds ------------------------------------------------------------------------------

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


# ---- the columns ----------------------------------------------------------------------------

@dataclass
class Setup:
    """What every column is measured on: prompts of `ids_of(n)` tokens (the embedded
    model's tokenizer; the K-quant files share it), `threads`, `n_dec` decoded tokens,
    prefill `lengths`, whether the extend row runs, the vocabulary the suffixes draw from."""

    ids_of: Callable[[int], list[int]]
    threads: int
    n_dec: int
    lengths: tuple[int, ...]
    extend: bool
    vocab: int

    def suffixes(self) -> Iterator[list[int]]:
        """The extend row's new tokens, round by round: the same in every column."""
        for k in range(1 << 30):
            yield new_tokens(k, EXTEND_NEW, self.vocab)


@dataclass
class Column:
    """One column: its measurements (row -> a call returning the figure) or why it has
    none; the weight bytes per parameter a decode step reads; whether its prompt
    products run on int8 activations (its prefill limit is then the int8 kernel peak);
    the weight bytes it holds in memory, where known; the bytes of one K or V element in
    its cache."""

    measures: dict[str, Callable[[], float]] | str
    bytes_per_param: float = 4.0
    int8: bool = False
    held_bytes: int | None = None
    kv_bytes: int = 4


def kv_pages(n_dec: int, page_size: int = 16) -> int:
    """KV pages an engine needs for every row, twice over (the prefix-cached engine keeps
    earlier extensions): the cached 2,048-token prompt and an extension (or one 2,048-token
    prefill, or one decoding `n_dec` tokens after it), or 8 streams of the short prompt
    and `n_dec` tokens. The default pool (8 full-length sequences, 1.5 GiB) for every
    column would not fit beside the others."""
    one = -(-(EXTEND_BASE + max(EXTEND_NEW, n_dec) + 1) // page_size)
    streams = 8 * -(-(SHORT_PROMPT + n_dec + 1) // page_size)
    return 2 * max(one, streams)


def flare_column(ckpt, fmt: str, setup: Setup) -> Column:
    """Flare's engine on `ckpt` in format `fmt` (converted once, from the file's own
    blocks; a second engine with the prefix cache shares the weights for the extend row)."""
    stored = convert_tensors(ckpt.tensors, fmt, ckpt.blocks)
    pages = kv_pages(setup.n_dec)
    engine = flare_engine(ckpt, fmt, stored=stored, num_pages=pages)
    short = setup.ids_of(SHORT_PROMPT)
    flare_decode(engine, short, 1, 8)  # warm-up
    measures = {
        "decode_b1": functools.partial(flare_decode, engine, short, 1, setup.n_dec),
        "decode_b8": functools.partial(flare_decode, engine, short, 8, setup.n_dec),
        **{f"prefill_{n}": functools.partial(flare_prefill, engine, setup.ids_of(n))
           for n in setup.lengths}}
    if setup.extend:
        measures["decode_long"] = functools.partial(flare_decode, engine,
                                                    setup.ids_of(EXTEND_BASE), 1, setup.n_dec)
        cached = flare_engine(ckpt, fmt, prefix_cache=True, stored=stored, num_pages=pages)
        base = setup.ids_of(EXTEND_BASE)
        flare_prefill(cached, base)  # the cached turn
        measures["extend"] = functools.partial(flare_extend, cached, base, setup.suffixes())
    held = serving_weight_bytes(stored, fmt, ckpt.config.tie_word_embeddings)
    layers, out = linear_params(ckpt.config)
    # the formulas where they are known, else what the format holds (kx8, q8x8)
    per_param = (flare_bytes_per_param(ckpt.config, fmt) if fmt in ("full", "fp16", "q4", "q4x8")
                 else held / (layers + out))
    kv_bytes = getattr(torch, engine.plan.kv_pool_dtype).itemsize
    return Column(measures, per_param, int8=fmt in INT8_FORMATS, held_bytes=held,
                  kv_bytes=kv_bytes)


def transformers_column(ckpt, setup: Setup) -> Column:
    """transformers' `generate` on the checkpoint's fp32 weights (no extend row)."""
    model = hf_model(ckpt)
    hf_prefill(model, setup.ids_of(64))  # warm-up
    short = setup.ids_of(SHORT_PROMPT)
    return Column({
        "decode_b1": functools.partial(hf_decode, model, short, 1, setup.n_dec),
        "decode_b8": functools.partial(hf_decode, model, short, 8, setup.n_dec),
        **{f"prefill_{n}": functools.partial(hf_prefill, model, setup.ids_of(n))
           for n in setup.lengths}})


def llama_cpp_column(gguf: Path, cfg, setup: Setup) -> Column:
    """llama.cpp on `gguf`; a step reads the file's tensor bytes per parameter."""
    layers, out = linear_params(cfg)
    return Column(llama_cpp_measures(gguf, setup.ids_of, setup.threads, setup.n_dec,
                                     setup.lengths, setup.suffixes() if setup.extend else None),
                  gguf.stat().st_size / (layers + out), int8=True,
                  kv_bytes=2)  # llama.cpp's cache is float16 by default


def kquant_group(src: Path, kind: str, setup: Setup, llama_cpp: bool
                 ) -> tuple[str, dict[str, Column]] | str:
    """(title, columns) for the `kind` file made from `src`: Flare in the file's default
    format, and llama.cpp when `llama_cpp`; or why the file cannot be had."""
    path = kquant_file(src, kind, setup.threads)
    if isinstance(path, str):
        return f"{kind}: not measured ({path})"
    ckpt = load_checkpoint(path)
    fmt = default_weight_format(dtype="float32", device="cpu", recipe="llama",
                                source=ckpt.source)
    columns = {f"flare {fmt}*": flare_column(ckpt, fmt, setup)}
    if llama_cpp:
        columns["llama.cpp"] = llama_cpp_column(path, ckpt.config, setup)
    size = path.stat().st_size
    held = columns[f"flare {fmt}*"].held_bytes
    types = ", ".join(f"{n} {t}" for t, n in sorted(weight_types(path).items()))
    title = (f"{path.name} ({size / MIB:.1f} MiB; 2-D tensors {types}); flare {fmt} holds "
             f"{held / MIB:.1f} MiB = {held / size:.2f}x the file")
    return title, columns


# ---- the tables -----------------------------------------------------------------------------

def print_table(title: str, columns: dict[str, Column], figures: dict[str, dict[str, float]],
                rows: list[str], labels: dict[str, str],
                share: Callable[[Column, str, float], float], width: int = 22) -> None:
    """One table: a row per figure, a column per `columns` (the median, and for
    throughputs its share of the machine's limit); then why any column has no figures."""
    print(f"\n{title}")
    print(f"{'figure':30}" + "".join(f"{c:>{width}}" for c in columns))
    for row in rows:
        cells = []
        for name, col in columns.items():
            value = figures.get(name, {}).get(row)
            if value is None:
                cells.append("-")
            elif row == "extend":
                cells.append(f"{value:7.1f}        ")
            else:
                cells.append(f"{value:7.1f} ({100 * share(col, row, value):4.1f}%)")
        print(f"{labels[row]:30}" + "".join(f"{c:>{width}}" for c in cells))
    for name, col in columns.items():
        if isinstance(col.measures, str):
            print(f"{name}: {col.measures}")


def figure_share(cfg, limits: Limits, col: Column, row: str, value: float, context: int
                 ) -> float:
    """The share of the machine's limit of `value` in `row` of `col` (see the module
    docstring); decode steps read the KV cache of `context` positions."""
    if row.startswith("prefill"):
        n = int(row.split("_")[1])
        linear = limits.int8_gops if col.int8 and limits.int8_gops else limits.fp32_gflops
        return prefill_share(cfg, n, value, linear * 1e9, limits.fp32_gflops * 1e9)
    batch = 8 if row == "decode_b8" else 1
    per_step = decode_bytes_per_step(cfg, col.bytes_per_param, batch, context, col.kv_bytes)
    return value / batch * per_step / (limits.read_gbs * 1e9)


def session_line(gguf: Path, fmt: str, threads: int, turns: int, budget_s: float) -> str:
    """The agent session's medians against llama.cpp's server, and the Flare server's peak
    RSS against its memory report: two lines."""
    from bench_agent_session import against_llama_cpp

    from flare.serve_child import ServerStartError

    max_tokens = 16
    with tempfile.TemporaryDirectory(prefix="flare-peers-") as tmp:
        try:
            r = against_llama_cpp(gguf, threads, turns, max_tokens, budget_s, Path(tmp))
        except ServerStartError as exc:
            return f"agent session: flare serve did not start ({str(exc).splitlines()[0]})"
    head = (f"agent session ({r['corpus']}, {r['turns']} turns of {max_tokens} tokens"
            + (f"; the {budget_s:.0f} s budget ended it" if r["turns"] < turns else "")
            + f"): median TTFT turns 2-{r['turns']}: ")
    if r["flare"] is None:
        return head + "none (fewer than 2 turns ran)"
    flare = f"flare serve (default package, {fmt}, prefix cache) {r['flare']:.0f} ms"
    if r["llama.cpp"] is None:
        line = head + f"{flare}; llama.cpp server: {r['peer_problem']}"
    else:
        line = (head + f"{flare}, llama.cpp server (--cache true) {r['llama.cpp']:.0f} ms; "
                f"llama.cpp / flare {r['llama.cpp'] / r['flare']:.2f}")
    return line + "\n" + peak_rss_line(r["flare_peak_rss"], r["report_total"])


def peak_rss_line(peak: int | None, report_total: int) -> str:
    """The Flare server's peak RSS (bytes, None when unread) against its package's memory
    report total (bytes) and the issue's bound, report + `TARGET_MIB`, as one line."""
    report = f"memory report total {report_total / MIB:.0f} MiB"
    if peak is None:
        return f"flare serve peak RSS: unread (no /proc here); {report}"
    over = (peak - report_total) / MIB
    return (f"flare serve peak RSS (VmHWM after the session) {peak / MIB:.0f} MiB; {report}; "
            f"peak - report {over:+.0f} MiB (bound +{TARGET_MIB} MiB: "
            f"{'within' if over <= TARGET_MIB else 'over'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for every column (default: the cores this process may use)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--weights", default="fp16,full,q4,q4x8",
                    help="Flare weight formats, comma-separated (default fp16,full,q4,q4x8)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke: one round, 24 decode tokens, no 2,048-token rows, 4 turns")
    ap.add_argument("--repeat", type=int, default=None,
                    help="rounds over every column; the tables show medians (default 3, "
                         "1 with --quick)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--kquants", default="q4_k_m,q6_k",
                    help="K-quant files written from the embedded GGUF and measured "
                         "(default q4_k_m,q6_k)")
    ap.add_argument("--skip-kquants", action="store_true")
    ap.add_argument("--session-turns", type=int, default=None,
                    help="agent-session turns (default 20, 4 with --quick)")
    ap.add_argument("--session-budget", type=float, default=600.0,
                    help="seconds the session's turns may take; later turns are not sent")
    ap.add_argument("--skip-session", action="store_true")
    args = ap.parse_args()
    try:
        kinds = [] if args.skip_kquants else [kind_of(k) for k in args.kquants.split(",") if k]
    except ValueError as exc:
        ap.error(str(exc))
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    turns = args.session_turns or (4 if args.quick else 20)
    torch.set_num_threads(args.threads)
    n_dec = 24 if args.quick else args.decode_tokens
    # the limits first, on a quiet process (nothing loaded yet)
    limits = measure_limits(args.threads)
    print(f"{args.threads} threads; torch {torch.__version__}; decode {n_dec} tokens after a "
          f"{SHORT_PROMPT}-token prompt; load average {os.getloadavg()[0]:.1f} at the start")
    for line in limits.lines():
        print(line, flush=True)
    gguf = embedded_model_path()
    ckpt = load_checkpoint(gguf)
    cfg, tok = ckpt.config, ckpt.tokenizer
    default_fmt = default_weight_format(dtype="float32", device="cpu", recipe="llama",
                                        source=ckpt.source)
    setup = Setup(ids_of=lambda n: _prompt(tok, n), threads=args.threads, n_dec=n_dec,
                  lengths=(512,) if args.quick else (512, 2048), extend=not args.quick,
                  vocab=cfg.vocab_size)
    rows = (["decode_b1", "decode_b8"] + (["decode_long"] if setup.extend else [])
            + [f"prefill_{n}" for n in setup.lengths] + (["extend"] if setup.extend else []))
    labels = {"decode_b1": "decode batch 1, tok/s", "decode_b8": "decode 8 streams, agg tok/s",
              "decode_long": f"decode b1 at {EXTEND_BASE} cached, tok/s",
              **{f"prefill_{n}": f"prefill {n} tokens, tok/s" for n in setup.lengths},
              "extend": f"+{EXTEND_NEW} on cached {EXTEND_BASE}, ms"}

    # every column's measurements first; then `repeat` rounds run every measurement of
    # every column of every table in turn, so a slower spell of the shared machine falls
    # on all columns alike; the tables show medians
    embedded: dict[str, Column] = {}
    for fmt in [w for w in args.weights.split(",") if w]:
        embedded[f"flare {fmt}" + ("*" if fmt == default_fmt else "")] = flare_column(
            ckpt, fmt, setup)
    if not args.skip_transformers:
        embedded["transformers fp32"] = transformers_column(ckpt, setup)
    if not args.skip_llama_cpp:
        # the GGUF's tensor bytes per parameter (Q4_1 layers, Q8_0 embedding / output)
        embedded["llama.cpp"] = llama_cpp_column(gguf, cfg, setup)
    del ckpt
    groups: list[tuple[str, dict[str, Column]] | str] = [
        (f"embedded model {gguf.name} ({gguf.stat().st_size / MIB:.1f} MiB)", embedded)]
    groups += [kquant_group(gguf, kind, setup, not args.skip_llama_cpp) for kind in kinds]

    # as `flare serve` does once its engine is up: no full collection walks the models
    # (without it a collection landed in a batch-8 decode now and then: 7% of a profile)
    freeze_startup_objects()
    measures = {(g, name): col.measures for g, group in enumerate(groups)
                if not isinstance(group, str) for name, col in group[1].items()}
    samples = interleaved_samples(measures, rows, repeat)
    figures: dict[int, dict[str, dict[str, float]]] = {}
    for (g, name, row), values in ((k[0] + (k[1],), v) for k, v in samples.items()):
        figures.setdefault(g, {}).setdefault(name, {})[row] = statistics.median(values)
    del measures, samples
    for group in groups:  # the engines and models go: the limits need the cores and caches
        for col in ([] if isinstance(group, str) else group[1].values()):
            if not isinstance(col.measures, str):
                col.measures = {}
    gc.unfreeze()
    gc.collect()  # before the session's servers start

    def share(col: Column, row: str, value: float) -> float:
        prompt = EXTEND_BASE if row == "decode_long" else SHORT_PROMPT
        return figure_share(cfg, limits, col, row, value, prompt + n_dec // 2)

    print(f"\nmedians of {repeat} rounds; load average {os.getloadavg()[0]:.1f} at the end; "
          f"* = the file's default format")
    for g, group in enumerate(groups):
        if isinstance(group, str):
            print(f"\n{group}")
        else:
            print_table(group[0], group[1], figures.get(g, {}), rows, labels, share)
    print("\n(%) = share of the read bandwidth for decode; for prefill, of the time a token "
          "takes at the int8 kernel peak (int8-activation columns: q4x8, q8x8, kx8, "
          "llama.cpp) or the fp32 peak (the others) for its linear FLOPs, plus its "
          "attention at the fp32 peak")
    print("decode bytes per parameter (weights held): " + "; ".join(
        f"{group[0].split(' (')[0].split()[-1]}: " + ", ".join(
            f"{name} {col.bytes_per_param:.2f}"
            + (f" ({col.held_bytes / MIB:.1f} MiB)" if col.held_bytes else "")
            for name, col in group[1].items())
        for group in groups if not isinstance(group, str))
          + "; llama.cpp has no 8-stream figure (its binding runs one sequence)")
    sys.stdout.flush()
    if not args.skip_session:
        print("\n" + session_line(gguf, default_fmt, args.threads, turns, args.session_budget))


if __name__ == "__main__":
    main()
