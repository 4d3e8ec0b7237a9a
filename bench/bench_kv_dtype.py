"""A float32 and a float16 KV pool side by side in one process: decode step times.

Decode over a long context is bound by the K/V bytes each step streams (the embedded
model reads 46 KiB of float32 K/V a cached token a step: 94 MB at 2,048 tokens, about as
much as its q4x8 weights), so the plan's `kv_dtype=float16` halves that part. This runs two
engines of the embedded model in `q4x8`, one per pool dtype, each decoding `--batch`
sequences after a prompt of each length of `--prompts`, round after round with the two
alternating (the machine drifts more between runs than the change is worth). Prints each
pool's minimum and median mean step and the speed-up. A figure, not pass/fail.

    PYTHONPATH=src .venv/bin/python bench/bench_kv_dtype.py [--prompts 128,512,2048]
        [--batch 1] [--steps 32] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from native_share import TimedNative, decode_steps

from flare.loading.checkpoint import load_checkpoint
from flare.loading.embedded import embedded_model_path
from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.engine import Engine

POOLS = ("float32", "float16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="128,512,2048",
                    help="prompt lengths, comma-separated (tokens)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(embedded_model_path())
    tensors = convert_tensors(ckpt.tensors, "q4x8", ckpt.blocks)
    engines = {}
    for kv in POOLS:
        plan = make_plan(ckpt.config, max_seq_len=max(prompts) + args.steps + 16,
                         max_num_seqs=args.batch, kv_dtype=kv,
                         max_batch_tokens=max(512, args.batch * 64))
        engine = Engine(ckpt.config, plan, tensors, ckpt.tokenizer, prefix_cache=False)
        if engine.model.native is None:
            raise SystemExit("no native call for this model (is FLARE_NATIVE_LAYERS=0 set?)")
        timed = engine.model.native = TimedNative(engine.model.native)
        engines[kv] = (engine, timed)
    print(f"{args.threads} threads, {args.batch} sequences, {args.steps} decode steps, "
          f"{args.rounds} rounds alternated; embedded model, q4x8 weights")
    print(f"{'prompt':>7} {'pool':>8} {'min ms':>8} {'median':>8} {'tok/s':>7}")
    for n in prompts:
        prompt = list(range(100, 100 + n))
        means: dict[str, list[float]] = {kv: [] for kv in POOLS}
        for engine, timed in engines.values():  # warm-up
            decode_steps(engine, timed, prompt[:64], 4, args.batch)
        for r in range(args.rounds):
            for kv in POOLS[::-1] if r % 2 else POOLS:
                engine, timed = engines[kv]
                wall, _ = decode_steps(engine, timed, prompt, args.steps, args.batch)
                means[kv].append(1e3 * sum(wall) / len(wall))
        for kv in POOLS:
            best = min(means[kv])
            print(f"{n:>7} {kv:>8} {best:>8.2f} {statistics.median(means[kv]):>8.2f} "
                  f"{1e3 * args.batch / best:>7.1f}")
        print(f"{'':>7} {'speed-up':>8} {min(means['float32']) / min(means['float16']):>8.2f}x")


if __name__ == "__main__":
    main()
