"""Probing a kernel variant before it is used: a CPU flag is not proof that it runs.

`probe(candidate, reference)` starts a child Python that imports both built modules (the
candidate variant's and the avx2 baseline's), runs every int8 kernel (q4x8, q8x8, q4kx8,
q6kx8, q5x8, q5kx8, quantize_rows_q8), the dense ones, attention and silu_mul on a small
fixed random problem (`problem`) and compares the results byte for byte. The candidate is
rejected when the child dies by a signal (an instruction the CPU or the VM does not
execute: SIGILL), exits non-zero, or any result differs. `cached_probe` keeps the verdict
in a small JSON file beside the module, keyed by both build keys, so each build is probed
once per machine (`write_verdict` also records a variant whose build failed).

Test hook: $FLARE_KERNEL_PROBE_FAULT in the child's environment makes it fail on purpose
after loading the modules: "ud2" executes an undefined instruction (a real SIGILL from
the CPU), "differ" changes one byte of the candidate's first result.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from flare.atomic_file import write_text_atomic

FAULT_ENV = "FLARE_KERNEL_PROBE_FAULT"
PROBE_TIMEOUT_S = 300.0  # a child that imports torch and runs the problem takes seconds
N, K = 24, 512  # 3 groups of 8 rows (a pair and a lone one for AVX-512), 2 K-quant
# super-blocks (16 blocks of 32)
_CHILD = "from flare.kernels.probe import main; main()"


def import_extension(path: Path) -> ModuleType:
    """Import the compiled extension at `path` (its module name is the file's stem)."""
    name = path.name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def problem(rows: int, seed: int = 0, extremes: bool = False
            ) -> list[tuple[str, Callable[[ModuleType], object]]]:
    """A fixed random problem for every int8 kernel, the dense linears and attention:
    (name, call) pairs, each call taking a kernel module and returning its result (a
    tensor or a tuple of tensors). x is float32 [rows, K] with one all-zero block; the weights are
    random codes within each format's range (q8 -128..127, q6k -32..31, 6-bit K-quant
    scales and mins, any byte for 4-bit codes and fifth bits) and random float16 scales,
    N = 24 rows. With `extremes`, every activation code is +-127 and every weight code
    one end of its range: the largest integer sums the kernels meet."""
    g = torch.Generator().manual_seed(seed)

    def ints(cols: int, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
        if extremes:
            ends = torch.rand(N, cols, generator=g) < 0.5
            return torch.where(ends, low, high - 1).to(dtype)
        return torch.randint(low, high, (N, cols), generator=g, dtype=dtype)

    def u8(cols: int, high: int = 256) -> torch.Tensor:
        return ints(cols, 0, high, torch.uint8)

    def i8(cols: int, low: int, high: int) -> torch.Tensor:
        return ints(cols, low, high, torch.int8)

    def half(cols: int, scale: float = 0.01) -> torch.Tensor:
        return (torch.randn(N, cols, generator=g) * scale).half()

    x = torch.randn(rows, K, generator=g) * 2
    if extremes:  # a block of +-2 quantizes to +-127 everywhere
        x = torch.where(x < 0, -2.0, 2.0)
    x[0, 32:64] = 0
    nb, ns = K // 32, K // 256
    q4 = (u8(K // 2), half(nb), half(nb))
    q8 = (i8(K, -128, 128), half(nb))  # -128: a file may hold it (|w| = 128)
    q4k = (u8(K // 2), u8(nb, 64), u8(nb, 64), half(ns), half(ns))
    q6k = (i8(K, -32, 32), i8(K // 16, -128, 128), half(ns))
    q5 = (u8(K // 2), u8(K // 8), half(nb), half(nb))
    q5k = (u8(K // 2), u8(K // 8), u8(nb, 64), u8(nb, 64), half(ns), half(ns))
    w = torch.randn(N, K, generator=g)
    # attention: a prefill chunk of `rows` query rows after 61 cached keys (6 query heads
    # over 2 KV heads, D = 64), and a decode step of 3 sequences of other lengths with
    # D = 24 (one zmm of D and an 8-lane rest in the AVX-512 build)
    chunk = _attention_problem(g, [61 + rows], rows, heads=(6, 2), head_dim=64)
    step = _attention_problem(g, [5, 40 + rows, 9], 1, heads=(4, 1), head_dim=24)
    if extremes:  # a NaN query row, and an infinite key element: a row whose largest
        # score is +inf comes out NaN, one with a -inf score gives that key no weight
        chunk[0][0, 1, 7] = math.nan
        chunk[1][chunk[3][0, 20], 1, 5] = math.inf
    # the same two on float16 caches (the int8 formats' default pool: widened per key block)
    chunk16, step16 = (p[:1] + (p[1].half(), p[2].half()) + p[3:] for p in (chunk, step))
    # silu_mul: 43 columns a half take the AVX-512 build's 16-lane loop, its 8-lane one and
    # the scalar tail; x 30 reaches exp's clamps at -87.3 and 88.7
    gu = torch.randn(rows, 86, generator=g) * 30
    return [
        ("q4x8_linear", lambda m: m.q4x8_linear(x, *q4)),
        ("q4x8_linear (Q4_0: no mins)",
         lambda m: m.q4x8_linear(x, *q4[:2], torch.empty(N, 0, dtype=torch.float16))),
        ("q8x8_linear", lambda m: m.q8x8_linear(x, *q8)),
        ("q4kx8_linear", lambda m: m.q4kx8_linear(x, *q4k)),
        ("q6kx8_linear", lambda m: m.q6kx8_linear(x, *q6k)),
        ("q5x8_linear", lambda m: m.q5x8_linear(x, *q5)),
        ("q5x8_linear (Q5_0: no mins)",
         lambda m: m.q5x8_linear(x, *q5[:3], torch.empty(N, 0, dtype=torch.float16))),
        ("q5kx8_linear", lambda m: m.q5kx8_linear(x, *q5k)),
        ("quantize_rows_q8", lambda m: m.quantize_rows_q8(x)),
        ("silu_mul", lambda m: m.silu_mul(gu)),
        ("f16_linear", lambda m: m.f16_linear(x, m.dense_pack(w.half()), N, None)),
        ("f32_linear", lambda m: m.f32_linear(x, m.dense_pack(w), N, None)),
        ("cached_attention (chunk)", lambda m: m.cached_attention(*chunk)),
        ("cached_attention (decode)", lambda m: m.cached_attention(*step)),
        ("cached_attention (chunk, float16 cache)", lambda m: m.cached_attention(*chunk16)),
        ("cached_attention (decode, float16 cache)", lambda m: m.cached_attention(*step16)),
    ]


def _attention_problem(g: torch.Generator, lengths: list[int], rows: int,
                       heads: tuple[int, int], head_dim: int) -> tuple:
    """cached_attention's arguments for len(lengths) sequences of `rows` query rows each,
    sequence b over `lengths[b]` cache slots taken in a random order: (q [B * rows, H, D],
    k_cache, v_cache [S, KVH, D] float32, gather int64 [B, max length], lengths int64 [B],
    rows, scale)."""
    (h, kvh), d = heads, head_dim
    slots = sum(lengths) + 3
    order = torch.randperm(slots, generator=g)
    gather = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    start = 0
    for b, n in enumerate(lengths):
        gather[b, :n] = order[start:start + n]
        start += n
    return (torch.randn(len(lengths) * rows, h, d, generator=g),
            torch.randn(slots, kvh, d, generator=g), torch.randn(slots, kvh, d, generator=g),
            gather, torch.tensor(lengths, dtype=torch.int64), rows, d ** -0.5)


def same_bytes(a: object, b: object) -> bool:
    """Whether two results (tensors or tuples of them) hold the same dtypes, shapes and
    bytes (NaN equals NaN of the same bits)."""
    ta = a if isinstance(a, tuple) else (a,)
    tb = b if isinstance(b, tuple) else (b,)
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype and x.shape == y.shape and
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(ta, tb))


def differences(candidate: ModuleType, reference: ModuleType,
                rows: tuple[int, ...] = (1, 5, 17, 35)) -> list[str]:
    """The kernels (with their row count) whose results differ between the modules, on
    `problem` at each row count and on its extremes at the last."""
    spoil = os.environ.get(FAULT_ENV) == "differ"
    out = []
    for b, extremes in [(b, False) for b in rows] + [(rows[-1], True)]:
        for name, call in problem(b, extremes=extremes):
            got = call(candidate)
            if spoil:  # the test hook: one byte of the first result
                got.view(torch.uint8).view(-1)[0] ^= 1
                spoil = False
            if not same_bytes(got, call(reference)):
                out.append(f"{name} ({b} rows{', extreme codes' if extremes else ''})")
    return out


def _execute_ud2() -> None:
    """Run the undefined instruction ud2 (0F 0B): the CPU raises SIGILL."""
    import ctypes
    import mmap

    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(b"\x0f\x0b\xc3")
    ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(code)))()


def main() -> None:
    """The child: argv = candidate .so, reference .so. Exit 0 when every result is equal,
    1 (naming the kernels on stderr) when one differs."""
    candidate = import_extension(Path(sys.argv[1]))
    reference = import_extension(Path(sys.argv[2]))
    if os.environ.get(FAULT_ENV) == "ud2":
        _execute_ud2()
    diff = differences(candidate, reference)
    if diff:
        print("results differ from the baseline's: " + ", ".join(diff), file=sys.stderr)
        sys.exit(1)


def probe(candidate: Path, reference: Path, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Run the probe child on the built modules `candidate` and `reference` (.so paths).

    Returns:
        None when the candidate runs and gives the reference's results byte for byte,
        else why not ("killed by SIGILL", "exited with 1: results differ ...", "timed
        out ...").
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the flare package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(candidate), str(reference)],
                              env=env, capture_output=True, text=True, timeout=timeout_s,
                              check=False)  # its exit status is the verdict
    except subprocess.TimeoutExpired:
        return f"the probe timed out after {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        try:
            return f"killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            return f"killed by signal {-done.returncode}"
    tail = done.stderr.strip().splitlines()[-1:] or ["no message"]
    return f"exited with {done.returncode}: {tail[0]}"


def read_verdict(path: Path, key: str, reference_key: str) -> tuple[bool, str | None]:
    """(known, rejected): the verdict saved in the JSON file `path` for the build `key`
    against the baseline build `reference_key`; known is False when there is none (no
    file, unreadable, or saved for other builds)."""
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key and saved.get("reference_key") == reference_key:
            return True, saved.get("rejected")
    except (OSError, ValueError, AttributeError):
        pass
    return False, None


def write_verdict(path: Path, key: str, reference_key: str, rejected: str | None) -> None:
    """Save a verdict for `read_verdict` (atomically; a write that fails only leaves the
    next start to decide again)."""
    try:
        write_text_atomic(path, json.dumps({"key": key, "reference_key": reference_key,
                                            "rejected": rejected}) + "\n")
    except OSError:
        pass


def cached_probe(verdict: Path, key: str, reference_key: str, candidate: Path,
                 reference: Path) -> str | None:
    """`probe(candidate, reference)`'s answer for the build `key` against the baseline
    build `reference_key`: read from the JSON file `verdict` when it holds both keys,
    else probed and saved there."""
    known, rejected = read_verdict(verdict, key, reference_key)
    if not known:
        rejected = probe(candidate, reference)
        write_verdict(verdict, key, reference_key, rejected)
    return rejected
