"""The instruction-set variants of Flare's kernel module, and which ones a CPU may run.

Every variant is the whole extension built from the same sources with its own -m flags
(added to the baseline's `CFLAGS` in `flare.kernels`), in its own cache folder under its
own key. qdot8.cpp's int8 dot products pick their instructions at compile time
(`FLARE_DPBUSD`), so every kernel, layers.cpp's native decoder included, runs the variant
it was built in. Best first:

    avx512vnni  + -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni
                (512-bit `vpdpbusd` over two 8-row groups, zmm attention)
    avxvnni     + -mavxvnni (256-bit VEX `vpdpbusd`, the Alder Lake / Zen 5 kind)
    avx2        the baseline: -mavx2 -mfma -mf16c (`vpmaddubsw` + `vpmaddwd`), always

A variant is a candidate where /proc/cpuinfo lists its flags (`missing_flags`); a flag is
not proof that the instructions run (AMX traps in some VMs that list it), so a candidate is
then probed in a child process before it is used (`flare.kernels.probe`). No AMX variant
is built.
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
VARIANTS: tuple[Variant, ...] = (  # best first
    Variant("avx512vnni",
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
            ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")),
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


def candidates(flags: frozenset[str] | None) -> list[str]:
    """The variants whose flags `flags` lists, best first; the baseline is always last."""
    return [v.name for v in VARIANTS if not missing_flags(v.name, flags)]
