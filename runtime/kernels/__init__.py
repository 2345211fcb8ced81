"""Native (C++) kernels of the compact forward, compiled on this machine on first use.

In ``decode_attention.cpp``: ``decode_attention``, one query per row over grouped KV
heads, fp32, as flash-decoding does it (blocks of keys on torch's intra-op threads, block-local
softmax, one merge); and ``DecodeLayers``, the layer loop of a compact decode step in C++:
the products through ATen (MKL), RMSNorm and RoPE as plain loops, RoPE'd keys and the values
written straight into the KV slots. It equals the Python loop within float32 rounding (sums
reassociated, multiply-adds fused) without the Python and dispatch overhead of about 25 small
ops per layer; and ``linear_packed``, a product with fp32 inputs and outputs over weights packed
in blocks of 32 output columns (``pack_weight``), as bfloat16 (``weights="bfloat16"``: half the
bytes) or float32 (``weights="float32-packed"``: a copy the small products of a decode step
stream at the read bandwidth, where MKL's product of 8-16 rows does not); ``linear_rows``,
a product of 1-8 rows straight from the compact forward's own input-major fp32 weights (no copy),
each thread streaming a contiguous range of them; and ``prefix_attention``, the unmasked
attention of a packed prefill's tokens to the prefix their segments share
(``CompactLlama.forward_packed``'s cascade), flash-style with register tiles.

NOTE: measured on W1 (30 layers, 3 KV heads of 64, 2 threads, same process, noisy host):
the attention over 2,001 cached tokens (caches flushed between layers) took 7.9 ms per decode
step against 14.6 ms for the two ``torch.matmul`` of ``compact_llama._decode_attention``, whose
``q . K^T`` product streams K at about half the read bandwidth (a plain read of the same K/V:
7.3 ms); the whole decode step after 2,000 tokens, 6 rounds alternating, was 1.37-1.53x faster
than the torch path (41.0 against 60.3 ms median).

It is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja) into a per-machine
cache directory, ``$AGENTCACHE_KERNEL_DIR`` or ``~/.cache/agentcache/kernels``, keyed by the
source, flags, torch and Python versions and the CPU's feature flags (``-march=native``), so a
directory shared between machines never loads a binary built for another CPU. The first build
takes about 35-90 s on 2 cores (53 s on a fresh clone here, under load); later processes load
the cached library in milliseconds. A build
goes to a private temporary directory and is renamed into place, so concurrent first builds
never read a half-written library and a killed build leaves no lock behind (its directory,
left by SIGTERM or SIGKILL, is removed by the next build after an hour). Concurrent first
builds each compile: both load, the last rename wins.

Flags: ``-O3 -march=native -fopenmp`` (``at::parallel_for`` is header code that needs OpenMP
to run on torch's threads; the library's ``libgomp.so.1`` resolves to the one torch already
loaded, by soname) and reassociation (``-fassociative-math -fno-signed-zeros
-fno-trapping-math``) so that dot products reduce as a tree instead of 15 dependent adds.
Infinities keep their meaning (no ``-ffinite-math-only``): masked keys are ``-inf``.

``AGENTCACHE_NATIVE_KERNELS=0`` turns the kernels off (the torch path runs instead); a missing
compiler or a failed build does the same, says why once on stderr (logging), and
``native_status()`` returns the reason.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

__all__ = [
    "DISABLE_ENV",
    "KERNEL_DIR_ENV",
    "DecodeAttention",
    "NativeKernels",
    "NativeStatus",
    "native_kernels",
    "native_status",
    "pack_weight",
]

DISABLE_ENV = "AGENTCACHE_NATIVE_KERNELS"
"""Set to ``0`` (or ``false``, ``no``, ``off``) to run the torch path instead of the native
kernels; ``1``, ``true``, ``yes``, ``on`` or unset: use them. Any other value runs the torch
path and says so (a switch that is not understood is not taken as on)."""
_OFF, _ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")
KERNEL_DIR_ENV = "AGENTCACHE_KERNEL_DIR"
"""Where built kernels are cached (default ``~/.cache/agentcache/kernels``)."""

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("decode_attention.cpp")
_CFLAGS = (
    "-O3", "-march=native", "-fopenmp",
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
)  # fmt: skip
_LDFLAGS = ("-fopenmp",)
_PREFIX = "agentcache_decode_attention_"
_STALE_BUILD_S = 3600.0  # NOTE: a first build takes about 35-90 s on 2 cores

DecodeAttention = Callable[..., Any]
"""``(q [B, H, D], k [B, H_kv, T, D], v, mask [B, T] additive fp32 or None, scale, src=None,
shared=None) -> [B, H, D]``, all fp32 CPU tensors (K/V with a contiguous last dim, any other
strides). A row whose every key is masked gets zeros. ``src`` / ``shared`` (``[B]`` int64,
together): row ``b``'s keys ``[0, shared[b])`` are byte for byte row ``src[b]``'s, so whole
blocks of them are read from there, once for every row sharing them, and those rows' queries
run together (the same output within float32 rounding; see ``BatchKV.share_prefix``)."""


class NativeKernels(NamedTuple):
    """The built kernels (see the module docstring)."""

    decode_attention: DecodeAttention
    decode_layers: Any
    """The ``DecodeLayers`` class: built from one model's compact weights, ``run`` is the
    layer loop of one decode step (``CompactLlama.forward`` with ``slots``)."""
    packed_vectorized: bool
    """Whether ``linear_packed`` was compiled with AVX-512 (F and BW). Without it the library
    still builds, but ``linear_packed`` runs a scalar loop (about 12x slower than MKL on a
    3072 x 576 product of 8 rows), so the compact forward keeps no packed copies."""
    linear_packed: Callable[..., Any]
    """``(x [..., K] fp32, packed, bias [N] fp32 or None, n) -> [..., N] fp32``: ``x . W^T +
    bias`` with ``W`` (``[N, K]``) packed by ``pack_weight`` (bf16 or fp32); fp32 multiply-adds,
    so it equals ``F.linear`` over the packed (for bf16: rounded) weights within float32
    rounding."""
    linear_rows: Callable[..., Any]
    """``(x [..., K] fp32, w [N, K] fp32 input-major, bias [N] fp32 or None) -> [..., N]``:
    ``x . w^T + bias`` for few rows straight from the compact forward's input-major weights
    (``w`` the ``[N, K]`` view, strides ``(1, N)``, of a contiguous ``[K, N]`` tensor), each
    thread streaming a contiguous range of K; fp32 multiply-adds, so it equals ``F.linear``
    within float32 rounding. Raises ``RuntimeError`` on another layout or dtype."""
    prefix_attention: Callable[..., Any]
    """``(q [H_kv, M, D], k [H_kv, S, D], v, scale) -> [out [H_kv, M, D], lse [H_kv, M]]``, fp32
    CPU, ``D`` a multiple of 16 up to 128, V rows contiguous: unmasked attention of many queries
    to one run of keys and the log-sum-exp of their scaled scores, as torch's CPU flash kernel
    returns them (``compact_llama._lse_attention``), equal within float32 rounding; about 1.45x
    faster at W1's shapes on an AMD EPYC host (see the source)."""


class NativeStatus(NamedTuple):
    """Whether the native kernels run here, and why not when they do not."""

    loaded: bool
    reason: str
    """What was loaded (the library's path) or why nothing was."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _key() -> str:
    import torch

    parts = [
        _SOURCE.read_bytes().hex(), " ".join(_CFLAGS + _LDFLAGS), torch.__version__,
        sys.version, platform.machine(), _cpu_flags(),
    ]  # fmt: skip
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _kernel_dir() -> Path:
    configured = os.environ.get(KERNEL_DIR_ENV)
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "agentcache" / "kernels"


def _import(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None, path
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


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


def _require_compiler() -> None:
    """Fail at once, naming it, when torch's builder would find no C++ compiler: it would print
    a compiler-compatibility warning and end in a ninja error whose last line says 'not found'.

    Raises:
        FileNotFoundError: ``$CXX`` (default ``c++``, as torch's builder reads it) is not on PATH.
    """
    cxx = os.environ.get("CXX", "c++")
    program = (shlex.split(cxx) or ["c++"])[0]
    if shutil.which(program) is None:
        raise FileNotFoundError(f"no C++ compiler: {program!r} not found on PATH (install g++, "
                                "or set CXX)")  # fmt: skip


def _remove_stale_builds(folder: Path) -> None:
    """Delete build dirs left by killed builds (SIGTERM/SIGKILL skip ``TemporaryDirectory``'s
    cleanup): those of this kernel (any key) untouched for ``_STALE_BUILD_S``, far longer than a
    build, so another process's build in progress is never removed."""
    cutoff = time.time() - _STALE_BUILD_S
    for entry in folder.glob(f".{_PREFIX}*-*"):
        try:
            if entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry)
        except OSError as exc:  # NOTE: another process removed it first, or a permission
            _log.debug("agentcache: cannot remove %s: %s", entry, exc)


def _build(name: str, target: Path) -> None:
    from torch.utils.cpp_extension import load

    _require_compiler()
    _ensure_ninja_on_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(target.parent)
    _log.warning("agentcache: building native kernels into %s (once per machine, about 35-90 s)",
                 target.parent)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        load(name=name, sources=[str(_SOURCE)], extra_cflags=list(_CFLAGS),
             extra_ldflags=list(_LDFLAGS), build_directory=tmp, verbose=False)  # fmt: skip
        built = Path(tmp) / f"{name}.so"
        os.replace(built, target)


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    switch = os.environ.get(DISABLE_ENV, "").strip()
    if switch.lower() in _OFF:
        return None, f"{DISABLE_ENV}={switch}"
    if switch.lower() not in _ON:
        reason = f"{DISABLE_ENV}={switch!r} is not 0 or 1"
        _log.warning("agentcache: %s; decode runs on the torch path", reason)
        return None, reason
    try:
        import torch  # noqa: F401  (the library links against the loaded torch)

        name = f"{_PREFIX}{_key()}"
        target = _kernel_dir() / f"{name}.so"
        if target.exists() and not target.is_file():  # NOTE: a build could never replace it
            return None, f"native kernels: {target} exists and is not a file"
        if target.is_file():
            try:
                return _import(name, target), str(target)
            except ImportError as exc:  # NOTE: a damaged file (disk, copy): built again below
                _log.warning("agentcache: cannot load %s (%s); rebuilding it", target, exc)
        _build(name, target)
        return sys.modules.get(name) or _import(name, target), str(target)
    except Exception as exc:  # noqa: BLE001  (any build or load failure: the torch path runs)
        lines = [line for line in str(exc).splitlines() if line.strip()]
        tail = " | ".join(lines[-3:]) if lines else type(exc).__name__
        # NOTE: the end: a compiler's error follows a command line of about 700 characters.
        reason = f"native kernel build failed ({type(exc).__name__}: {tail[-400:]})"
        _log.warning("agentcache: %s; decode runs on the torch path", reason)
        return None, reason


def native_kernels() -> NativeKernels | None:
    """The native kernels, or None where they cannot run.

    Builds them on first use in this machine's kernel cache (about 35-90 s once; see the module
    docstring); never raises: a failure leaves the torch path and ``native_status()`` says why.
    """
    module, _ = _load()
    if module is None:
        return None
    return NativeKernels(
        module.decode_attention,
        module.DecodeLayers,
        bool(getattr(module, "packed_vectorized", False)),
        module.linear_packed,
        module.linear_rows,
        module.prefix_attention,
    )


def native_status() -> NativeStatus:
    """Whether the native kernels loaded (building them first if needed), and from where or why
    not."""
    module, reason = _load()
    return NativeStatus(module is not None, reason)


PACKED_COLUMNS = 32
"""Output columns per packed block of ``pack_weight`` (one 64-byte line of bf16, two of fp32,
per input)."""


def _bf16_order() -> list[int]:
    """Column held at each position of a packed bf16 line: AVX-512's unpack of 16-bit lanes
    widens positions ``8l + j`` (``j < 4``) to fp32 lane ``4l + j`` of the low half and the
    others to lane ``16 + 4l + j - 4``, so the kernel widens a line with two shuffles."""
    return [lane * 4 + j if j < 4 else 16 + lane * 4 + j - 4
            for lane in range(PACKED_COLUMNS // 8) for j in range(8)]  # fmt: skip


def pack_weight(weight: Any, dtype: Any) -> Any:
    """``weight`` (``[N, K]`` float, any strides) packed for ``linear_packed``: ``[ceil(N / 32),
    K, 32]`` contiguous ``dtype``, block ``b`` holding output columns ``[32 b, 32 b + 32)`` (zero
    past ``N``), so each block is one contiguous stream of ``K`` lines.

    Args:
        weight: ``[N, K]`` floating point.
        dtype: ``torch.bfloat16`` (rounded nearest even, as ``Tensor.to``; the columns of a line
            in the kernel's widening order, ``_bf16_order``) or ``torch.float32`` (the values
            as they are, columns in order).

    The two layouts have the same shape: a bf16 packing converted with ``.float()`` (or the
    reverse) reads permuted columns; pack again instead.

    Raises:
        ValueError: ``dtype`` is neither, or ``weight`` is not 2-D.
    """
    import torch

    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"pack_weight: dtype must be torch.bfloat16 or torch.float32, not {dtype}")
    if weight.dim() != 2:
        raise ValueError(f"pack_weight: weight must be 2-D [N, K], not {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = -(-n // PACKED_COLUMNS)
    padded = torch.zeros(blocks * PACKED_COLUMNS, k, dtype=dtype)
    padded[:n] = weight.detach().to(dtype)
    lines = padded.view(blocks, PACKED_COLUMNS, k)
    if dtype == torch.bfloat16:
        lines = lines[:, torch.tensor(_bf16_order())]
    return lines.transpose(1, 2).contiguous()
