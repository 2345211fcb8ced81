"""``python -m runtime.model.kernels info|build``: what the native kernels run on here, and building
them.

``info`` prints the CPU's vector features, the ISA chosen and why, the build folder, and whether
the build exists, loads, or failed earlier (it never compiles). ``build`` builds one ISA's
library (forgetting an earlier failure first), or with ``--compile-only`` only compiles its
sources to object files with any compiler, a cross compiler included (``--isa neon --cxx
aarch64-linux-gnu-g++``): nothing is linked or loaded, so no ARM machine is needed to catch a
source that does not compile for ARM. Exit status: 0 done, 1 the build failed (the compiler's
error on stderr), 2 a bad option.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from runtime.model.kernels._build import BuildFailed, build, build_of, compile_only, compiler
from runtime.model.kernels._build import marker_reason as _marker_reason
from runtime.model.kernels._isa import (
    ISA_ENV,
    ISAS,
    Isa,
    choose_isa,
    cpu_features,
    missing_features,
)

_SHOWN = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx2", "fma", "f16c",
          "asimd", "sve")  # fmt: skip


def _compiler_version() -> str:
    program = shlex.split(compiler()) or ["c++"]
    try:
        done = subprocess.run([*program, "--version"], capture_output=True, text=True,
                              timeout=10, check=False)  # fmt: skip
    except OSError as exc:
        return f"not usable ({exc.strerror or exc})"
    first = (done.stdout or done.stderr).strip().splitlines()
    return first[0] if first else f"exit status {done.returncode}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware")):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def _library_state(isa: Isa) -> str:
    b = build_of(isa)
    failed = _marker_reason(b)
    if failed is not None:
        return f"an earlier build failed: {failed}\n  marker: {b.marker} (remove it, or run " \
               f"`python -m runtime.model.kernels build --isa {isa}`, to retry)"  # fmt: skip
    if not b.library.is_file():
        return "not built yet (the first engine to load a model builds it, or run " \
               f"`python -m runtime.model.kernels build --isa {isa}`)"  # fmt: skip
    from runtime.model.kernels import native_status

    status = native_status(isa)
    return f"built and loaded: {status.reason}" if status.loaded else f"not loaded: {status.reason}"


def info() -> int:
    have = cpu_features()
    shown = [name for name in _SHOWN if name in have]
    lacking = [name for name in _SHOWN[:4] if name not in have and platform.machine() != "aarch64"]
    print(f"cpu: {platform.machine()} {_cpu_model()}".rstrip())
    print(f"  features: {' '.join(shown) or '(none of ' + ', '.join(_SHOWN) + ')'}"
          + (f"; lacks {' '.join(lacking)}" if lacking else ""))  # fmt: skip
    runnable = [isa for isa in ISAS if not missing_features(isa)]
    print(f"  paths it can run: {', '.join(runnable)}")
    choice = choose_isa()
    print(f"{ISA_ENV}={os.environ.get(ISA_ENV, '') or '(unset: native)'}")
    print(f"isa: {choice.isa or 'off (the torch path)'} ({choice.reason})")
    print(f"compiler: {compiler()} ({_compiler_version()})")
    if choice.isa is not None:
        print(f"build folder: {build_of(choice.isa).folder}")
        print(f"library: {_library_state(choice.isa)}")
    return 0


def _build(isa: Isa, cxx: str | None, only: bool, out: Path | None) -> int:
    if only:
        folder = out or Path(tempfile.mkdtemp(prefix="agentcache-kernels-"))
        try:
            objects = compile_only(isa, cxx or compiler(), folder, jobs=os.cpu_count() or 1)
        except BuildFailed as exc:
            print(f"{exc}\n{exc.detail}", file=sys.stderr)
            return 1
        for path, arch in objects:
            print(f"{path} ({arch}, {path.stat().st_size} bytes)")
        print(f"compiled {len(objects)} sources for {isa} with {cxx or compiler()}")
        return 0
    lacking = missing_features(isa)
    if lacking:
        print(
            f"agentcache: this CPU cannot run {isa} ({', '.join(lacking)} missing); build it "
            "elsewhere, or only compile it here with --compile-only",
            file=sys.stderr,
        )
        return 2
    if cxx is not None:
        os.environ["CXX"] = cxx
    b = build_of(isa)
    b.marker.unlink(missing_ok=True)  # NOTE: the retry this command is for
    try:
        module = build(b)
    except BuildFailed as exc:
        print(f"agentcache: {exc}\n{exc.detail}", file=sys.stderr)
        return 1
    print(f"built {module.isa} kernels: {b.library}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.model.kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="the CPU, the ISA chosen and why, the build and its state")
    b = sub.add_parser("build", help="build one ISA's kernels (or only compile them)")
    b.add_argument(
        "--isa",
        choices=("native", *ISAS),
        default="native",
        help="the ISA to build (default: the one AGENTCACHE_KERNEL_ISA chooses)",
    )
    b.add_argument("--cxx", help="the C++ compiler (default: $CXX, else c++)")
    b.add_argument("--compile-only", action="store_true",
                   help="compile to object files only (no link, no load): any target")  # fmt: skip
    b.add_argument("--out", type=Path, help="with --compile-only: where the objects go")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.out is not None and not args.compile_only:
        parser.error("--out goes with --compile-only")
    isa: Isa | None = None if args.isa == "native" else args.isa
    if isa is None:
        choice = choose_isa()
        if choice.isa is None:
            print(f"agentcache: no ISA to build: {choice.reason}", file=sys.stderr)
            return 2
        isa = choice.isa
    return _build(isa, args.cxx, args.compile_only, args.out)


if __name__ == "__main__":
    sys.exit(main())
