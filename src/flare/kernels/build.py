"""Building Flare's kernel module: its sources, the compiler flags, the build lock and
the build itself (a private temporary folder renamed into place). Which variant to build,
its key and its folder are `flare.kernels`' business; this module only compiles."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("flare.kernels")

SOURCES = [Path(__file__).with_name(n) for n in ("qgemm.cpp", "qdot8.cpp", "fused.cpp",
                                                 "attention.cpp", "recurrent.cpp", "dense.cpp",
                                                 "layers.cpp", "sample.cpp", "rows.cpp")]
SOURCE = SOURCES[0]  # the module's main file (its PYBIND11_MODULE)
# included by the sources (their bytes are in the kernel cache key too)
HEADERS = [Path(__file__).with_name(n) for n in ("simd.h", "qrows.h", "ops.h", "checks.h",
                                                 "amx.h", "team.h")]
# -fopenmp: at::parallel_for is a header template that splits work with `#pragma omp
# parallel`; compiled without OpenMP it runs every call on one thread. The module then
# needs libgomp.so.1, which resolves to the copy torch has already loaded (same soname),
# so the kernels share torch's thread pool and its torch.set_num_threads setting.
BUILD_REPORT_S = 10.0  # seconds between two progress lines of a build
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]  # the baseline's
LDFLAGS = ["-fopenmp"]


class KernelUnavailable(RuntimeError):
    """Flare's C++ kernels cannot run here; the message says why (CPU, compiler, build)."""


class BuildFailed(KernelUnavailable):
    """The compiler ran and failed: the same sources and flags fail the same way again."""


def report_build(folder: Path, done: threading.Event,
                  interval_s: float = BUILD_REPORT_S) -> None:
    """Log the build's progress as lines (never a carriage-return bar): every
    `interval_s` seconds, the compiled objects of `SOURCES` in `folder` as a percentage
    (the link is the last step), until `done` is set."""
    start = time.monotonic()
    while not done.wait(interval_s):
        compiled = len(list(folder.glob("*.o")))
        log.warning("building Flare's CPU kernels: %d%% (%d/%d sources compiled, %.0f s)",
                    100 * compiled // (len(SOURCES) + 1), compiled, len(SOURCES),
                    time.monotonic() - start)


@contextlib.contextmanager
def build_lock(final: Path) -> Iterator[None]:
    """Hold an exclusive lock on `<final>.lock` (flock; released if the process dies), so
    processes that start together on a fresh machine build one key once: the others wait
    and load what the first built. Without flock (not POSIX) each builds its own copy,
    which the atomic rename in `build_module` keeps safe."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(final.parent / f"{final.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_module(name: str, folder: Path, cflags: list[str]) -> None:
    """Compile and link the sources into `<folder>/<name>.so` without importing it: a
    variant first runs in the probe's child, since even its module's initializers may hold
    instructions this CPU traps on. This is torch's build step without its load (a private
    function, called with the arguments its signature names); a torch without it builds
    the baseline with `cpp_extension.load` and no other variant."""
    from torch.utils import cpp_extension

    # copies: torch appends its own -L/-l flags to the list it is given, and `LDFLAGS`
    # is part of every build key computed later in this process
    cflags, ldflags = list(cflags), list(LDFLAGS)
    build = getattr(cpp_extension, "_write_ninja_file_and_build_library", None)
    if build is None:
        if cflags != CFLAGS:
            raise RuntimeError("this torch has no build step apart from its load")
        cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=cflags,
                           extra_ldflags=ldflags, build_directory=str(folder), verbose=False)
        return
    args = {"name": name, "sources": [str(s) for s in SOURCES], "extra_cflags": cflags,
            "extra_cuda_cflags": [], "extra_sycl_cflags": [], "extra_ldflags": ldflags,
            "extra_include_paths": [], "build_directory": str(folder), "verbose": False,
            "with_cuda": False, "with_sycl": False}
    params = inspect.signature(build).parameters
    build(**{k: v for k, v in args.items() if k in params})


def build_module(name: str, final: Path, cflags: list[str]) -> None:
    """Build `<final>/<name>.so` with `cflags` (in a temporary sibling folder renamed into
    place, see the module docstring); it is not imported."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler ({cxx!r} not found on PATH) to build "
                                f"Flare's kernels")
    if not cpp_extension.is_ninja_available():
        try:  # the `ninja` wheel (a dependency) puts its binary in the environment's bin,
            import ninja  # which is not on PATH when the environment is not activated

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except (ImportError, AttributeError):
            pass
    if not cpp_extension.is_ninja_available():
        raise KernelUnavailable("ninja is not installed (pip install ninja); torch needs it "
                                "to build Flare's kernels")
    final.parent.mkdir(parents=True, exist_ok=True)
    # a notice, not an error: the first start on a machine waits for the compiler
    log.warning("building Flare's CPU kernels once for this machine (about 1-2 minutes), "
                "cached in %s", final.parent)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    done = threading.Event()
    watcher = threading.Thread(target=report_build, args=(tmp, done), daemon=True)
    watcher.start()
    try:
        compile_module(name, tmp, cflags)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildFailed(f"building Flare's kernels failed: {exc}") from exc
    finally:
        done.set()
        watcher.join()
    try:
        os.rename(tmp, final)  # atomic; fails if another process got there first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # the other's build is the same
