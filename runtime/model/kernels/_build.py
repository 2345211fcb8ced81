"""Building and loading the native kernels, once per ISA and machine, and remembering a failure.

Each ISA builds into its own folder of the kernel cache (``$AGENTCACHE_KERNEL_DIR``, default
``~/.cache/agentcache/kernels``): ``<isa>-<key>/``, the key a hash of the sources, the flags, the
compiler command (``$CXX``), torch's and Python's versions and the machine, so switching ISA,
compiler or source never reuses a wrong build. A build goes to a private temporary folder and is
renamed into place, so concurrent first builds never read a half-written library and a killed
build leaves no lock behind (its folder is removed by a later build after an hour).

A failed build (no compiler, a compiler or linker error, no OpenMP, a library that does not load)
writes ``build-failed.txt`` into the ISA's folder with the compiler's error: later processes read
it, warn once and run the torch path at once instead of compiling again; removing the file, ``python
-m runtime.model.kernels build``, or any change of the key (source, flags, compiler) tries again.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from runtime.env import agentcache_home
from runtime.model.kernels._isa import Isa, isa_flags

__all__ = [
    "KERNEL_DIR_ENV",
    "MARKER",
    "SOURCES",
    "Build",
    "BuildFailed",
    "build",
    "build_of",
    "compile_only",
    "compiler",
    "import_library",
    "kernel_dir",
    "marker_reason",
]

KERNEL_DIR_ENV = "AGENTCACHE_KERNEL_DIR"
"""Where built kernels are cached (default ``~/.cache/agentcache/kernels``)."""
MARKER = "build-failed.txt"

_HERE = Path(__file__).parent
SOURCES = (
    "attention.cpp",
    "grouped_attention.cpp",
    "prefill_attention.cpp",
    "products.cpp",
    "quantized.cpp",
    "q4_1_lanes.cpp",
    "ops.cpp",
    "layers.cpp",
    "module.cpp",
)
"""Translation units, torch-free cores first (module.cpp, the pybind11 one, is the slowest)."""
_HEADERS = (
    "vec.h",
    "half.h",
    "cores.h",
    "grouped_attention.h",
    "quant_blocks.h",
    "ops.h",
    "layers.h",
)
_CFLAGS = (
    "-O3", "-fopenmp",
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
)  # fmt: skip
"""``-fopenmp``: ``at::parallel_for`` is header code that needs OpenMP to run on torch's threads
(the library's ``libgomp.so.1`` resolves to the one torch already loaded, by soname).
Reassociation lets dot products reduce as a tree instead of one chain of dependent adds;
infinities keep their meaning (no ``-ffinite-math-only``): masked keys are ``-inf``."""
_LDFLAGS = ("-fopenmp",)
_STALE_BUILD_S = 3600.0  # NOTE: a first build takes about 40-90 s on 2 cores

_log = logging.getLogger("runtime.model.kernels")


class BuildFailed(RuntimeError):
    """A build that failed; ``str()`` is the one-line reason, ``detail`` the compiler's output."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.detail = detail


class Build(NamedTuple):
    """Where one ISA's build of the current sources lives."""

    isa: Isa
    key: str
    folder: Path
    name: str
    """The extension module's name (unique per build: several ISAs load side by side)."""

    @property
    def library(self) -> Path:
        return self.folder / f"{self.name}.so"

    @property
    def marker(self) -> Path:
        """``build-failed.txt``: present while this build is known to fail."""
        return self.folder / MARKER


def kernel_dir() -> Path:
    """``$AGENTCACHE_KERNEL_DIR``, or ``kernels`` in ``runtime.env.agentcache_home()``
    (``$AGENTCACHE_HOME``, default ``~/.cache/agentcache``)."""
    configured = os.environ.get(KERNEL_DIR_ENV)
    return Path(configured) if configured else agentcache_home() / "kernels"


def compiler() -> str:
    """The C++ compiler command, as torch's builder reads it: ``$CXX``, default ``c++``."""
    return os.environ.get("CXX", "").strip() or "c++"


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def build_of(isa: Isa) -> Build:
    """The build of ``isa`` for the current sources, flags, compiler, torch and Python."""
    parts = [
        *((_HERE / f).read_bytes().hex() for f in (*SOURCES, *_HEADERS)),
        " ".join((*_CFLAGS, *isa_flags(isa), *_LDFLAGS)), compiler(), _torch_version(),
        sys.version, platform.machine(),
    ]  # fmt: skip
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return Build(isa, key, kernel_dir() / f"{isa}-{key}", f"agentcache_kernels_{isa}_{key}")


def import_library(name: str, path: Path) -> ModuleType:
    """Import the extension module ``name`` from ``path`` (raises ImportError)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None, path
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module


def marker_reason(b: Build) -> str | None:
    """The one-line reason a marker holds (None: no marker)."""
    try:
        text = b.marker.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("reason: "):
            return line.removeprefix("reason: ")
    return "a build failed earlier"


def _write_marker(b: Build, reason: str, detail: str) -> None:
    """Write ``b``'s marker atomically; never raises (a folder that cannot be written means the
    next process tries again)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    text = (
        f"agentcache native kernels: the {b.isa} build failed ({stamp}).\n"
        f"reason: {reason}\n"
        f"retry: remove this file, or run: python -m runtime.model.kernels build --isa {b.isa}\n"
        f"compiler: {compiler()}\n"
        f"flags: {' '.join((*_CFLAGS, *isa_flags(b.isa)))}\n\n{detail[-20_000:]}\n"
    )
    try:
        b.folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=b.folder, prefix=".marker-", delete=False,
                                         encoding="utf-8") as tmp:  # fmt: skip
            tmp.write(text)
        os.replace(tmp.name, b.marker)
    except OSError as exc:
        _log.debug("agentcache: cannot write %s: %s", b.marker, exc)


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    tail = " | ".join(lines[-3:]) if lines else type(exc).__name__
    # NOTE: the end: a compiler's error follows a command line of about 700 characters.
    return f"native kernel build failed ({type(exc).__name__}: {tail[-400:]})"


def _detail(exc: BaseException) -> str:
    """Everything a failure says: its message and, for a command that failed (torch's builder
    asks the compiler for its version first), that command's output."""
    parts = [str(exc)]
    if isinstance(exc, subprocess.CalledProcessError):
        for out in (exc.output, exc.stderr):
            if out:
                parts.append(out.decode(errors="replace") if isinstance(out, bytes) else str(out))
    return "\n".join(parts)


def _require_compiler() -> None:
    """Fail at once, naming it, when there is no C++ compiler: torch's builder would print a
    compiler-compatibility warning and end in a ninja error whose last line says 'not found'.

    Raises:
        FileNotFoundError: ``$CXX`` (default ``c++``) is not on PATH.
    """
    program = (shlex.split(compiler()) or ["c++"])[0]
    if shutil.which(program) is None:
        raise FileNotFoundError(f"no C++ compiler: {program!r} not found on PATH (install g++, "
                                "or set CXX)")  # fmt: skip


def _ensure_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel puts it in its own dir."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    # NOTE: the process's PATH gains the wheel's bin dir: torch's builder only looks there.
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def _remove_stale_builds(folder: Path) -> None:
    """Delete build folders left by killed builds (SIGTERM/SIGKILL skip ``TemporaryDirectory``'s
    cleanup) untouched for ``_STALE_BUILD_S``, far longer than a build, so another process's
    build in progress is never removed."""
    cutoff = time.time() - _STALE_BUILD_S
    for entry in folder.glob(".agentcache_kernels_*-*"):
        try:
            if entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry)
        except OSError as exc:  # NOTE: another process removed it first, or a permission
            _log.debug("agentcache: cannot remove %s: %s", entry, exc)


def build(b: Build) -> ModuleType:
    """Compile and link ``b`` (torch's C++ extension builder, the sources in parallel), move the
    library into place and return the loaded module. A failure to compile or link (no compiler
    included) writes ``b``'s marker; a library that built but does not import in this process
    does not (the next process may load it).

    Raises:
        BuildFailed: the reason in one line (``str``) and the compiler's output (``detail``).
    """
    try:
        return _compile_and_load(b)
    except ImportError as exc:  # NOTE: built, then not loadable in this process: not remembered
        raise BuildFailed(_one_line(exc), str(exc)) from exc
    except Exception as exc:  # noqa: BLE001  (no compiler, a compile or link error: remembered)
        reason, detail = _one_line(exc), _detail(exc)
        _write_marker(b, reason, detail)
        raise BuildFailed(reason, detail) from exc


def _compile_and_load(b: Build) -> ModuleType:
    from torch.utils.cpp_extension import load

    _require_compiler()
    _ensure_ninja_on_path()
    b.folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(b.folder)
    _log.warning("agentcache: building native kernels (%s) into %s (once per machine and ISA, "
                 "about 40-90 s)", b.isa, b.folder)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=b.folder, prefix=f".{b.name}-") as tmp:
        load(name=b.name, sources=[str(_HERE / s) for s in SOURCES],
             extra_cflags=[*_CFLAGS, *isa_flags(b.isa)], extra_ldflags=list(_LDFLAGS),
             extra_include_paths=[str(_HERE)], build_directory=tmp, verbose=False)  # fmt: skip
        os.replace(Path(tmp) / f"{b.name}.so", b.library)
    module = sys.modules.get(b.name)
    return module if module is not None else import_library(b.name, b.library)


_ELF_MACHINES = {62: "x86-64", 183: "aarch64"}


def _elf_machine(path: Path) -> str:
    head = path.read_bytes()[:20]
    if head[:4] != b"\x7fELF":
        return "not ELF"
    code = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
    return _ELF_MACHINES.get(code, f"machine {code}")


def compile_only(isa: Isa, cxx: str, out: Path, *, jobs: int = 2) -> list[tuple[Path, str]]:
    """Compile every source of ``isa``'s build with ``cxx`` (a cross compiler, say) to object
    files in ``out``, without linking or loading: torch's and Python's headers, the build's
    flags. Returns ``(object, architecture)`` pairs (``"aarch64"``, ``"x86-64"`` from the ELF
    header).

    Raises:
        BuildFailed: the compiler is missing or a source does not compile (``detail``: its
            error).
    """
    from torch.utils import cpp_extension

    program = shlex.split(cxx) or ["c++"]
    if shutil.which(program[0]) is None:
        raise BuildFailed(f"no C++ compiler: {program[0]!r} not found on PATH")
    abi: list[str] = getattr(cpp_extension, "_get_glibcxx_abi_build_flags", lambda: [])()
    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    flags = [
        "-std=c++20", "-fPIC", "-DTORCH_EXTENSION_NAME=agentcache_kernels_check",
        "-DTORCH_API_INCLUDE_EXTENSION_H", *abi, *_CFLAGS, *isa_flags(isa), f"-I{_HERE}",
        *(f"-isystem{p}" for p in cpp_extension.include_paths()), f"-isystem{python_include}",
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)

    def one(source: str) -> tuple[Path, str]:
        target = out / f"{Path(source).stem}.o"
        done = subprocess.run([*program, *flags, "-c", str(_HERE / source), "-o", str(target)],
                              capture_output=True, text=True, check=False)  # fmt: skip
        if done.returncode != 0:
            raise BuildFailed(f"{source} does not compile for {isa} with {cxx}", done.stderr)
        return target, _elf_machine(target)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, SOURCES))
