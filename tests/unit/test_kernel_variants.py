"""Kernel variants per instruction set (`flare.kernels.variants`, `flare.kernels.probe`):
each variant has its own cache key and folder, a variant is a candidate only where the CPU
lists its flags, a candidate runs only once a probe child has run it and matched the avx2
baseline byte for byte (a child killed by SIGILL or giving another result rejects it, and
the verdict is cached), and every variant this CPU offers gives the baseline's results
(random problems of 1 to 17 rows, and the extreme codes that make the largest sums;
attention over a prefill chunk and a decode step, on float32 and float16 caches).
On a CPU without VNNI (the AVX2-only AMD machines CI runs on) the choice is avx2 with no
other build, and the variant comparisons are skipped, saying which flags are missing.
"""

from __future__ import annotations

import json
import os

import pytest

K = pytest.importorskip("flare.kernels")
from flare.kernels import probe, variants

BASE = "fpu sse2 avx avx2 fma f16c bmi2"
AVX512 = "avx512f avx512bw avx512vl avx512dq avx512_vnni"
needs_kernels = pytest.mark.skipif(K.qgemm_problem() is not None,
                                   reason=f"Flare's kernels: {K.qgemm_problem()}")


def test_each_variant_and_each_cpu_has_its_own_key_and_folder(monkeypatch):
    """A module built for another instruction set or another CPU's flags is never loaded:
    every (variant, flags) pair gives another key, hence another folder."""
    flag_sets = [BASE, BASE + " avx_vnni", BASE + " " + AVX512, BASE + " amx_tile amx_int8",
                 "fpu sse2 avx avx2 fma"]
    keys, folders = set(), set()
    for flags in flag_sets:
        monkeypatch.setattr(K, "cpu_flags", lambda f=flags: frozenset(f.split()))
        for name in variants.NAMES:
            keys.add(K.build_key(name))
            folder = K.module_folder(name)
            assert folder.name == f"flare_qgemm_{name}_{K.build_key(name)}"
            folders.add(folder)
    assert len(keys) == len(folders) == len(flag_sets) * len(variants.NAMES)
    assert K.isa_target("avx2") == K.ISA_TARGET == "x86-64+avx2+fma+f16c"
    assert K.isa_target("avxvnni") == "x86-64+avx2+fma+f16c+avxvnni"
    assert "-mavx512vnni" in K.variant_cflags("avx512vnni")


def test_every_header_the_sources_include_is_in_the_key():
    """A header's bytes are in the cache key (build.HEADERS), so a change to one builds
    anew: every `#include "..."` of the sources and headers names one of them."""
    from flare.kernels import build

    files = build.SOURCES + build.HEADERS
    included = {line.split('"')[1] for f in files for line in f.read_text().splitlines()
                if line.startswith('#include "')}
    assert included, "no local includes found"
    assert included <= {h.name for h in build.HEADERS}, included - {h.name for h in build.HEADERS}


def test_candidates_follow_the_cpu_flags():
    base = frozenset(BASE.split())
    avx512 = base | frozenset(AVX512.split())
    assert variants.candidates(base) == ["avx2"]
    assert variants.candidates(base | {"avx_vnni"}) == ["avxvnni", "avx2"]
    assert variants.candidates(avx512) == ["avx512vnni", "avx2"]
    assert variants.candidates(avx512 - {"avx512vl"}) == ["avx2"]
    assert variants.candidates(avx512 | {"avx_vnni", "amx_tile", "amx_int8"}) == \
        ["avx512amx", "avx512vnni", "avxvnni", "avx2"]
    assert variants.candidates(avx512 | {"amx_tile"}) == ["avx512vnni", "avx2"]
    assert variants.candidates(None) == ["avx2"]  # no /proc/cpuinfo: nothing is assumed


def test_a_forced_variant_that_cannot_run_is_a_clear_error():
    flags = frozenset(BASE.split())
    with pytest.raises(K.KernelUnavailable,
                       match="FLARE_KERNEL_ISA=avx512vnni: the kernel variant avx512vnni "
                             "cannot run here, the CPU lacks avx512f, avx512bw"):
        K.choose_variant(flags, "avx512vnni")
    with pytest.raises(K.KernelUnavailable, match="FLARE_KERNEL_ISA=avxvnni: .* avx_vnni"):
        K.choose_variant(flags, "avxvnni")
    with pytest.raises(K.KernelUnavailable, match="FLARE_KERNEL_ISA=amx: no such kernel"):
        K.choose_variant(flags, "amx")
    assert K.choose_variant(flags, "avx2") == "avx2"


@needs_kernels
def test_this_cpu_runs_its_best_variant_and_builds_no_other_without_vnni(monkeypatch):
    flags = K.cpu_flags()
    if variants.candidates(flags) == ["avx2"]:
        def no_build(*args):
            raise AssertionError("a CPU without VNNI flags must build nothing but avx2")

        monkeypatch.setattr(K, "build_module", no_build)
        assert K.choose_variant(flags) == "avx2"
    best = next(v for v in variants.candidates(flags)
                if v == "avx2" or K.variant_rejected(v) is None)
    assert K.choose_variant(flags) == best
    assert K.isa_variant() == (os.environ.get(K.ISA_ENV) or best)


@needs_kernels
def test_the_probe_rejects_sigill_caches_the_verdict_and_accepts_the_baseline(tmp_path,
                                                                              monkeypatch):
    so = K._built("avx2")  # the baseline, built here if no earlier probe built it
    verdict = tmp_path / "flare_qgemm_x_k1.probe.json"
    monkeypatch.setenv(probe.FAULT_ENV, "ud2")  # the child executes ud2: a real SIGILL
    assert probe.cached_probe(verdict, "k1", "k0", so, so) == "killed by SIGILL"
    assert json.loads(verdict.read_text()) == {"key": "k1", "reference_key": "k0",
                                               "rejected": "killed by SIGILL"}
    monkeypatch.delenv(probe.FAULT_ENV)
    # the same builds: the saved verdict, no child (which would now accept)
    assert probe.cached_probe(verdict, "k1", "k0", so, so) == "killed by SIGILL"
    # a rebuilt variant (another key): probed again, and the baseline matches itself
    assert probe.cached_probe(verdict, "k2", "k0", so, so) is None
    assert json.loads(verdict.read_text())["rejected"] is None


@needs_kernels
def test_the_probe_rejects_a_variant_whose_results_differ(monkeypatch):
    so = K._built("avx2")  # the baseline, built here if no earlier probe built it
    monkeypatch.setenv(probe.FAULT_ENV, "differ")  # one byte of q4x8_linear's result
    assert probe.probe(so, so) == ("exited with 1: results differ from the baseline's: "
                                   "q4x8_linear (1 rows)")


@needs_kernels
@pytest.mark.parametrize("name", ["avxvnni", "avx512vnni", "avx512amx"])
def test_each_variant_this_cpu_offers_gives_the_baselines_results(name):
    missing = variants.missing_flags(name, K.cpu_flags())
    if missing:
        pytest.skip(f"CPU lacks {' '.join(missing)}: the {name} variant cannot run here")
    rejected = K.variant_rejected(name)
    if rejected is not None and rejected.startswith("killed by"):
        pytest.skip(f"the CPU lists {name}'s flags but does not execute it: {rejected}")
    assert rejected is None, rejected
    module, baseline = K.variant_module(name), K.variant_module("avx2")
    # 16 rows and more: whole tiles of 16 on AMX, the rest beside them
    cases = [(r, False) for r in [*range(1, 18), 31, 32, 35, 48]] + [(1, True), (17, True),
                                                                     (35, True)]
    # the AVX-512 builds: two groups a zmm register from one row on, and one group a ymm
    # register up to 64 rows (what register_width may choose at few rows)
    widths = [1, 64] if variants.has_two_widths(name) else [None]
    before = module.zmm_min_rows() if widths[0] else None
    try:
        for width in widths:
            if width:
                module.set_zmm_min_rows(width)
            for rows, extremes in cases:
                for kernel, call in probe.problem(rows, seed=rows, extremes=extremes):
                    assert probe.same_bytes(call(module), call(baseline)), \
                        (kernel, rows, extremes, width)
    finally:
        if before:
            module.set_zmm_min_rows(before)
