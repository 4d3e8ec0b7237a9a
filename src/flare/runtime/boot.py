"""Build a serving engine from a runtime package: the one place that turns what prepare
recorded (threads, pool sizes, measured speeds) into a running `Engine` with its tiers and
cost policy. `flare serve` calls `engine_from_package`; nothing here imports `flare.prepare`.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flare.package.reader import LoadedPackage, load_package
from flare.runtime.engine import Engine
from flare.state.admission import DEFAULT_BYTES_PER_S, CostPolicy


def usable_cores() -> tuple[int, str]:
    """Cores this process may run on now (container and taskset limits, not the host's
    count), and the expression that measured it (recorded in a manifest's tuning)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)), "len(os.sched_getaffinity(0))"
    return os.cpu_count() or 1, "os.cpu_count()"


def serving_threads(tuning: Mapping[str, Any], requested: int | None = None) -> int:
    """Threads of torch's intra-op pool for serving a CPU package.

    `requested` when given (flare serve --threads); else the package's tuning
    `torch_num_threads`, at most the cores this process may run on now (the package may
    have been prepared where more cores were free). More threads than cores makes OpenMP
    threads wait on each other at every barrier: decode steps 10-50x slower were seen with
    two threads on two busy cores.
    """
    if requested is not None:
        return requested
    cores, _ = usable_cores()
    return max(1, min(int(tuning.get("torch_num_threads") or cores), cores))


def cost_policy_from_tuning(tuning: dict[str, Any], factor: float = 0.5) -> CostPolicy:
    """A `CostPolicy` from a manifest's tuning section: the slowest measured prefill speed
    (the longest probe) and the measured tier speeds; defaults where nothing was measured.

    Raises:
        ValueError: `factor` is negative.
    """
    if factor < 0:
        raise ValueError(f"restore cost factor must be >= 0, got {factor}")
    prefill = tuning.get("prefill_tokens_per_s") or {}
    speeds = dict(DEFAULT_BYTES_PER_S)
    speeds.update({k: float(v) for k, v in (tuning.get("transfer_bytes_per_s") or {}).items()})
    if prefill:
        return CostPolicy(factor, min(float(v) for v in prefill.values()), speeds)
    return CostPolicy(factor=factor, bytes_per_s=speeds)


def engine_from_package(package_path: str | Path, *, device: str = "cpu",
                        threads: int | None = None, restore_cost_factor: float = 0.5,
                        cuda_graphs: bool = True, save_state_on_shutdown: bool = False,
                        **engine_kwargs: Any) -> tuple[LoadedPackage, Engine]:
    """Load and check a package, then build its engine as `flare serve` runs it.

    Sets torch's intra-op threads for a CPU package (`serving_threads`), builds the restore
    cost policy from the manifest's tuning (`cost_policy_from_tuning`), and allocates every
    pool through `Engine.from_package`.

    Args:
        package_path: folder written by `flare prepare`.
        device: "cpu" or "cuda[:N]"; its device class must be the package's.
        threads: intra-op threads (None: the package's tuning, at most the usable cores).
        restore_cost_factor: see `CostPolicy.factor`.
        cuda_graphs: on CUDA, replay the package's graph plan.
        save_state_on_shutdown: write every cached state to the disk tier when stopped.
        **engine_kwargs: `Engine` options (prefix_cache, state_dir, max_pinned_pages, ...).

    Returns:
        (the loaded package, the engine; not yet started).

    Raises:
        PackageError: as `load_package`. ValueError: a negative cost factor.
    """
    package = load_package(Path(package_path), device=device)
    if package.manifest.device_class == "cpu" or threads is not None:
        torch.set_num_threads(serving_threads(package.manifest.tuning, threads))
    policy = cost_policy_from_tuning(package.manifest.tuning, restore_cost_factor)
    engine = Engine.from_package(package, cuda_graphs=cuda_graphs, cost_policy=policy,
                                 **engine_kwargs)
    engine.save_state_on_stop = save_state_on_shutdown
    return package, engine


def freeze_startup_objects() -> int:
    """After one full collection, moves every object alive now out of the cyclic garbage
    collector's generations (`gc.freeze`, Python >= 3.7), so that no later collection
    walks them; returns how many were frozen.

    What a server holds at start-up (the package's tensors and their Python wrappers, the
    tokenizer, the pools' bookkeeping) lives as long as it does, yet every full
    collection walked all of it: 126 ms on the embedded package (about 312,000 objects,
    2-core Xeon), a pause in every stream's next token. Frozen, collections walk only
    what requests allocate. vLLM's engine freezes the same way once it has started.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
