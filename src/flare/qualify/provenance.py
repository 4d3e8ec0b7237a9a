"""Provenance of a run: flare version and git revision, machine, package, corpus."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import flare

_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_ONLY_RECIPES = {"llama"}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def git_revision() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout flare runs from; (None, None) outside a git checkout."""
    root = Path(flare.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None, None
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return None, None
        st = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                             "--untracked-files=no"], capture_output=True, text=True, timeout=30)
        dirty = bool(st.stdout.strip()) if st.returncode == 0 else None
        return rev.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def machine() -> dict[str, Any]:
    """A summary of the machine the harness runs on (no host name, no user)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = None
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or None, "python": platform.python_version(),
            "cpus_available": cpus, "memory_bytes": mem, "torch": torch_version,
            "httpx": metadata.version("httpx")}


def package_info(package: Path) -> dict[str, Any]:
    """What the packet records about a runtime package: identity, plan, memory report and
    the KV layout the verifier needs to check the KV pool's bytes."""
    from flare.package.contract import MANIFEST_NAME, read_manifest

    m = read_manifest(package)
    cfg = m.config
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else None)
    kv_layout = None
    layout = getattr(m, "state_layout", None) or {}
    kv_dtype = m.plan.get("kv_dtype") or m.plan.get("dtype")  # the pool's own, if set
    if layout.get("num_kv_layers") and kv_dtype in _ELEM_BYTES:
        # the manifest's own state layout: hybrids keep KV in their attention layers only
        kv_layout = {"kv_only": m.recipe in KV_ONLY_RECIPES and not layout.get("layer_states"),
                     "num_kv_layers": layout["num_kv_layers"],
                     "num_kv_heads": layout["num_kv_heads"],
                     "head_dim": layout["head_dim"],
                     "elem_bytes": _ELEM_BYTES[kv_dtype]}
    elif cfg.get("num_hidden_layers") and head_dim and kv_dtype in _ELEM_BYTES:
        kv_layout = {"kv_only": m.recipe in KV_ONLY_RECIPES,
                     "num_kv_layers": cfg["num_hidden_layers"],
                     "num_kv_heads": cfg.get("num_key_value_heads") or heads,
                     "head_dim": head_dim,
                     "elem_bytes": _ELEM_BYTES[kv_dtype]}
    return {
        "identity": {"package_id": m.package_id,
                     "manifest_sha256": sha256_file(Path(package) / MANIFEST_NAME),
                     "model_name": m.model_name, "recipe": m.recipe},
        "plan": dict(m.plan),
        "memory_report": dict(m.memory),
        "kv_layout": kv_layout,
    }
