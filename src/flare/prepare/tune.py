"""Measurements `prepare` takes on the target machine for the restore cost policy.

Admission restores a state from the host or disk tier only when its estimated transfer
time is below a factor of the estimated prefill time of the tokens it replaces
(ARCHITECTURE.md, "Admission of a reuse"). Both estimates come from here:

- prefill throughput, tokens/s, by context length: the recipe's own forward over a
  throw-away engine (prefix cache off), one prompt per length, timed with
  `time.perf_counter_ns`;
- transfer bandwidth, bytes/s, per tier pair: host -> device (a tensor copy of
  `TRANSFER_PROBE_BYTES`) and disk -> host (a file of that size written, fsynced, then read
  back; the read may be served from the page cache, so it is an upper bound: say so in
  the manifest).

The results go into the manifest's tuning section; `flare.runtime.boot.cost_policy_from_tuning`
turns them back into a `CostPolicy` at serve time.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


TRANSFER_PROBE_BYTES = 32 << 20
PREFILL_PROBE_TOKENS = (128, 512)


def measure_prefill(config: Any, plan: Any, tensors: dict[str, torch.Tensor],
                    tokenizer: Any, lengths: tuple[int, ...] = PREFILL_PROBE_TOKENS
                    ) -> dict[str, float]:
    """Prefill tokens/s of the model for prompts of each length in `lengths` (those above
    `plan.max_seq_len - 1` are skipped). Returns {"<length>": tokens_per_s}."""
    from flare.runtime.engine import Engine
    from flare.runtime.request import GenerationRequest, SamplingParams

    longest = max([n for n in lengths if n < plan.max_seq_len], default=0)
    if not longest:
        return {}
    # a plan of one sequence: the probe must not allocate the whole served KV pool
    small = dataclasses.replace(
        plan, max_seq_len=longest + 1, max_num_seqs=1,
        num_pages=-(-(longest + 1) // plan.page_size),
        state_slots=1 if plan.state_slots else 0, checkpoint_slots=0,
        host_tier_bytes=0, disk_tier_bytes=0)
    engine = Engine(config, small, tensors, tokenizer, prefix_cache=False)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for n in lengths:
        if n >= plan.max_seq_len:
            continue
        ids = torch.randint(100, config.vocab_size, (n,), generator=gen).tolist()
        req = GenerationRequest(f"probe-{n}", ids, SamplingParams(max_tokens=1, temperature=0,
                                                                  ignore_eos=True))
        t0 = time.perf_counter_ns()
        engine.run_until_idle([req])
        out[str(n)] = n / max((time.perf_counter_ns() - t0) / 1e9, 1e-9)
    return out


def measure_transfers(folder: Path, nbytes: int = TRANSFER_PROBE_BYTES,
                      device: str = "cpu") -> dict[str, float]:
    """Bytes/s of a host -> device copy and of a disk -> host read of `nbytes` (a file
    written and fsynced in `folder`, then read back and deleted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src, device=device)
    dst.copy_(src)  # warm up allocation and page faults
    t0 = time.perf_counter_ns()
    dst.copy_(src)
    if dst.device.type == "cuda":
        torch.cuda.synchronize()
    host = nbytes / max((time.perf_counter_ns() - t0) / 1e9, 1e-9)
    data = src.numpy().tobytes()
    fd, name = tempfile.mkstemp(prefix=".flare-probe-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        t0 = time.perf_counter_ns()
        with open(name, "rb") as f:
            back = f.read()
        disk = len(back) / max((time.perf_counter_ns() - t0) / 1e9, 1e-9)
    finally:
        os.unlink(name)
    return {"host": host, "disk": disk}


def restore_cost_inputs(config: Any, plan: Any, tensors: dict[str, torch.Tensor],
                        tokenizer: Any, folder: Path, device: str = "cpu") -> dict[str, Any]:
    """The manifest's tuning entries for the cost policy (see the module docstring);
    prefill is measured for CPU packages only (tensors live on the CPU at prepare)."""
    out: dict[str, Any] = {
        "transfer_bytes_per_s": measure_transfers(folder, device=device),
        "transfer_note": "disk read measured right after its write: may be page-cached",
    }
    if torch.device(device).type == "cpu":
        out["prefill_tokens_per_s"] = measure_prefill(config, plan, tensors, tokenizer)
    return out
