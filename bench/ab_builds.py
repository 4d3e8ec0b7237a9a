"""Two builds of Flare's kernel module side by side in one process: decode step times.

On a noisy machine two runs of a benchmark minutes apart differ by more than most kernel
changes do, so a change is judged here by alternating two engines in the same process:
one built on each `.so` (the module's own file, e.g. an older build still in
~/.cache/flare/kernels), each decoding `--batch` sequences of the embedded model in
`q4x8` (`--model`: a dense GGUF in its default format) for `--steps` steps, round after
round. Prints each build's minimum and median mean step over the rounds. A figure, not
pass/fail. A build with `set_zmm_min_rows` (4ea88d0 on) runs with the width
`flare.kernels.register_width` measures for it here, as `flare.kernels.qgemm()` would.

    PYTHONPATH=src .venv/bin/python bench/ab_builds.py OLD.so NEW.so [--batch 1]
        [--steps 64] [--prompt 32] [--rounds 6] [--threads 2] [--kv-dtype float16]
        [--prefill 2048] [--model FILE.gguf]

With `--prefill N` it times prefill instead: one N-token prompt (fresh tokens each time,
no prefix cache) from its request to its first token, in the plan's chunks.

The module each engine's `DenseLayers` comes from is the one loaded for it: the linear,
attention and norm kernels of its native call are that build's. Kernel calls from Python
outside the native call (embedding, sampling) use the build loaded last, so put the build
whose Python-side ops you want second (a build older than `argmax_rows` samples with
torch.argmax). Each engine decodes once before the rounds, and the two swap places every
round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from native_share import TimedNative, decode_steps

from flare import kernels
from flare.kernels import register_width
from flare.kernels.probe import import_extension
from flare.loading.checkpoint import load_checkpoint
from flare.loading.embedded import embedded_model_path
from flare.models.quant import dense
from flare.models.quant.formats import default_kv_dtype, default_weight_format
from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs=2, type=Path, help="two kernel module .so files")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None,
                    help="a GGUF file, in its default weight format (default: the embedded "
                         "model in q4x8)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="time an N-token prompt's prefill instead of decode steps")
    ap.add_argument("--kv-dtype", choices=["float32", "float16"],
                    default=default_kv_dtype("q4x8", dtype="float32", device="cpu"),
                    help="KV pool dtype (default: q4x8's, as a prepared package has it)")
    args = ap.parse_args()
    if len({p.name.split(".")[0] for p in args.builds}) < 2:
        raise SystemExit("the two builds have one module name: Python would load it once")
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.model or embedded_model_path())
    weights = "q4x8" if args.model is None else default_weight_format(
        dtype="float32", device="cpu", recipe="llama", source=ckpt.source)
    tensors = convert_tensors(ckpt.tensors, weights, ckpt.blocks)
    plan = make_plan(ckpt.config, max_seq_len=max(4096, args.prefill + 64),
                     max_num_seqs=args.batch,
                     max_batch_tokens=max(512, args.batch * args.prompt),
                     kv_dtype=args.kv_dtype)
    runs = []
    for path in args.builds:
        kernels._MODULE = import_extension(path)  # what fused_ops() and the model see from here
        # builds from 4ea88d0 on have the setting (one that has no zmm path measures a tie)
        if hasattr(kernels._MODULE, "set_zmm_min_rows"):
            rows = register_width.choose(register_width.measure(kernels._MODULE))
            kernels._MODULE.set_zmm_min_rows(rows)
            print(f"{path.name}: two groups a zmm register from {rows} rows of x on")
        dense._DENSE = False  # dense_kernels() looks the module up again
        engine = Engine(ckpt.config, plan, tensors, ckpt.tokenizer, prefix_cache=False)
        if engine.model.native is None:
            raise SystemExit("no native call for this model (is FLARE_NATIVE_LAYERS=0 set?)")
        timed = engine.model.native = TimedNative(engine.model.native)
        runs.append((path, engine, timed, []))
    if args.prefill:
        for r in range(args.rounds + 1):  # round 0 warms up
            for _, engine, _timed, means in runs[::-1] if r % 2 else runs:
                ms = prefill_ms(engine, args.prefill, seed=r)
                if r:
                    means.append(ms)
        print(f"{args.threads} threads, prefill of {args.prefill} tokens "
              f"({plan.max_batch_tokens} a chunk), {args.rounds} rounds alternated")
        for path, _, _, means in runs:
            print(f"{path.name}: {min(means):.1f} ms min ({1e3 * args.prefill / min(means):.0f} "
                  f"tok/s), {statistics.median(means):.1f} median")
        return
    prompt = list(range(100, 100 + args.prompt))
    for _, engine, timed, _means in runs:  # warm-up
        decode_steps(engine, timed, prompt, 8, args.batch)
    for r in range(args.rounds):
        for _, engine, timed, means in runs[::-1] if r % 2 else runs:
            wall, _inside = decode_steps(engine, timed, prompt, args.steps, args.batch)
            means.append(1e3 * sum(wall) / len(wall))
    print(f"{args.threads} threads, {args.batch} sequences, {args.steps} decode steps after "
          f"a {args.prompt}-token prompt, {args.rounds} rounds alternated")
    for path, _, _, means in runs:
        print(f"{path.name}: step {min(means):.3f} ms min, {statistics.median(means):.3f} "
              "median")


def prefill_ms(engine: Engine, tokens: int, seed: int) -> float:
    """Milliseconds from adding a `tokens`-token prompt (random ids from `seed`) to its
    first token, the request then finished."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 40000, (tokens,), generator=g).tolist()
    t = time.perf_counter()
    engine.run_until_idle([GenerationRequest(f"p{seed}-{time.perf_counter_ns()}", prompt,
                                             SamplingParams(max_tokens=1, temperature=0))])
    return 1e3 * (time.perf_counter() - t)


if __name__ == "__main__":
    main()
