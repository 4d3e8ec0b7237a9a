"""The share of a decode step spent outside the native call (issue 17, item 3).

The embedded model in `q4x8` (the file's own blocks, as a default package holds them)
decodes one sequence (or `--batch` of them together), one `engine.step()` at a time. Each step's wall clock is set against
the time spent inside the model's native call (`DenseLayers.forward` / `forward_logits`,
timed around the call from Python, so pybind's argument conversion counts as inside):
the rest is Python (scheduler, metadata, sampling, outputs) and whatever kernels run
outside the call (the output layer where the call lacks it). A figure, not pass/fail.

    PYTHONPATH=src .venv/bin/python bench/native_share.py [--threads 1] [--steps 200]
        [--repeat 3] [--prompt 64] [--batch 1]

Prints, per repeat, the steps' total and median ms, the native call's, and the share
outside it (total outside / total step), then the best repeat (lowest share).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from flare.loading.checkpoint import load_checkpoint
from flare.loading.embedded import embedded_model_path
from flare.models.quant.formats import default_kv_dtype
from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.boot import freeze_startup_objects
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams


class TimedNative:
    """Wraps a `DenseLayers`: its step calls add their wall seconds to `seconds`; every
    other attribute is the wrapped object's."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)

    def _timed(self, fn: Any, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t

    def forward(self, *args: Any) -> Any:
        return self._timed(self._native.forward, *args)

    def forward_logits(self, *args: Any) -> Any:
        return self._timed(self._native.forward_logits, *args)


def decode_steps(engine: Engine, timed: TimedNative, prompt: list[int], steps: int,
                 batch: int = 1) -> tuple[list[float], list[float]]:
    """`batch` requests of `prompt` run to their first tokens, then `steps` decode steps
    of all of them together: each step's wall seconds and the native call's within it."""
    for i in range(batch):
        engine.add_request(GenerationRequest(
            f"r{i}-{time.perf_counter_ns()}", prompt,
            SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)))
    started = 0
    while started < batch:  # prefill (one or more chunks) up to every first token
        engine.step()
        started = sum(s.num_computed >= len(prompt) for s in engine.scheduler.running)
    wall, inside = [], []
    for _ in range(steps):
        before = timed.seconds
        t = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t)
        inside.append(timed.seconds - before)
    while engine.scheduler.has_work():  # finish the request
        engine.step()
    return wall, inside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(embedded_model_path())
    plan = make_plan(ckpt.config, max_seq_len=1024, max_num_seqs=args.batch,
                     max_batch_tokens=max(512, args.batch * args.prompt),
                     kv_dtype=default_kv_dtype("q4x8", dtype="float32", device="cpu"))
    engine = Engine(ckpt.config, plan, convert_tensors(ckpt.tensors, "q4x8", ckpt.blocks),
                    ckpt.tokenizer, prefix_cache=False)
    if engine.model.native is None:
        raise SystemExit("no native call for this model (is FLARE_NATIVE_LAYERS=0 set?)")
    timed = engine.model.native = TimedNative(engine.model.native)
    freeze_startup_objects()  # as `flare serve` does: no full collection walks the model
    prompt = list(range(100, 100 + args.prompt))
    decode_steps(engine, timed, prompt, 8, args.batch)  # warm-up
    print(f"threads {args.threads}, {args.steps} decode steps of {args.batch} sequences "
          f"after a {args.prompt}-token prompt; lm_head in the native call: {getattr(timed._native, 'has_lm_head', False)}")
    shares = []
    for r in range(args.repeat):
        wall, inside = decode_steps(engine, timed, prompt, args.steps, args.batch)
        share = 1 - sum(inside) / sum(wall)
        shares.append(share)
        print(f"repeat {r + 1}: step {1e3 * sum(wall) / len(wall):.3f} ms mean, "
              f"{1e3 * statistics.median(wall):.3f} median; native call "
              f"{1e3 * sum(inside) / len(inside):.3f} ms mean, "
              f"{1e3 * statistics.median(inside):.3f} median; outside "
              f"{1e3 * (sum(wall) - sum(inside)) / len(wall):.3f} ms = {100 * share:.1f}%")
    print(f"best repeat: {100 * min(shares):.1f}% of a batch-{args.batch} step outside the "
          "native call")


if __name__ == "__main__":
    main()
