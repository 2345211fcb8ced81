"""Choosing, building and loading the native kernels (``runtime.model.kernels``): the ISA from the
switch and the CPU, one folder per ISA, a damaged library rebuilt, a failed build remembered once
per machine, no compiler at all, and ``python -m runtime.model.kernels``.

The build tests never compile: a recording script stands in for the compiler (it logs each call
and fails), so they show what the loader tries, in milliseconds; the real builds are the ones
every kernel test loads (``tests/runtime/kernel_isas.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.model.kernels import _isa
from runtime.model.kernels._build import MARKER, build_of
from runtime.model.kernels._isa import ISAS, choose_isa, isa_flags
from tests.conftest import save_tiny_model

AVX512_CPU = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                        "avx512dq"})  # fmt: skip
AVX2_CPU = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})


def _cpu(monkeypatch: pytest.MonkeyPatch, arch: str, features: frozenset[str]) -> None:
    monkeypatch.setattr(_isa, "_arch", lambda: arch)
    monkeypatch.setattr(_isa, "cpu_features", lambda: features)


@pytest.mark.parametrize(
    ("arch", "features", "isa", "why"),
    [
        ("x86_64", AVX512_CPU, "avx512", "native: avx512"),
        ("x86_64", AVX2_CPU, "avx2",
         "native: avx2 (this CPU lacks avx512f, avx512bw, avx512vl, avx512dq)"),
        ("x86_64", frozenset({"sse2", "avx"}), "scalar",
         "native: scalar (this CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx2, fma)"),
        ("aarch64", frozenset({"fp", "asimd"}), "neon", "native: neon"),
        ("riscv64", frozenset(), "scalar", "native: scalar"),
    ],
)  # fmt: skip
def test_native_is_the_best_isa_the_cpu_has(
    arch: str, features: frozenset[str], isa: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cpu(monkeypatch, arch, features)
    for env in ({}, {"AGENTCACHE_KERNEL_ISA": "native"}, {"AGENTCACHE_KERNEL_ISA": " Native "}):
        assert choose_isa(env) == (isa, why, False)


def test_an_isa_is_taken_only_where_the_cpu_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for by name, an ISA runs only on a CPU that has it (a build of another would crash
    the process at its first instruction): otherwise None, with a warning that says what is
    missing. The switches off, and values that are not understood, never build anything."""
    _cpu(monkeypatch, "x86_64", AVX2_CPU)
    assert choose_isa({"AGENTCACHE_KERNEL_ISA": "avx2"}) == (
        "avx2",
        "AGENTCACHE_KERNEL_ISA=avx2",
        False,
    )
    assert choose_isa({"AGENTCACHE_KERNEL_ISA": "SCALAR"}).isa == "scalar"
    assert choose_isa({"AGENTCACHE_KERNEL_ISA": "avx512"}) == (
        None, "AGENTCACHE_KERNEL_ISA=avx512, but this CPU lacks avx512f, avx512bw, avx512vl, "
        "avx512dq", True)  # fmt: skip
    assert choose_isa({"AGENTCACHE_KERNEL_ISA": "neon"}) == (
        None, "AGENTCACHE_KERNEL_ISA=neon, but this CPU lacks an aarch64 CPU (this is x86_64)", True
    )  # fmt: skip
    assert choose_isa({"AGENTCACHE_KERNEL_ISA": "off"}) == (
        None,
        "AGENTCACHE_KERNEL_ISA=off",
        False,
    )
    assert choose_isa({"AGENTCACHE_KERNEL_ISA": "avx9"}) == (
        None, "AGENTCACHE_KERNEL_ISA='avx9' is not one of native, avx512, avx2, neon, scalar, off",
        True)  # fmt: skip
    # the older switch wins over the ISA: 0 is off, anything not understood is not taken as on
    off = {"AGENTCACHE_NATIVE_KERNELS": "Off", "AGENTCACHE_KERNEL_ISA": "avx2"}
    assert choose_isa(off) == (None, "AGENTCACHE_NATIVE_KERNELS=Off", False)
    assert choose_isa({"AGENTCACHE_NATIVE_KERNELS": "flase"}) == (
        None, "AGENTCACHE_NATIVE_KERNELS='flase' is not 0 or 1", True)  # fmt: skip
    assert choose_isa({"AGENTCACHE_NATIVE_KERNELS": "1"}).isa == "avx2"


def test_each_isa_builds_with_its_own_flags_into_its_own_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Flags name the ISA (never ``-march=native``: a build is keyed by what it may execute);
    every ISA, and every compiler, has its own folder and module name."""
    monkeypatch.setenv("AGENTCACHE_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert "-mavx512f" in isa_flags("avx512") and "-mfma" in isa_flags("avx2")
    assert not any("avx512" in flag for flag in isa_flags("avx2"))
    assert not any(flag.startswith(("-m", "-march")) for flag in isa_flags("scalar"))
    assert all("native" not in flag for isa in ISAS for flag in isa_flags(isa))
    builds = [build_of(isa) for isa in ISAS]
    assert len({b.folder for b in builds}) == len({b.name for b in builds}) == len(ISAS)
    for b in builds:
        assert b.folder.parent == tmp_path and b.folder.name.startswith(f"{b.isa}-")
        assert b.library.parent == b.marker.parent == b.folder
    monkeypatch.setenv("CXX", "clang++")
    assert build_of("avx2").folder != builds[ISAS.index("avx2")].folder


def _recording_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for a broken compiler (``CXX=false``, say) that also logs each call: it fails
    whatever it is asked, its version included, with a message on stderr."""
    log, script = tmp_path / "calls.log", tmp_path / "fake-c++"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "fake-c++: error: simulated" >&2\n'
                      "exit 1\n")  # fmt: skip
    script.chmod(0o755)
    return script, log


def _child(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600, check=False)  # fmt: skip


STATUS = ("from runtime.model.kernels import native_kernels, native_status; "
          "print(native_kernels() is None, native_status().reason)")  # fmt: skip


def test_a_damaged_library_is_rebuilt_and_stale_build_folders_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A truncated library (a damaged disk or copy) is not loaded: a build starts (here the
    stand-in compiler fails it, so the status names the failure). The build folder of a build
    killed two hours ago goes; a fresh one, maybe another process's build, and other files
    stay."""
    cxx, log = _recording_compiler(tmp_path)
    env = {"AGENTCACHE_KERNEL_DIR": str(tmp_path / "k"), "CXX": str(cxx),
           "AGENTCACHE_KERNEL_ISA": "scalar"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    b = build_of("scalar")
    b.folder.mkdir(parents=True)
    b.library.write_bytes(b"\x7fELF truncated")
    stale, busy = b.folder / f".{b.name}-x1", b.folder / f".{b.name}-x2"
    for folder in (stale, busy):
        folder.mkdir()
        (folder / "build.ninja").write_text("")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    (b.folder / "notes.txt").write_text("mine")
    done = _child(STATUS, env)
    assert done.stdout.startswith("True native kernel build failed (")
    assert "simulated" in b.marker.read_text()
    assert f"cannot load {b.library}" in done.stderr and log.read_text()  # a build was tried
    names = {p.name for p in b.folder.iterdir()}
    assert stale.name not in names and {busy.name, "notes.txt", MARKER} <= names


def test_a_directory_where_the_library_goes_fails_fast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory at the library's path could never be replaced by a build: the loader says so
    at once instead of compiling for a minute and failing on every start."""
    env = {"AGENTCACHE_KERNEL_DIR": str(tmp_path), "AGENTCACHE_KERNEL_ISA": "scalar"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    library = build_of("scalar").library
    library.mkdir(parents=True)
    done = _child(STATUS, env)
    assert done.stdout.strip() == f"True native kernels: {library} exists and is not a file"
    assert [p.name for p in library.parent.iterdir()] == [library.name]


def test_switches_and_an_unusable_kernel_dir_leave_the_torch_path(tmp_path: Path) -> None:
    """Off, not understood, an ISA this CPU lacks, or a kernel dir that cannot be created: None
    with the reason, never an exception; a mistake is said once on stderr."""
    for env, want in (
        ({"AGENTCACHE_NATIVE_KERNELS": "0"}, "True AGENTCACHE_NATIVE_KERNELS=0"),
        ({"AGENTCACHE_KERNEL_ISA": "off"}, "True AGENTCACHE_KERNEL_ISA=off"),
        ({"AGENTCACHE_KERNEL_ISA": "sse9"}, "True AGENTCACHE_KERNEL_ISA='sse9' is not one of "
         "native, avx512, avx2, neon, scalar, off"),
    ):  # fmt: skip
        done = _child(STATUS, env)
        assert done.stdout.strip() == want
        assert done.stderr.count("agentcache: ") == (1 if "not one of" in want else 0)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    done = _child(STATUS, {"AGENTCACHE_KERNEL_DIR": str(blocker / "kernels"),
                           "AGENTCACHE_KERNEL_ISA": "scalar"})  # fmt: skip
    assert done.stdout.startswith("True native kernel build failed (") and "Error" in done.stdout


ENGINE = (
    "import sys; from runtime.engine import Engine\n"
    "from runtime.sampling.params import SamplingParams\n"
    "from runtime.model.kernels import native_status\n"
    "e = Engine.from_pretrained(sys.argv[1])\n"
    "c = e.generate([5, 9, 12], SamplingParams(ignore_eos=True, max_tokens=4))\n"
    "print(e.runner.decode_attention, c.usage.completion_tokens, native_status().reason)\n"
)


def test_a_broken_compiler_fails_once_per_machine(tmp_path: Path) -> None:
    """A compiler that fails (``CXX`` set to one): the first process compiles, fails, writes the
    marker with the compiler's error and runs the torch path; the next one does not compile
    again, warns once naming the marker and how to retry, and its engine answers; ``python -m
    runtime.model.kernels build`` or removing the marker tries again."""
    cxx, log = _recording_compiler(tmp_path)
    model = str(save_tiny_model("llama", tmp_path / "model"))
    env = {"AGENTCACHE_KERNEL_DIR": str(tmp_path / "k"), "CXX": str(cxx),
           "AGENTCACHE_KERNEL_ISA": "scalar"}  # fmt: skip
    first = _child(ENGINE, env, model)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("torch 4 native kernel build failed (")
    markers = list((tmp_path / "k").glob(f"scalar-*/{MARKER}"))
    assert len(markers) == 1 and "fake-c++: error: simulated" in markers[0].read_text()
    calls = log.read_text()
    second = _child(ENGINE, env, model)
    assert second.returncode == 0 and second.stdout.startswith("torch 4 ")
    assert log.read_text() == calls  # nothing compiled
    warnings = [line for line in second.stderr.splitlines() if line.startswith("agentcache: ")]
    assert len(warnings) == 1 and str(markers[0]) in warnings[0]
    assert "python -m runtime.model.kernels build --isa scalar" in warnings[0]
    kernel_cli = [sys.executable, "-m", "runtime.model.kernels"]
    retry = subprocess.run([*kernel_cli, "build", "--isa", "scalar"],
                           capture_output=True, text=True, env={**os.environ, **env},
                           timeout=600, check=False)  # fmt: skip
    assert retry.returncode == 1 and "simulated" in retry.stderr
    assert len(log.read_text()) > len(calls)
    calls = log.read_text()
    markers[0].unlink()
    assert _child(STATUS, env).stdout.startswith("True native kernel build failed (")
    assert len(log.read_text()) > len(calls) and markers[0].exists()


def test_no_compiler_at_all_still_runs_on_the_torch_path(tmp_path: Path) -> None:
    """No C++ compiler on PATH (a bare macOS or Windows machine): the reason names it at once
    (not a 700-character compiler command line), without torch's compiler warning, and the
    engine answers on the torch path."""
    model = str(save_tiny_model("llama", tmp_path / "model"))
    env = {"PATH": str(tmp_path), "AGENTCACHE_KERNEL_DIR": str(tmp_path / "k")}
    base = {k: v for k, v in os.environ.items() if k != "CXX"}
    done = subprocess.run([sys.executable, "-c", ENGINE, model], capture_output=True, text=True,
                          env={**base, **env}, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(
        "torch 4 native kernel build failed (FileNotFoundError: no C++ compiler: 'c++' not found "
        "on PATH (install g++, or set CXX))"
    )
    assert "WARNING" not in done.stderr


def _kernels_command(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "runtime.model.kernels", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env},
                          timeout=600, check=False)  # fmt: skip


def test_kernels_command(tmp_path: Path) -> None:
    """``info`` names the CPU's features, the ISA chosen and why, the folder and the state;
    ``build`` refuses what it cannot do with exit 2 and reports a compiler that fails with 1."""
    done = _kernels_command("info", AGENTCACHE_KERNEL_DIR=str(tmp_path),
                            AGENTCACHE_KERNEL_ISA="scalar")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cpu: ") and lines[1].startswith("  features: ")
    assert "isa: scalar (AGENTCACHE_KERNEL_ISA=scalar)" in lines
    assert f"build folder: {tmp_path}/scalar-" in done.stdout
    assert "library: not built yet" in done.stdout and not any(tmp_path.iterdir())
    missing = _kernels_command("build", "--compile-only", "--cxx", str(tmp_path / "no-such-c++"))
    assert missing.returncode == 1 and "not found on PATH" in missing.stderr
    cxx, _ = _recording_compiler(tmp_path)
    failing = _kernels_command("build", "--isa", "scalar", "--compile-only", "--cxx", str(cxx))
    assert failing.returncode == 1 and "does not compile for scalar" in failing.stderr
    assert "simulated" in failing.stderr
    bad = _kernels_command("build", "--out", str(tmp_path))
    assert bad.returncode == 2 and "--out goes with --compile-only" in bad.stderr
    other = next(isa for isa in ("neon", "avx512", "avx2") if _isa.missing_features(isa))
    refused = _kernels_command("build", "--isa", other)
    assert refused.returncode == 2 and f"this CPU cannot run {other}" in refused.stderr


def test_an_isa_this_cpu_lacks_is_never_built_or_loaded(tmp_path: Path) -> None:
    """Asked for by name (``native_kernels("neon")`` on x86, say), an ISA this CPU cannot run
    gives None at once: building it would cost a minute, and loading it would kill the process
    at its first vector instruction."""
    from runtime.model.kernels import native_kernels, native_status

    other = next(isa for isa in ("neon", "avx512", "avx2") if _isa.missing_features(isa))
    assert native_kernels(other) is None  # type: ignore[arg-type]
    status = native_status(other)  # type: ignore[arg-type]
    assert not status.loaded and status.reason.startswith("native kernels: this CPU cannot run")
    assert not build_of(other).folder.exists()  # type: ignore[arg-type]


def test_the_kernel_dir_follows_agentcache_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from runtime.model.kernels._build import kernel_dir

    monkeypatch.delenv("AGENTCACHE_KERNEL_DIR", raising=False)
    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path / "home"))
    assert kernel_dir() == tmp_path / "home" / "kernels"
    monkeypatch.setenv("AGENTCACHE_KERNEL_DIR", str(tmp_path / "k"))  # NOTE: the explicit one wins
    assert kernel_dir() == tmp_path / "k"
