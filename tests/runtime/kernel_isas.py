"""The native kernels of each ISA this CPU can run, for kernel tests parametrized over ISAs.

``isa_kernels(isa)`` returns that ISA's build (compiled once per machine into the shared kernel
cache, then loaded in milliseconds) or skips, saying why: this CPU cannot run it, the kernels are
off, or ``AGENTCACHE_KERNEL_ISA`` names another single ISA (CI reruns the kernel tests under
``avx2`` and ``scalar`` to prove those paths on an AVX-512 machine; each rerun tests its one
ISA). A build that fails is a failure, not a skip: every test machine has a compiler.
``chosen_kernels()`` is the build the engine uses (``AGENTCACHE_KERNEL_ISA``, default the best
the CPU has), for tests of the engine's own path.
"""

from __future__ import annotations

import os

import pytest

from runtime.model.kernels import (
    DISABLE_ENV,
    ISA_ENV,
    ISAS,
    NativeKernels,
    chosen_isa,
    native_kernels,
    native_status,
)
from runtime.model.kernels._isa import missing_features

KERNEL_ISAS = [pytest.param(isa, id=isa) for isa in ISAS]
"""``@pytest.mark.parametrize("isa", KERNEL_ISAS)``: one case per ISA the source has."""


def _turned_off() -> str | None:
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return f"{DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    if os.environ.get(ISA_ENV, "").strip().lower() == "off":
        return f"{ISA_ENV}=off"
    return None


def isa_kernels(isa: str) -> NativeKernels:
    """``isa``'s kernels, or a skip with the reason (see the module docstring)."""
    off = _turned_off()
    if off is not None:
        pytest.skip(off)
    selected = os.environ.get(ISA_ENV, "").strip().lower()
    if selected not in ("", "native") and selected != isa:
        pytest.skip(f"{ISA_ENV}={selected} tests that ISA alone")
    lacking = missing_features(isa)  # type: ignore[arg-type]
    if lacking:
        pytest.skip(f"this CPU cannot run {isa}: it lacks {', '.join(lacking)}")
    kernels = native_kernels(isa)  # type: ignore[arg-type]
    assert kernels is not None, native_status(isa).reason  # type: ignore[arg-type]
    assert kernels.isa == isa
    return kernels


def chosen_kernels() -> NativeKernels:
    """The kernels the engine uses here; a test machine must build them (skipped only when they
    are turned off)."""
    off = _turned_off()
    if off is not None:
        pytest.skip(off)
    kernels = native_kernels()
    assert kernels is not None, native_status().reason
    assert kernels.isa == chosen_isa().isa
    return kernels
