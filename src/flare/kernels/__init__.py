"""Flare's own C++ CPU kernels, compiled on first use and cached.

`qgemm()` returns the extension module built from `qgemm.cpp` (block-quantized weight
GEMMs, see that file and `flare.models.quant`), `qdot8.cpp` (the same with int8
activations, weight format `q4x8`), `dense.cpp` (row-invariant GEMMs for float16 and
float32 weights in 16-output panels, formats `fp16` and `full`) and `fused.cpp` (fused
float32 ops for the
dense decoder's small per-layer steps: RMSNorm, residual add + RMSNorm, RoPE + K/V store,
SiLU * up, one-token decode attention; see that file and `flare.models.llama`).
`fused_ops()` returns the same module for those ops, or None where it cannot be had or
$FLARE_FUSED_OPS=0 asks for the torch path.

The module comes in instruction-set variants (`flare.kernels.variants`: avx512amx,
avx512vnni, avxvnni, and the avx2 baseline), each the whole extension built from the same sources
with its own -m flags. `isa_variant()` picks one per process: $FLARE_KERNEL_ISA where set,
else the best variant whose CPU flags /proc/cpuinfo lists and that passes its probe (built,
then run against the baseline in a child process, `flare.kernels.probe`; the verdict is
cached beside the module). Results are identical across variants (qdot8.cpp says why).
An AVX-512 build also measures once, on this machine, from how many rows of x its int8
kernels are faster two weight groups a zmm register than one a ymm register
(`flare.kernels.register_width`; the same bits either way).
A variant is compiled once with `torch.utils.cpp_extension.load` (-O3 -mavx2 -mfma -mf16c
-ffp-contract=off -fopenmp, plus its own flags; the kernels use `at::parallel_for`, so they
run on torch's own OpenMP thread pool: the module's libgomp.so.1 is the copy torch loaded,
no second runtime) into

    <cache>/kernels/flare_qgemm_<variant>_<key>/

where <cache> is Flare's cache folder (`flare.cache_dir.default_cache_dir`: $FLARE_CACHE_DIR,
else $XDG_CACHE_HOME/flare, else ~/.cache/flare) and <key> hashes every source file, the
compiler flags, the torch and Python versions, the machine, the variant's instruction-set
target (`isa_target`) and the CPU's flags that decide what a build may run
(`KEY_CPU_FLAGS`, from /proc/cpuinfo): a cache folder shared between different machines
(an NFS home, a copied image) never loads a module built for another CPU or another
instruction set. A build runs in a private temporary
sibling folder that is renamed into place when complete, so two processes building at
once both succeed (the loser of the rename discards its copy) and a reader never sees a
half-built module. Later processes import the cached module directly (no compiler or
ninja needed then; `flare.kernels.build` holds the sources, the flags and the build
itself). The first build takes about a minute on 2 cores (two builds on a CPU
that lists VNNI flags: the baseline, which the probe compares against, and the variant).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

from flare.cache_dir import default_cache_dir
from flare.kernels import register_width, variants
from flare.kernels.build import (  # the public names stay importable from flare.kernels
    CFLAGS,
    HEADERS,
    LDFLAGS,
    SOURCES,
    BuildFailed,
    KernelUnavailable,
    build_lock,
    build_module,
)
from flare.kernels.probe import (
    cached_probe,
    import_extension,
    read_verdict,
    write_verdict,
)

ISA_ENV = "FLARE_KERNEL_ISA"  # forces a variant: avx2, avxvnni, avx512vnni or avx512amx
# /proc/cpuinfo flags that decide which kernels a CPU can run (now or in per-variant
# builds), part of the cache key: exact names, and every flag starting with a prefix.
KEY_CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx_vnni_int8",
                 "avx_ifma", "avx_ne_convert")
KEY_CPU_FLAG_PREFIXES = ("avx512", "amx")

log = logging.getLogger(__name__)

_MODULE: ModuleType | None = None  # the chosen variant's module
_PROBLEM: str | None = None
_VARIANT: str | None = None
_LOADED: dict[str, ModuleType] = {}  # variant -> its module, once imported here


def cpu_flags() -> frozenset[str] | None:
    """The `flags` line of /proc/cpuinfo (first processor) as a set, or None where the
    file cannot be read (not Linux); an empty set when it has no flags line."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def key_cpu_flags(flags: frozenset[str] | None) -> list[str]:
    """The flags of `flags` that go into the cache key (`KEY_CPU_FLAGS`, and every
    `KEY_CPU_FLAG_PREFIXES` flag), sorted; where /proc/cpuinfo is unreadable (None),
    torch's detected CPU capability instead ("cap:AVX2", ...)."""
    if flags is None:
        return [f"cap:{torch.backends.cpu.get_cpu_capability()}"]
    return sorted(f for f in flags
                  if f in KEY_CPU_FLAGS or f.startswith(KEY_CPU_FLAG_PREFIXES))


def cpu_problem() -> str | None:
    """Why this CPU cannot run the AVX2/FMA kernels, or None when it can.

    Reads the `flags` line of /proc/cpuinfo on Linux, else torch's detected CPU
    capability ("AVX2" and "AVX512" imply FMA in ATen's dispatch)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, the kernels need x86-64 with AVX2 and FMA"
    flags = cpu_flags()
    if flags is None:
        cap = torch.backends.cpu.get_cpu_capability()
        if cap not in ("AVX2", "AVX512"):
            return f"the CPU lacks AVX2/FMA (torch capability {cap})"
        return None
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    if missing:
        return f"the CPU lacks {' and '.join(missing)} (from /proc/cpuinfo)"
    return None


def variant_cflags(variant: str = variants.BASELINE) -> list[str]:
    """The compiler flags of `variant`'s build: `CFLAGS` and the variant's own -m flags."""
    return CFLAGS + list(variants.variant(variant).cflags)


def isa_target(variant: str = variants.BASELINE) -> str:
    """The instruction sets `variant`'s build targets (its -m flags), part of its cache
    key and what /metrics reports: "x86-64+avx2+fma+f16c" for the baseline."""
    return "x86-64+" + "+".join(f[2:] for f in variant_cflags(variant) if f.startswith("-m"))


ISA_TARGET = isa_target()  # the baseline's


def cache_root() -> Path:
    """The folder cached kernel builds live in: `<flare cache>/kernels`."""
    return default_cache_dir() / "kernels"


@functools.cache
def _sources_digest() -> bytes:
    """sha256 of every kernel source and header (names and bytes), read once a process:
    the sources ship with the package and do not change under a running one."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return h.digest()


def build_key(variant: str = variants.BASELINE) -> str:
    """16 hex digits identifying a build of `variant`: every source and header, its
    compiler flags, torch, Python, the machine, its instruction-set target (`isa_target`)
    and this CPU's flags that matter (`key_cpu_flags`), so a module built for another CPU
    or another variant is never loaded.

    Raises:
        ValueError: no variant has that name.
    """
    h = hashlib.sha256(_sources_digest())
    h.update("\0".join(variant_cflags(variant) + LDFLAGS + [
        torch.__version__, sys.version.split()[0], platform.machine(),
        "isa=" + isa_target(variant), "cpu=" + ",".join(key_cpu_flags(cpu_flags()))]).encode())
    return h.hexdigest()[:16]


def module_folder(variant: str = variants.BASELINE) -> Path:
    """Where `variant`'s build lives: `<cache>/kernels/flare_qgemm_<variant>_<key>/`, the
    module itself the .so of the same name inside."""
    return cache_root() / f"flare_qgemm_{variant}_{build_key(variant)}"


def module_file(variant: str = variants.BASELINE) -> Path:
    """The extension file of `variant`'s build (which may not be built yet)."""
    folder = module_folder(variant)
    return folder / f"{folder.name}.so"


def _built(variant: str) -> Path:
    """The .so of `variant`'s build, building it first where there is none (under the
    build lock: a second process, a replica, waits and then finds it built)."""
    final, so = module_folder(variant), module_file(variant)
    if not so.is_file():
        with build_lock(final):
            if not so.is_file():
                build_module(final.name, final, variant_cflags(variant))
    return so


def variant_module(variant: str) -> ModuleType:
    """`variant`'s kernel module, built where needed (not probed: `isa_variant` decides
    what runs; tests compare variants with this).

    Raises:
        KernelUnavailable: no compiler or ninja, or the build failed.
        ValueError: no variant has that name.
    """
    if variant not in _LOADED:
        _LOADED[variant] = import_extension(_built(variant))
    return _LOADED[variant]


def variant_rejected(variant: str) -> str | None:
    """Why `variant` cannot run here although the CPU lists its flags (its build failed,
    or its probe against the baseline did: a signal, an exit, a different result), or
    None when it can. Decided once per build: the verdict is kept in
    `<module folder>.probe.json`, keyed by both builds' keys.

    Raises:
        KernelUnavailable: the baseline cannot be built, or no variant can (no compiler
            or ninja: nothing is decided then).
    """
    key, reference_key = build_key(variant), build_key(variants.BASELINE)
    final = module_folder(variant)
    verdict = final.parent / f"{final.name}.probe.json"
    known, rejected = read_verdict(verdict, key, reference_key)
    if known:
        return rejected
    reference = _built(variants.BASELINE)
    try:
        candidate = _built(variant)
    except BuildFailed as exc:  # kept: a compiler too old for the variant's flags, say
        rejected = f"its build failed: {str(exc)[:300]}"
        write_verdict(verdict, key, reference_key, rejected)
        return rejected
    with build_lock(final):  # processes starting together probe once
        return cached_probe(verdict, key, reference_key, candidate, reference)


def choose_variant(flags: frozenset[str] | None, forced: str | None = None) -> str:
    """The variant to run on a CPU with /proc/cpuinfo `flags`: `forced` where given, else
    the best candidate (`variants.candidates`) that `variant_rejected` accepts; the
    baseline, never probed, is last. Builds and probes only candidates above the
    baseline, so a CPU that lists no VNNI flags builds nothing here.

    Raises:
        KernelUnavailable: `forced` is no variant, the CPU lacks its flags, or it is
            rejected (the message names it and why); the baseline cannot be built.
    """
    if forced is not None:
        if forced not in variants.NAMES:
            raise KernelUnavailable(f"{ISA_ENV}={forced}: no such kernel variant (the "
                                    f"variants are {', '.join(variants.NAMES)})")
        missing = variants.missing_flags(forced, flags)
        if missing:
            raise KernelUnavailable(f"{ISA_ENV}={forced}: the kernel variant {forced} "
                                    f"cannot run here, the CPU lacks {', '.join(missing)} "
                                    f"(from /proc/cpuinfo)")
        rejected = None if forced == variants.BASELINE else variant_rejected(forced)
        if rejected is not None:
            raise KernelUnavailable(f"{ISA_ENV}={forced}: the kernel variant {forced} "
                                    f"cannot run here, {rejected}")
        return forced
    for name in variants.candidates(flags):
        if name == variants.BASELINE:
            return name
        rejected = variant_rejected(name)
        if rejected is None:
            return name
        log.warning("Flare's %s kernels cannot run on this CPU although it lists their "
                    "flags (%s); trying the next variant", name, rejected)
    raise AssertionError("unreachable: the baseline is always a candidate")


def isa_variant() -> str:
    """The kernel variant this process runs: "avx512amx", "avx512vnni", "avxvnni" or
    "avx2".

    $FLARE_KERNEL_ISA where set, else `choose_variant` on this CPU's flags (building and
    probing a candidate on first use, cached on disk); decided once per process and
    logged once.

    Raises:
        KernelUnavailable: the CPU lacks AVX2/FMA/F16C, or as `choose_variant`.
    """
    global _VARIANT
    if _VARIANT is None:
        problem = cpu_problem()
        if problem is not None:
            raise KernelUnavailable(problem)
        forced = os.environ.get(ISA_ENV, "").strip() or None
        _VARIANT = choose_variant(cpu_flags(), forced)
        log.info("Flare's CPU kernels: variant %s (%s)", _VARIANT, isa_target(_VARIANT))
    return _VARIANT


def qgemm() -> ModuleType:
    """The compiled `qgemm` extension of the variant `isa_variant()` chooses (built on
    first call, then cached on disk and here).

    Functions (all float32, CPU, contiguous inputs; shapes as in qgemm.cpp):
        q4_linear(x [B, K], codes uint8 [N, K/2], scales [N, K/32], mins [N, K/32])
            -> y [B, N]
        q8_linear(x [B, K], codes int8 [N, K], scales [N, K/32]) -> y [B, N]
        q4_dequantize(codes, scales, mins) -> w [N, K]
        q4_dequantize_into(codes, scales, mins, out [N, K]) -> None
        q4x8_linear(x [B, K], codes, scales, mins) -> y [B, N]   (qdot8.cpp: int8
        q8x8_linear(x [B, K], codes, scales) -> y [B, N]          activations, weights
            in the 8-row interleaved layout of `flare.models.quant.interleaved.Q4x8Weight`;
            these, the K-quant and q5 linears and cached_attention take `out=` (float32,
            contiguous, the result's shape), written in place and returned)
        quantize_rows_q8(x [B, K]) -> (codes int8 [B, K], scales [B, K/32])
        dense_pack(w [N, K] float16 or float32) -> panels [ceil(N/16), K, 16]
        f16_linear(x [B, K], panels float16, N, bias [N] | None) -> y [B, N]
        f32_linear(x [B, K], panels float32, N, bias [N] | None) -> y [B, N]
            (dense.cpp: row-invariant, a row's result never depends on the other rows
            of the call or the thread count)
        rms_norm, add_rms_norm, rope_store, silu_mul, decode_attention (see `fused_ops`)
        DenseLayers(...): every decoder layer of a dense step, and the output layer on
            the rows that sample, in one call (layers.cpp, `flare.models.native_layers`)
        argmax_rows(x [N, V] float32) -> int64 [N]: torch.argmax(x, dim=-1)'s indices
            (sample.cpp; `flare.runtime.sampling.greedy_tokens`)
        q8x8_rows(codes, scales, ids int64 [T]), q4x8_rows(codes, scales, mins, ids)
            -> float32 [T, K]: embedding rows, the bits of the weights' `__getitem__`
            (rows.cpp; `flare.models.native_layers.native_embedding`)
        page_gather(pages, lengths, page_size) -> (gather int64 [B, M], lengths [B]):
            a decode group's cache slots (rows.cpp; `flare.runtime.forward`)
        set_zmm_min_rows(rows), zmm_min_rows(): from how many rows of x the AVX-512
            builds' int8 kernels take two weight groups a zmm register (the same bits
            either way); set here to what `register_width` measured for this machine

    Raises:
        KernelUnavailable: the CPU lacks AVX2/FMA, no compiler or ninja, the build
            failed, or $FLARE_KERNEL_ISA names a variant that cannot run here (message
            says which); the reason is remembered for this process.
    """
    global _MODULE, _PROBLEM
    if _MODULE is not None:
        return _MODULE
    if _PROBLEM is not None:
        raise KernelUnavailable(_PROBLEM)
    try:
        variant = isa_variant()
        module = variant_module(variant)
    except KernelUnavailable as exc:
        _PROBLEM = str(exc)
        raise
    set_register_width(module, variant)
    _MODULE = module
    return _MODULE


def set_register_width(module: ModuleType, variant: str) -> None:
    """Set the rows of x from which `module`, a build of `variant`, runs its int8 kernels
    two 8-row groups a zmm register (`register_width`: measured once per build on this
    machine under the build lock, then read from `<module folder>.width.json`). Builds
    without AVX-512 have one width only and are left alone."""
    if not variants.has_two_widths(variant):
        return
    final = module_folder(variant)
    with build_lock(final):  # processes starting together measure once, not side by side
        rows = register_width.zmm_min_rows(module, final.parent / f"{final.name}.width.json",
                                           build_key(variant))
    module.set_zmm_min_rows(rows)


def qgemm_problem() -> str | None:
    """Why `qgemm()` cannot be had here (building it if needed), or None when it can."""
    try:
        qgemm()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def fused_ops() -> ModuleType | None:
    """The kernel module for the fused float32 ops of `fused.cpp`, or None for the torch path.

    None when $FLARE_FUSED_OPS is "0" (forces the torch reference path, e.g. for tests)
    or when `qgemm()` raises `KernelUnavailable` (no warning: the torch path is then
    exactly what Flare ran before these ops). Functions (float32, CPU; shapes in
    fused.cpp):
        rms_norm(x [T, H], w [H], eps) -> y [T, H]
        add_rms_norm(x [T, H], r [T, H], w [H], eps) -> y [T, H]  (x += r in place)
        rope_store(qkv [T, (H + 2 KVH) * D], cos [P, D], sin_signed [P, D],
                   positions int64 [T], k_cache [S, KVH, D], v_cache [S, KVH, D],
                   slots int64 [T], num_heads, num_kv_heads, qk_norm [H + KVH, D] | None,
                   eps) -> q [T, H, D]  (writes k, v at slots)
        silu_mul(gu [T, 2F]) -> y [T, F]
        decode_attention(q [H, D] or [1, H, D], k_cache, v_cache, start, length, scale)
            -> o (q's shape)
    All but rms_norm take `out=` (float32, contiguous, the result's shape): the result
    written there and returned (the native step reuses its buffers so). They raise
    RuntimeError on a wrong dtype, shape, or an index out of range.
    """
    if os.environ.get("FLARE_FUSED_OPS", "1").strip() == "0":
        return None
    try:
        return qgemm()
    except KernelUnavailable:
        return None
