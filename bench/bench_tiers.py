"""Tiered state: restore from the host and disk tiers vs recompute, and TTFT after a restart.

For endpoint states of 1k, 4k and the plan's maximum tokens of the embedded model (fp32,
2 threads), one run prints:
- TTFT of a request that extends the state by 8 tokens when the state is recomputed
  (prefix cache off), held on the device, restored from the host tier, restored from the
  disk tier (after an engine restart: a new engine on the same state folder);
- the restore's ratio to recompute, and bytes of state per token.
Figures, not pass/fail. The disk read may come from the OS page cache (no root needed to
run this): the line says whether dropping it worked.

Run: .venv/bin/python bench/bench_tiers.py [--lengths 1024,4096,8000] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from flare.loading.checkpoint import load_checkpoint
from flare.loading.embedded import embedded_model_path
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams

NEW_TOKENS = 8


def ttft_ms(engine: Engine, ids: list[int], rid: str) -> tuple[float, int]:
    """(TTFT in ms, cached tokens) of one greedy request of 1 token."""
    t0 = time.perf_counter_ns()
    out = engine.run_until_idle([GenerationRequest(
        rid, ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))])[rid][-1]
    return (time.perf_counter_ns() - t0) / 1e6, out.num_cached_tokens


def drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,8000")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    ckpt = load_checkpoint(embedded_model_path())
    plan = make_plan(ckpt.config, max_seq_len=8192, max_num_seqs=2, host_tier_bytes=2 << 30,
                     disk_tier_bytes=4 << 30)
    rng = random.Random(0)
    folder = Path(tempfile.mkdtemp(prefix="flare-bench-tiers-"))

    def engine(**kw) -> Engine:
        return Engine(ckpt.config, plan, ckpt.tensors, ckpt.tokenizer, namespace="bench", **kw)

    cold = engine(prefix_cache=False)
    print(f"embedded model, fp32, {args.threads} threads; +{NEW_TOKENS} new tokens per request")
    print(f"{'state tokens':>12} {'recompute ms':>13} {'device ms':>10} {'host ms':>9} "
          f"{'disk ms':>9} {'host/recomp':>11} {'disk/recomp':>11} {'bytes/token':>11}")
    try:
        for n in lengths:
            n = min(n, plan.max_seq_len - NEW_TOKENS - 2)
            state = [rng.randrange(100, 40000) for _ in range(n + 1)]
            ext = state + [rng.randrange(100, 40000) for _ in range(NEW_TOKENS)]
            recompute, _ = ttft_ms(cold, ext, "cold")
            warm = engine(host_tier_bytes=2 << 30, state_dir=folder / str(n))
            ttft_ms(warm, state, "fill")  # computes n tokens of state
            device, _ = ttft_ms(warm, ext, "device")
            warm.offload()
            host, cached_host = ttft_ms(warm, ext, "host")
            warm.offload()
            warm.tiers.flush()
            warm.stop()
            dropped = drop_page_cache()
            restarted = engine(host_tier_bytes=0, state_dir=folder / str(n))
            disk, cached_disk = ttft_ms(restarted, ext, "disk")
            restarted.stop()
            per_token = warm.layout.kv_bytes_per_token
            print(f"{n:>12,} {recompute:>13,.0f} {device:>10,.0f} {host:>9,.0f} {disk:>9,.0f} "
                  f"{host / recompute:>11.2f} {disk / recompute:>11.2f} {per_token:>11,}"
                  f"   (cached host {cached_host}, disk {cached_disk}; page cache "
                  f"{'dropped' if dropped else 'warm'})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("TTFT of the first turn after a restart: the 'disk ms' column (a new engine on the "
          "same state folder) vs 'recompute ms' (a new engine without one).")


if __name__ == "__main__":
    main()
