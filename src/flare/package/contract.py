"""The preparation contract: what a runtime package promises, and the checks serve runs on it.

A package is a folder holding `manifest.json` plus payload files (weights, tokenizer).
The manifest names the ABI and contract versions it was written for, the payload files
with their sizes and SHA-256 digests, and `package_id`, a digest over the payload
entries. `check_package` refuses a package that this build cannot serve, with a message
that names the expected and the found value.

Only portable facts go into the manifest: never pointers, CUDA graph handles, streams or
pool slot indices; serve re-creates those from the capacity plan.

This module stays light (hashlib, json, pydantic); torch is imported only to learn which
devices the machine has.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

# Bump when the meaning of the prepared weights or plan changes for the runtime
# (layout of tensors, kernels that read them): an old package is then refused.
# 2: the 2-D weights of a `llama` package may be float16 under a float32 serving dtype
#    (weight format `fp16`, tuning["weights"]), run by fbgemm's fp16 GEMM.
# 3: weight format `q4`: 4-bit / 8-bit block parts under suffixed tensor names, run by
#    Flare's own kernel (flare.kernels); an older runtime would miss those tensors.
# 4: weight format `q4x8`: q4/q8 blocks in an 8-row interleaved layout with float16
#    scales under their own suffixes, run with int8 activations (flare.kernels qdot8.cpp).
# 5: exact by default: one fixed-order attention routine, row-invariant dense kernels for
#    `full` / `fp16`, a sequential gated delta rule for hybrids; the default format of a
#    Q4_1 GGUF is `q4x8` (source["weight_types"]). Older packages were chosen and
#    measured under the old defaults.
# 6: a GGUF's own blocks: weight format `q8x8` (every 2-D weight Q8_0 in the interleaved
#    layout), Q4_0 layers kept as `q4x8` blocks, and a `q4x8`/`q8x8` token embedding that
#    is a `Q4x8Weight` (read by a lookup older runtimes lack) or float16/float32.
# 7: weight format `kx8`: a GGUF's Q4_K and Q6_K blocks as stored under their own
#    suffixes (`.q4kx8_*`, `.q6kx8_*`), run by new int8-activation kernels (qdot8.cpp),
#    Q5_0 as q8x8 blocks, q/k/v of two kinds stacked; the default for K-quant files,
#    which older runtimes served as `fp16`.
# 8: `kx8` holds Q5_0, Q5_1 and Q5_K blocks as stored (5 bits a value) under new
#    suffixes (`.q5x8_*`, `.q5kx8_*`), run by new kernels (q5x8_linear, q5kx8_linear);
#    Q5_0 is no longer q8x8 blocks there, and Q5_K_M / Q5_1 files default to `kx8`.
# 9: Q4_0 (`q4x8`) and Q5_0 (`kx8`) weights hold no mins part (an empty float16 [N, 0]
#    `.q4x8_mins` / `.q5x8_mins`): the kernels and lookups compute -8d / -16d; an older
#    runtime would accept such a package and then fail on its first Q4_0 / Q5_0 call.
EXECUTION_ABI: int = 9
# Bump when the package format (manifest fields, payload files) changes.
# 2: `state_layout` in the manifest; state slots and checkpoints in the plan; state pool
#    bytes in the memory report; hybrid recipes' config is their original config dict.
PREPARED_CONTRACT: int = 2

MANIFEST_NAME = "manifest.json"
_CHUNK = 8 << 20


class PackageError(ValueError):
    """A runtime package this build refuses to serve; the message names expected and found."""


class PayloadFile(BaseModel):
    """One payload file: its SHA-256 (hex) and size in bytes."""

    model_config = ConfigDict(extra="forbid")

    sha256: str
    bytes: int


class Manifest(BaseModel):
    """`manifest.json` of a runtime package.

    Attributes:
        execution_abi: `EXECUTION_ABI` of the flare that wrote it.
        prepared_contract: `PREPARED_CONTRACT` of the flare that wrote it.
        package_id: `payload_id(payload)`, SHA-256 hex over the payload entries.
        model_name: display name, e.g. "SmolLM2-135M-Instruct".
        recipe / recipe_version: the recipe that runs it (see `flare.models.recipe`).
        source: identity of the checkpoint it came from: format, file name, per-file
            sha256 and bytes (`Checkpoint.source`).
        config: the model config as a transformers dict (`ModelConfig.to_hf()`: rebuilt
            from the dense fields for the `llama` recipe, the checkpoint's own
            `config.json` dict for hybrid recipes).
        state_layout: the recipe's `StateLayout.describe()` at the plan's page size and
            dtype (KV layers, each hybrid layer's conv/recurrent state shapes and dtypes,
            bytes per state slot). Serve recomputes it and refuses a package whose layout
            differs from what its recipe computes.
        dtype: serving dtype name of weights and KV pool ("float32", ...).
        device_class: "cpu" or "cuda:<major>.<minor>" (compute capability).
        plan: `CapacityPlan.to_dict()`.
        memory: `MemoryReport.to_dict()` (bytes).
        tuning: choices made at prepare time (threads, batch token budget, weight format
            "weights": "full", "fp16", "q4", "q4x8", "q8x8" or "kx8" (`flare.models.quant`),
            ...).
        graph_capture: what serve captures at start-up; {"enabled": False, "reason": ...}
            when nothing (CPU, hybrid recipes), else {"enabled": True, "batch_sizes",
            "context_pages", "attention"} (`flare.runtime.cuda_graphs.GraphPlan`).
        flare_version / torch_version: versions that prepared it.
        created_at: ISO 8601 UTC time of preparation.
        payload: file name (relative, POSIX) -> PayloadFile. `manifest.json` is not in it.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    execution_abi: int
    prepared_contract: int
    package_id: str
    model_name: str
    recipe: str
    recipe_version: int
    source: dict[str, Any]
    config: dict[str, Any]
    state_layout: dict[str, Any]
    dtype: str
    device_class: str
    plan: dict[str, Any]
    memory: dict[str, Any]
    tuning: dict[str, Any]
    graph_capture: dict[str, Any]
    flare_version: str
    torch_version: str
    created_at: str
    payload: dict[str, PayloadFile]

    def write(self, folder: Path) -> Path:
        """Write `folder/manifest.json` (UTF-8, sorted keys, indented); returns its path."""
        path = Path(folder) / MANIFEST_NAME
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n",
                        encoding="utf-8")
        return path


def sha256_file(path: Path) -> str:
    """SHA-256 hex digest of a file's bytes, read in 8 MiB chunks.

    Raises:
        FileNotFoundError / OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """{"sha256": hex, "bytes": size} of one file."""
    path = Path(path)
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def payload_id(payload: dict[str, Any]) -> str:
    """The package id: SHA-256 hex over "<name>\\0<sha256>\\n" for each payload file, names
    sorted. Entries may be `PayloadFile` or {"sha256": ...} dicts."""
    h = hashlib.sha256()
    for name in sorted(payload):
        entry = payload[name]
        digest = entry.sha256 if isinstance(entry, PayloadFile) else entry["sha256"]
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def scan_payload(folder: Path) -> dict[str, dict[str, Any]]:
    """Hash every regular file under `folder` except `manifest.json`.

    Returns: relative POSIX name -> {"sha256", "bytes"}.
    """
    folder = Path(folder)
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST_NAME:
            out[p.relative_to(folder).as_posix()] = file_entry(p)
    return out


def device_class_of(device: str) -> str:
    """The device class serving on `device` means: "cpu", or "cuda:<major>.<minor>".

    Raises:
        PackageError: a CUDA device on a machine without CUDA, or an unknown device kind.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PackageError(f"device {device!r} requested but this machine has no CUDA device")
        major, minor = torch.cuda.get_device_capability(dev)
        return f"cuda:{major}.{minor}"
    raise PackageError(f"device {device!r}: unsupported device kind {dev.type!r}; "
                       f"expected 'cpu' or 'cuda'")


def machine_device_classes() -> list[str]:
    """Device classes this machine can honour: "cpu" and one per visible CUDA capability."""
    import torch

    classes = ["cpu"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            if f"cuda:{major}.{minor}" not in classes:
                classes.append(f"cuda:{major}.{minor}")
    return classes


def read_manifest(path: Path) -> Manifest:
    """Read and validate `path/manifest.json`, checking ABI and contract versions first
    (so a package from another version is named as such, not as a schema error).

    Raises:
        PackageError: missing folder or manifest, unreadable JSON, version mismatch,
            invalid fields.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise PackageError(f"package {str(folder)!r}: expected a package folder, found "
                           f"{'a file' if folder.exists() else 'nothing'}")
    mpath = folder / MANIFEST_NAME
    if not mpath.is_file():
        raise PackageError(f"package {str(folder)!r}: expected {MANIFEST_NAME}, found none "
                           f"(not a flare package, or an interrupted prepare)")
    try:
        raw = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackageError(f"package {str(folder)!r}: expected a JSON {MANIFEST_NAME}, "
                           f"found unreadable content ({exc})") from None
    if not isinstance(raw, dict):
        raise PackageError(f"package {str(folder)!r}: expected a JSON object in "
                           f"{MANIFEST_NAME}, found {type(raw).__name__}")
    for key, expected in (("execution_abi", EXECUTION_ABI),
                          ("prepared_contract", PREPARED_CONTRACT)):
        found = raw.get(key, "<missing>")
        if found != expected:
            raise PackageError(f"package {str(folder)!r}: {key} mismatch: this flare expects "
                               f"{expected}, the package has {found!r}; prepare it again")
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                             for e in exc.errors()[:5])
        raise PackageError(f"package {str(folder)!r}: invalid {MANIFEST_NAME}: "
                           f"{problems}") from None


def check_package(path: Path, device_class: str | None = None) -> Manifest:
    """Check a runtime package before serving it; return its manifest.

    Checks, cheapest first: manifest present and valid; `execution_abi` and
    `prepared_contract` equal this build's; recipe known at the same version; device class
    honourable; every payload file present, of the recorded size and SHA-256; `package_id`
    equal to the digest of the payload entries. Hashes every payload byte (about 1 s per
    GB).

    Args:
        path: the package folder.
        device_class: the device class the caller will serve on ("cpu", "cuda:9.0"):
            the package's must equal it. None: any class this machine has.

    Raises:
        PackageError: the first failed check, naming the expected and the found value.
    """
    from flare.models.recipe import RECIPE_VERSIONS

    folder = Path(path)
    m = read_manifest(folder)
    where = f"package {str(folder)!r}"

    if m.recipe not in RECIPE_VERSIONS:
        raise PackageError(f"{where}: recipe {m.recipe!r} unknown to this flare; "
                           f"expected one of {sorted(RECIPE_VERSIONS)}")
    if m.recipe_version != RECIPE_VERSIONS[m.recipe]:
        raise PackageError(f"{where}: recipe {m.recipe!r} version mismatch: this flare has "
                           f"{RECIPE_VERSIONS[m.recipe]}, the package has {m.recipe_version}")

    if device_class is not None:
        if m.device_class != device_class:
            raise PackageError(f"{where}: device class mismatch: serving on {device_class!r}, "
                               f"the package was prepared for {m.device_class!r}")
    else:
        have = machine_device_classes()
        if m.device_class not in have:
            why = " (no CUDA device)" if have == ["cpu"] else ""
            raise PackageError(f"{where}: device class mismatch: the package expects "
                               f"{m.device_class!r}, this machine has {have}{why}")

    for name, entry in sorted(m.payload.items()):
        fpath = folder / name
        if not fpath.is_file():
            raise PackageError(f"{where}: payload file {name!r} missing (expected "
                               f"{entry.bytes:,} bytes, found none)")
        size = fpath.stat().st_size
        if size != entry.bytes:
            raise PackageError(f"{where}: payload file {name!r} size mismatch (truncated or "
                               f"altered): expected {entry.bytes:,} bytes, found {size:,}")
        digest = sha256_file(fpath)
        if digest != entry.sha256:
            raise PackageError(f"{where}: payload file {name!r} sha256 mismatch (altered): "
                               f"expected {entry.sha256}, found {digest}")

    pid = payload_id(m.payload)
    if pid != m.package_id:
        raise PackageError(f"{where}: package_id mismatch: the payload gives {pid}, "
                           f"the manifest says {m.package_id}")
    return m
