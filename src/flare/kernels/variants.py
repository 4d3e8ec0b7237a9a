"""The instruction-set variants of Flare's kernel module, and which ones a CPU may run.

Every variant is the whole extension built from the same sources with its own -m flags
(added to the baseline's `CFLAGS` in `flare.kernels`), in its own cache folder under its
own key. qdot8.cpp's int8 dot products pick their instructions at compile time
(`FLARE_DPBUSD`, `FLARE_AMX`), so every kernel, layers.cpp's native decoder included,
runs the variant it was built in. Best first:

    avx512amx   avx512vnni's flags + -mamx-tile -mamx-int8 (products of 16 rows of x and
                more on AMX tiles, amx.h; fewer rows as avx512vnni)
    avx512vnni  + -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni
                (512-bit `vpdpbusd` over two 8-row groups, zmm attention)
    avxvnni     + -mavxvnni (256-bit VEX `vpdpbusd`, the Alder Lake / Zen 5 kind)
    avx2        the baseline: -mavx2 -mfma -mf16c (`vpmaddubsw` + `vpmaddwd`), always

A variant is a candidate where /proc/cpuinfo lists its flags (`missing_flags`); a flag is
not proof that the instructions run (AMX traps in some VMs that list it, even after the
kernel grants the tile state), so a candidate is then probed in a child process before it
is used (`flare.kernels.probe`): one that dies there is rejected and the next is tried.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One build of the kernel module.

    Attributes:
        name: what `FLARE_KERNEL_ISA` and `flare.kernels.isa_variant()` call it.
        cflags: compiler flags added to the baseline's.
        cpu_flags: /proc/cpuinfo flags the CPU must list (beyond the baseline's
            avx2, fma, f16c) for the variant to be a candidate.
    """

    name: str
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]


BASELINE = "avx2"
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni")
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
VARIANTS: tuple[Variant, ...] = (  # best first
    Variant("avx512amx", _AVX512 + ("-mamx-tile", "-mamx-int8"),
            _AVX512_FLAGS + ("amx_tile", "amx_int8")),
    Variant("avx512vnni", _AVX512, _AVX512_FLAGS),
    Variant("avxvnni", ("-mavxvnni",), ("avx_vnni",)),
    Variant(BASELINE, (), ()),
)
NAMES = tuple(v.name for v in VARIANTS)


def variant(name: str) -> Variant:
    """The variant called `name`.

    Raises:
        ValueError: no variant has that name (the message lists them).
    """
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"no kernel variant {name!r}; the variants are {', '.join(NAMES)}")


def missing_flags(name: str, flags: frozenset[str] | None) -> list[str]:
    """The flags variant `name` needs that `flags` (/proc/cpuinfo's, None where unreadable)
    lacks; every one of them where the flags are unknown, none for the baseline."""
    need = variant(name).cpu_flags
    return [f for f in need if flags is None or f not in flags]


def has_two_widths(name: str) -> bool:
    """Whether variant `name` is an AVX-512 build, whose int8 kernels can run two 8-row
    weight groups a zmm register as well as one a ymm register (from how many rows of x:
    `flare.kernels.register_width`).

    Raises:
        ValueError: no variant has that name.
    """
    return "-mavx512f" in variant(name).cflags


def candidates(flags: frozenset[str] | None) -> list[str]:
    """The variants whose flags `flags` lists, best first; the baseline is always last."""
    return [v.name for v in VARIANTS if not missing_flags(v.name, flags)]
