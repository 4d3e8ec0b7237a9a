"""K-quant GGUFs made from the embedded model: Flare's default format beside llama.cpp.

Writes Q4_K_M and Q6_K files from the embedded Q4_1 GGUF with llama.cpp's own quantizer
(`llama_cpp.llama_model_quantize`, requantizing: the values are not the original model's,
the layouts are what hub files hold), unless they are already in --out-dir, then for
each file prints: the default weight format and how each tensor type is held, the
weights held in memory against the file's size, and decode tokens/s at batch 1 and at 8
streams and prefill tokens/s at 512 (and 2,048) tokens for Flare (the file's own
blocks, prefix cache off) and llama.cpp (llama-cpp-python, same file, same threads).
`--repeat` rounds run every measurement in turn; the table shows medians. Figures drift
on a shared machine: compare the columns of one run, and say the machine's load.

The embedded model's hidden size (576) is not a multiple of 256, so llama.cpp's
quantizer stores the tensors with 576-wide rows (q/k/v, gate/up, the embedding) in its
fallback types (Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K); only down_proj (1,536
wide) keeps K-quant blocks (Q4_K_M: 16 Q4_K, 14 Q6_K; Q5_K_M: 16 Q5_K, 14 Q6_K). With
`--repeat 0` only the formats and the memory lines are printed (measured: Q5_K_M 106.9
MiB file, 108.4 MiB held in kx8; Q4_K_M 100.6 MiB, 106.7 MiB held).

    .venv/bin/python bench/bench_kquant.py [--threads 2] [--repeat 3] [--quick]
        [--types Q4_K_M,Q6_K] [--out-dir DIR] [--skip-llama-cpp]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import _prompt, flare_decode, flare_prefill
from kquant_files import default_out_dir, kquant_file
from peers import SHORT_PROMPT, interleaved_samples, llama_cpp_measures

from flare.loading.checkpoint import load_checkpoint
from flare.loading.embedded import embedded_model_path
from flare.models.quant.formats import default_kv_dtype, default_weight_format
from flare.models.quant.sizes import serving_weight_bytes
from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="prefill 512 only, 24 tokens")
    ap.add_argument("--types", default="Q4_K_M,Q6_K")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where the files are written (default <flare cache>/bench-kquant)")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n_dec = 24 if args.quick else args.decode_tokens
    lengths = (512,) if args.quick else (512, 2048)
    out_dir = args.out_dir or default_out_dir()
    src = embedded_model_path()
    rows = ["decode_b1", "decode_b8"] + [f"prefill_{n}" for n in lengths]
    labels = {"decode_b1": "decode batch 1, tok/s", "decode_b8": "decode 8 streams, tok/s",
              **{f"prefill_{n}": f"prefill {n} tokens, tok/s" for n in lengths}}
    print(f"{args.threads} threads; torch {torch.__version__}; load average "
          f"{os.getloadavg()[0]:.1f} at start; medians of {args.repeat} rounds")
    for kind in [t for t in args.types.split(",") if t]:
        path = kquant_file(src, kind, args.threads, out_dir)
        if isinstance(path, str):
            print(f"{kind}: not measured ({path})")
            continue
        ckpt = load_checkpoint(path)
        fmt = default_weight_format(dtype="float32", device="cpu", recipe="llama",
                                    source=ckpt.source)
        stored = convert_tensors(ckpt.tensors, fmt, ckpt.blocks)
        held = serving_weight_bytes(stored, fmt, ckpt.config.tie_word_embeddings)
        types = Counter(b.kind for b in ckpt.blocks.values())
        plan = make_plan(ckpt.config, max_seq_len=4096, max_num_seqs=8, max_batch_tokens=512,
                         kv_dtype=default_kv_dtype(fmt, dtype="float32", device="cpu"))
        engine = Engine(ckpt.config, plan, stored, ckpt.tokenizer, prefix_cache=False)

        def ids_of(n: int) -> list[int]:
            return _prompt(ckpt.tokenizer, n)

        short = ids_of(SHORT_PROMPT)
        flare_decode(engine, short, 1, 8)  # warm-up
        measures = {f"flare {fmt}": {
            "decode_b1": functools.partial(flare_decode, engine, short, 1, n_dec),
            "decode_b8": functools.partial(flare_decode, engine, short, 8, n_dec),
            **{f"prefill_{n}": functools.partial(flare_prefill, engine, ids_of(n))
               for n in lengths}}}
        if not args.skip_llama_cpp:
            measures["llama.cpp"] = llama_cpp_measures(path, ids_of, args.threads, n_dec,
                                                       lengths)
        samples = interleaved_samples(measures, rows, args.repeat)
        file_bytes = path.stat().st_size
        print(f"\n{path.name} ({file_bytes / 2**20:.1f} MiB; 2-D tensors "
              + ", ".join(f"{n} {t}" for t, n in sorted(types.items())) + f"): default "
              f"format {fmt}, weights held {held / 2**20:.1f} MiB = "
              f"{held / file_bytes:.2f}x the file")
        print(f"{'figure':30}" + "".join(f"{c:>16}" for c in measures))
        for row in rows:
            cells = [f"{statistics.median(samples[c, row]):.1f}" if (c, row) in samples
                     else "-" for c in measures]
            print(f"{labels[row]:30}" + "".join(f"{c:>16}" for c in cells))
        for col, m in measures.items():
            if isinstance(m, str):
                print(f"{col}: {m}")
        del engine


if __name__ == "__main__":
    main()
