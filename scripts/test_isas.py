"""`make test-isas`: the native kernels proven on the paths this machine does not pick itself.

`make test` runs the suite on the default path (the best ISA the CPU has; the kernel tests also run
every ISA it can, ``tests/runtime/kernel_isas.py``). This runs the kernel and engine-exactness tests
once more under ``AGENTCACHE_KERNEL_ISA=<isa>`` for each other ISA the CPU runs (an AVX-512 CI
machine proves its AVX2 and scalar paths end to end: cache on equals cache off on each), then
compiles every kernel source for aarch64 with Debian's cross compiler (``python -m
runtime.model.kernels build --isa neon --compile-only``), so a source that does not compile for ARM
fails CI on an x86 machine. Exit status: the first failure's, else 0.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

from runtime.model.kernels._isa import choose_isa, missing_features

TESTS = [
    "tests/runtime/test_native_kernels.py",
    "tests/runtime/test_packed_weights.py",
    "tests/runtime/test_fp32_products.py",
    "tests/runtime/test_compact_forward.py",
    "tests/runtime/test_shared_prefix_decode.py",
    "tests/runtime/test_engine_exactness.py",
    "tests/runtime/test_batch_exactness.py",
    "tests/runtime/test_kv_dtype.py",
]
SELECT = "not gpt2 and not sliding"
"""Architectures that never run the compact forward (so no native kernel) are left out."""
CROSS = "aarch64-linux-gnu-g++"


def run(command: list[str], **env: str) -> int:
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"== {shown} {' '.join(command)}".replace("==  ", "== "), flush=True)
    return subprocess.run(command, env={**os.environ, **env}, check=False).returncode


def main() -> int:
    python = sys.executable
    if (code := run([python, "-m", "runtime.model.kernels", "info"])) != 0:
        return code
    default = choose_isa({}).isa
    for isa in ("avx2", "neon", "scalar"):
        if missing_features(isa) or isa == default:  # NOTE: `make test` ran the default
            continue
        code = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SELECT,
                    *TESTS], AGENTCACHE_KERNEL_ISA=isa)  # fmt: skip
        if code != 0:
            return code
    if platform.machine().lower() in ("aarch64", "arm64"):
        print("== the NEON path is this machine's own: `make test` built and tested it")
        return 0
    if shutil.which(CROSS) is None:
        print(f"== {CROSS} not found: the aarch64 compile is skipped (Debian: "
              "g++-aarch64-linux-gnu; .ci/run installs it)")  # fmt: skip
        return 0
    return run([python, "-m", "runtime.model.kernels", "build", "--isa", "neon", "--cxx", CROSS,
                "--compile-only"])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
