"""Which instruction set the native kernels are built for: the CPU's features, the
``AGENTCACHE_KERNEL_ISA`` switch, and each ISA's compiler flags. No torch, no compiler.

ISAs, best first: ``avx512`` (AVX-512 F/BW/VL/DQ with AVX2 and FMA), ``avx2`` (AVX2 and FMA),
``neon`` (aarch64's Advanced SIMD) and ``scalar`` (no vector extension: any CPU the compiler
targets). ``native`` (the default) takes the best that this CPU has; ``off`` runs the torch path.
The flags name the instruction set, never ``-march=native``, so a build is keyed by what it may
execute and one ISA's build never runs on a CPU that lacks it (the choice checks the CPU first).
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Mapping
from functools import cache
from typing import Literal, NamedTuple, TypeAlias

__all__ = [
    "ISA_ENV",
    "ISAS",
    "DISABLE_ENV",
    "Isa",
    "IsaChoice",
    "choose_isa",
    "cpu_features",
    "isa_flags",
    "missing_features",
]

Isa: TypeAlias = Literal["avx512", "avx2", "neon", "scalar"]
ISAS: tuple[Isa, ...] = ("avx512", "avx2", "neon", "scalar")
"""Every ISA the kernel source has a path for, best first."""

ISA_ENV = "AGENTCACHE_KERNEL_ISA"
"""``native`` (default, also when unset or empty), one of ``ISAS``, or ``off``."""
DISABLE_ENV = "AGENTCACHE_NATIVE_KERNELS"
"""The older switch: ``0`` (or ``false``, ``no``, ``off``) is ``AGENTCACHE_KERNEL_ISA=off``;
``1``, ``true``, ``yes``, ``on`` or unset leave the choice to ``AGENTCACHE_KERNEL_ISA``. Any
other value runs the torch path and says so (a switch that is not understood is not taken as
on)."""
_OFF, _ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")

_X86 = ("x86_64", "amd64", "i686", "i386")
_ARM = ("aarch64", "arm64")
_NEEDS: dict[Isa, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"),
    "avx2": ("avx2", "fma"),
    "neon": ("asimd",),
    "scalar": (),
}
"""CPU features (as Linux's /proc/cpuinfo spells them) each ISA's build executes."""

_FLAGS: dict[Isa, tuple[str, ...]] = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
               "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "neon": ("-march=armv8-a",),
    # NOTE: vec.h drops the source's `omp simd` hints for this path too
    "scalar": ("-fno-tree-vectorize", "-fno-tree-slp-vectorize"),
}  # fmt: skip


class IsaChoice(NamedTuple):
    """The ISA to build and load, or None (the torch path), and why."""

    isa: Isa | None
    reason: str
    """E.g. ``"native: avx2 (no avx512f, avx512bw, ... on this CPU)"`` or
    ``"AGENTCACHE_KERNEL_ISA=off"``."""
    warn: bool = False
    """Whether the reason is a mistake worth a warning (a switch not understood, an ISA this
    CPU lacks)."""


def _arch() -> str:
    return platform.machine().lower()


def _linux_features() -> frozenset[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.lower().split())
    return None


def _macos_features() -> frozenset[str]:
    """x86 macOS: sysctl's feature lists, lowercased (``AVX2`` -> ``avx2``, ``AVX512F`` ->
    ``avx512f``, ``FMA``); empty where sysctl answers nothing."""
    try:
        out = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
            capture_output=True, text=True, timeout=5, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(out.lower().replace(".", "_").split())


@cache
def cpu_features() -> frozenset[str]:
    """This CPU's features as Linux spells them (``avx2``, ``fma``, ``avx512f``, ``asimd``, ...):
    /proc/cpuinfo's ``flags`` (x86) or ``Features`` (aarch64) line, sysctl on x86 macOS, and
    ``asimd`` on any aarch64/arm64 CPU (Advanced SIMD is part of the architecture). Empty when
    nothing can be read (then only ``scalar`` is chosen)."""
    features = _linux_features()
    if features is None and platform.system() == "Darwin" and _arch() in _X86:
        features = _macos_features()
    found = set(features or ())
    if _arch() in _ARM:
        found.add("asimd")
    return frozenset(found)


def missing_features(isa: Isa) -> list[str]:
    """The features ``isa``'s build executes that this CPU lacks (empty: it can run here); an
    ISA of another architecture lacks the architecture itself."""
    arch = _arch()
    if isa in ("avx512", "avx2") and arch not in _X86:
        return [f"an x86-64 CPU (this is {arch})"]
    if isa == "neon" and arch not in _ARM:
        return [f"an aarch64 CPU (this is {arch})"]
    have = cpu_features()
    return [name for name in _NEEDS[isa] if name not in have]


def isa_flags(isa: Isa) -> tuple[str, ...]:
    """The compiler flags of ``isa``'s build (GCC/Clang), its ``-DAGENTCACHE_ISA_*`` included."""
    return (f"-DAGENTCACHE_ISA_{isa.upper()}", *_FLAGS[isa])


def _best() -> tuple[Isa, str]:
    for isa in ISAS:
        if not missing_features(isa):
            lacking = [n for better in ISAS[: ISAS.index(isa)] for n in missing_features(better)
                       if not n.startswith("an ")]  # fmt: skip
            why = f" (this CPU lacks {', '.join(dict.fromkeys(lacking))})" if lacking else ""
            return isa, f"native: {isa}{why}"
    raise AssertionError("scalar runs everywhere")


def choose_isa(env: Mapping[str, str] | None = None) -> IsaChoice:
    """The ISA from ``AGENTCACHE_NATIVE_KERNELS`` and ``AGENTCACHE_KERNEL_ISA`` (``env``,
    default ``os.environ``) and this CPU. Never raises: a value not understood, or an ISA this
    CPU cannot run, gives None with ``warn`` set."""
    values: Mapping[str, str] = os.environ if env is None else env
    switch = values.get(DISABLE_ENV, "").strip()
    if switch.lower() in _OFF:
        return IsaChoice(None, f"{DISABLE_ENV}={switch}")
    if switch.lower() not in _ON:
        return IsaChoice(None, f"{DISABLE_ENV}={switch!r} is not 0 or 1", warn=True)
    wanted = values.get(ISA_ENV, "").strip().lower() or "native"
    if wanted == "off":
        return IsaChoice(None, f"{ISA_ENV}=off")
    if wanted == "native":
        best, why = _best()
        return IsaChoice(best, why)
    if wanted not in ISAS:
        valid = ", ".join(("native", *ISAS, "off"))
        return IsaChoice(None, f"{ISA_ENV}={wanted!r} is not one of {valid}", warn=True)
    isa: Isa = wanted
    lacking = missing_features(isa)
    if lacking:
        return IsaChoice(None, f"{ISA_ENV}={isa}, but this CPU lacks {', '.join(lacking)}",
                         warn=True)  # fmt: skip
    return IsaChoice(isa, f"{ISA_ENV}={isa}")
