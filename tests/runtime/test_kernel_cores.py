"""The kernels' torch-free cores on every ISA, NEON included, without torch: the self-test
(``kernel_selftest.cpp``, its checks by concept in ``kernel_selftest_*.cpp``) is built with each
ISA's flags and run against its float64 loops. On an x86 machine the NEON build is made with
Debian's ``aarch64-linux-gnu-g++`` and run under ``qemu-aarch64`` (user-mode emulation), so the
ARM path is executed here, not only compiled; ``.ci/run`` installs both. An ISA this CPU cannot
run (and cannot emulate) is skipped, saying why.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from runtime.model.kernels import _build
from runtime.model.kernels._isa import isa_flags, missing_features
from tests.runtime.kernel_isas import KERNEL_ISAS

HERE = Path(__file__).parent
KERNELS = Path(_build.__file__).parent
CHECKS = 120
"""Checks the self-test makes (its summary line says how many ran)."""
CORES = (
    "attention.cpp",
    "grouped_attention.cpp",
    "prefill_attention.cpp",
    "products.cpp",
    "quantized.cpp",
    "q4_1_lanes.cpp",
)
"""The torch-free sources the self-test links."""
SELFTEST = (
    "kernel_selftest.cpp",
    "kernel_selftest_attention.cpp",
    "kernel_selftest_products.cpp",
    "kernel_selftest_half.cpp",
)
"""The self-test's own sources (main() and the shared helpers first; kernel_selftest.h)."""


def _toolchain(isa: str) -> tuple[list[str], list[str]]:
    """(compiler command, runner prefix) for ``isa`` here, or a skip."""
    native_arm = platform.machine().lower() in ("aarch64", "arm64")
    if isa == "neon" and not native_arm:
        cxx, qemu = (
            shutil.which("aarch64-linux-gnu-g++"),
            (shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")),
        )
        if cxx is None or qemu is None:
            pytest.skip(
                "NEON on x86 needs aarch64-linux-gnu-g++ and qemu-aarch64 (Debian: "
                "g++-aarch64-linux-gnu, qemu-user-static; .ci/run installs them)"
            )
        return [cxx, "-static"], [qemu]
    lacking = missing_features(isa)  # type: ignore[arg-type]
    if lacking:
        pytest.skip(f"this CPU cannot run {isa}: it lacks {', '.join(lacking)}")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.fail("no C++ compiler (every test machine has one: .ci/run installs g++)")
    return [cxx], []


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_kernel_cores_match_float64(isa: str, tmp_path: Path) -> None:
    """Decode attention (masks, a shared prefix, head dims on and off the unrolled paths; fp16 K/V
    bit-equal to fp32 over the rounded values, the fp16 conversions exhaustively), prefix
    attention with its log-sum-exp, packed products in fp32 and bf16, ``linear_rows``, and the
    products over GGUF's Q8_0 and Q4_1 blocks (direct tiles and the widened path)."""
    cxx, runner = _toolchain(isa)
    # the build's flags, with OpenMP's loop hints only (the self-test runs serially)
    flags = [f for f in _build._CFLAGS if f != "-fopenmp"] + ["-fopenmp-simd"]
    binary = tmp_path / f"selftest-{isa}"
    sources = [*(KERNELS / f for f in CORES), *(HERE / f for f in SELFTEST)]
    built = subprocess.run(
        [*cxx, "-std=c++17", *flags, *isa_flags(isa), f"-I{KERNELS}", *map(str, sources),  # type: ignore[arg-type]
         "-o", str(binary)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    done = subprocess.run([*runner, str(binary)], capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"{isa}: {CHECKS} checks, 0 failed"


@pytest.mark.parametrize(("width", "regs"), [(16, 32), (8, 16), (4, 32)],
                         ids=["avx512-layout", "avx2-layout", "neon-layout"])  # fmt: skip
def test_every_isa_tiling_on_this_cpu(width: int, regs: int, tmp_path: Path) -> None:
    """Each ISA's vector width and register count (so its tile sizes and index arithmetic)
    compiled for this CPU's baseline, the compiler splitting the wide vectors: an AVX-512
    machine's tiling is checked on one without AVX-512 (``vec.h``'s layout check)."""
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx is not None, "no C++ compiler (every test machine has one: .ci/run installs g++)"
    # NOTE: -O1: the arithmetic, not the code generation, is what a layout check is for
    flags = [f for f in _build._CFLAGS if f not in ("-fopenmp", "-O3")]
    flags += ["-O1", "-fopenmp-simd", "-Wno-psabi"]
    binary = tmp_path / "selftest-layout"
    sources = [*(KERNELS / f for f in CORES), *(HERE / f for f in SELFTEST)]
    built = subprocess.run(
        [cxx, "-std=c++17", *flags, f"-DAGENTCACHE_ISA_LAYOUT_CHECK={width}",
         f"-DAGENTCACHE_LAYOUT_REGS={regs}", f"-I{KERNELS}", *map(str, sources), "-o", str(binary)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"layout-check: {CHECKS} checks, 0 failed"
