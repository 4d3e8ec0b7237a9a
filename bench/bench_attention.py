"""Attention over a cached context: Flare's native kernel against the machine's fp32 peak.

An agent's turn adds about a hundred tokens to a context of thousands, and on a CPU the
prefill of those tokens spends most of its time attending over the cached keys (issue 17:
about two thirds of a turn at 2K cached tokens). This times `cached_attention` alone, the
routine every query row runs (prefill chunk or decode token alike), over a paged KV cache
whose pages lie in random order, as the pool hands them out:

- a prefill chunk of `--chunk` rows after C cached tokens, for each C of `--contexts`;
- a decode step of `--streams` sequences of one token each, at the largest C.

Each figure is the best of several rounds (`machine_limits.best_rate`) and its share of
torch.mm's fp32 peak at the same threads, at 1 thread and at `--threads`. The shapes are
the embedded model's (SmolLM2-135M: 9 query heads, 3 KV heads, head size 64). A figure,
not pass/fail.

    PYTHONPATH=src .venv/bin/python bench/bench_attention.py [--threads 2]
        [--contexts 512,2048,4096] [--chunk 128] [--streams 8] [--kv-dtype float16]
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
from machine_limits import at_threads, best_rate, fp32_peak_gflops

from flare.kernels import fused_ops

PAGE = 16


def attention_flops(rows: int, context: int, heads: int, head_dim: int) -> float:
    """FLOPs of causal attention for `rows` new query rows after `context` cached tokens:
    row r attends context + r + 1 keys; each (row, key, head) pair costs a dot product for
    its score and a multiply-add into the output, 2 x 2 x head_dim FLOPs."""
    pairs = rows * context + rows * (rows + 1) // 2
    return 4.0 * pairs * heads * head_dim


def _paged_gather(batch: int, length: int, num_slots: int, gen: torch.Generator
                  ) -> torch.Tensor:
    """int64 [batch, length]: each sequence's cache slots, whole pages in random order."""
    pages = torch.randperm(num_slots // PAGE, generator=gen)
    per_seq = -(-length // PAGE)
    rows = []
    for b in range(batch):
        mine = pages[b * per_seq:(b + 1) * per_seq]
        rows.append((mine[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:length])
    return torch.stack(rows).contiguous()


def time_attention(rows: int, context: int, batch: int, heads: int, kv_heads: int,
                   head_dim: int, kv_dtype: torch.dtype = torch.float32) -> float:
    """Seconds of one `cached_attention` call at its best: `batch` sequences of `rows` new
    rows each after `context` cached tokens (torch's current threads), the cache in
    `kv_dtype` (float32 or float16, as a plan's kv_dtype)."""
    ops = fused_ops()
    gen = torch.Generator().manual_seed(0)
    length = context + rows
    num_slots = (batch * -(-length // PAGE) + 1) * PAGE
    k = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(kv_dtype)
    q = torch.randn(batch * rows, heads, head_dim, generator=gen)
    gather = _paged_gather(batch, length, num_slots, gen)
    lengths = torch.full((batch,), length, dtype=torch.int64)
    scale = head_dim ** -0.5
    return 1.0 / best_rate(1.0, lambda: ops.cached_attention(q, k, v, gather, lengths, rows,
                                                             scale))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-dtype", choices=("float32", "float16"), default="float16",
                    help="the cache's dtype (float16: the int8 formats' default)")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    shape = (args.heads, args.kv_heads, args.head_dim)
    kv_dtype = getattr(torch, args.kv_dtype)
    for threads in sorted({1, args.threads}):
        peak = at_threads(threads, fp32_peak_gflops)
        print(f"{threads} thread(s): fp32 peak (torch.mm) {peak:.1f} GFLOP/s")
        cases = [(f"prefill {args.chunk} rows after {c}", args.chunk, c, 1) for c in contexts]
        cases.append((f"decode {args.streams} streams at {contexts[-1]}", 1, contexts[-1],
                      args.streams))
        for label, rows, context, batch in cases:
            seconds = at_threads(threads, functools.partial(time_attention, rows, context,
                                                            batch, *shape, kv_dtype))
            gflops = batch * attention_flops(rows, context, args.heads, args.head_dim) / 1e9
            rate = gflops / seconds
            # K and V of every cached key, read once a call: what bounds a decode step
            kv_bytes = (2 * batch * (context + rows) * args.kv_heads * args.head_dim
                        * kv_dtype.itemsize)
            print(f"  {label}: {seconds * 1e3:.3f} ms a layer, {rate:.1f} GFLOP/s "
                  f"({rate / peak:.0%} of the fp32 peak), K/V read at "
                  f"{kv_bytes / seconds / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
