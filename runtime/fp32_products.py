"""Which library runs the compact forward's float32 matrix products: MKL or oneDNN.

torch sends an fp32 ``F.linear`` on the CPU to MKL's sgemm. MKL picks its kernels by CPU vendor,
and on AMD it does not run its AVX-512 kernels; oneDNN (also inside torch, reached through the
``mkldnn::_linear_pointwise`` op that torch's inductor uses for linear layers on the CPU) picks
them by instruction set. Both compute in float32 (the same answers within float32 rounding), so
the faster one is a free choice. It is made once per model load by timing both on the model's own
largest layer weight (``choose_products``), separately for products of few rows (decode steps, a
hit's few new tokens) and of many (prefill chunks), since the two libraries' kernels differ in
how they block a few rows.

NOTE: measured on W1's layer products (30 layers of qkv, o, gate_up, down; input-major weights,
2 threads, same run) on an AMD EPYC host, ms for oneDNN vs MKL: 1 row 14.5 vs 20.1, 8 rows 18.0 vs
40.7, 16 rows 25.1 vs 53.1, 64 rows 45.5 vs 114.8, 512 rows 341 vs 695. On the Intel Xeon hosts of
earlier sessions MKL ran 512 rows at 226-313 GFLOP/s (its peak there), so there the measurement
is expected to keep MKL.

``AGENTCACHE_FP32_PRODUCTS``: ``auto`` (or unset) measures; ``mkl`` or ``onednn`` forces one for
every product (``onednn`` only where it can run: see ``onednn_problem``); any other value keeps
MKL and says so in the log (a switch that is not understood is not taken as on).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Literal, NamedTuple, TypeAlias

import torch

__all__ = [
    "FEW_ROWS",
    "PRODUCTS_ENV",
    "MKL_ONLY",
    "Library",
    "ProductChoice",
    "choose_products",
    "onednn_linear",
    "onednn_problem",
]

PRODUCTS_ENV = "AGENTCACHE_FP32_PRODUCTS"
"""``auto`` (default), ``mkl`` or ``onednn``; see the module docstring."""

Library: TypeAlias = Literal["mkl", "onednn"]

FEW_ROWS = 64
"""Products of at most this many rows are "few rows" (decode steps, a hit's new tokens), larger
ones "many" (prefill chunks); each class gets its own library (``ProductChoice``). Also the
packed weights' limit (``compact_llama.PACKED_MAX_ROWS``), whose products run first."""

_FEW_PROBE, _MANY_PROBE = 16, 512  # rows timed for each class (a 16-row step, a 512-token chunk)
_MARGIN = 0.9  # NOTE: oneDNN must take under 90% of MKL's time: a tie keeps torch's default
_REPEATS = 5

logger = logging.getLogger(__name__)


class ProductChoice(NamedTuple):
    """The library of each class of fp32 product, and why."""

    few: Library
    """Products of at most ``FEW_ROWS`` rows (where packed weight copies exist, they serve
    these instead: ``CompactLlama``)."""
    many: Library
    """Larger products."""
    reason: str
    """``"measured: ..."`` (the times), ``"AGENTCACHE_FP32_PRODUCTS=mkl"``, or why oneDNN
    cannot run."""

    def onednn_rows(self) -> tuple[int, int]:
        """``(lo, hi)``: the products of ``lo`` to ``hi`` rows (inclusive) that run on oneDNN
        (``lo > hi``: none), as the C++ layer loop reads the choice."""
        if self.many == "onednn":
            return (1 if self.few == "onednn" else FEW_ROWS + 1), 1 << 62
        return 1, FEW_ROWS if self.few == "onednn" else 0

    def describe(self, *, packed: bool = False) -> str:
        """``"oneDNN products"``, ``"oneDNN products for prefill"`` (many rows only), ``"oneDNN
        products for decode"`` (few rows only), or "" (MKL). ``packed``: packed weight copies
        serve the few-row products (``CompactLlama.packed_products``), so only the many-row
        class is named."""
        if packed:
            return "oneDNN products for prefill" if self.many == "onednn" else ""
        if self.few == self.many:
            return "oneDNN products" if self.few == "onednn" else ""
        return f"oneDNN products for {'decode' if self.few == 'onednn' else 'prefill'}"


MKL_ONLY = ProductChoice("mkl", "mkl", "MKL (torch's default)")


def onednn_problem() -> str | None:
    """Why the fp32 products cannot run on oneDNN here (None when they can): torch built
    without it, no ``mkldnn::_linear_pointwise`` op, or oneDNN's fp32 matmul precision other
    than ``ieee`` (after ``torch.set_float32_matmul_precision("medium")``, say, oneDNN rounds
    fp32 inputs to bf16 or tf32; torch's own ``F.linear`` then goes there too, so the choice
    is left to torch)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return "torch was built without oneDNN"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch has no mkldnn::_linear_pointwise"
    precision = _onednn_matmul_precision()
    if precision != "ieee":
        return f"oneDNN's float32 matmul precision is {precision!r}"
    return None


def _onednn_matmul_precision() -> str:
    """oneDNN's fp32 matmul precision: ``ieee`` (float32), ``tf32``, ``bf16``, or ``unknown``.

    Read from torch's per-backend settings (``torch.backends.mkldnn.matmul.fp32_precision``,
    inheriting from ``torch.backends.mkldnn`` and ``torch.backends`` where ``none``); a torch
    without them has only the legacy ``torch.get_float32_matmul_precision()``, which raises
    when the settings were mixed (so it is read last, and a failure reads as ``unknown``).
    """
    mkldnn = torch.backends.mkldnn
    for holder in (getattr(mkldnn, "matmul", None), mkldnn, torch.backends):
        value = getattr(holder, "fp32_precision", None)
        if isinstance(value, str) and value != "none":
            return value
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        return "unknown"
    return "ieee" if legacy == "highest" else "tf32" if legacy == "high" else "bf16"


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on oneDNN: ``x`` ``[..., K]`` fp32 CPU, ``weight``
    ``[N, K]`` (any strides; the compact forward's are input-major views), ``bias`` ``[N]`` or
    None; returns ``[..., N]``. Float32 multiply-adds: equal to MKL's within float32 rounding.

    Raises:
        RuntimeError: from the op (shapes that do not match, a tensor not on the CPU).
    """
    flat = x.reshape(-1, x.shape[-1])
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def _best_of(fn: object, other: object) -> tuple[float, float]:
    """Min seconds of ``fn`` and ``other`` (callables), run alternately after a warm-up each."""
    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(_REPEATS + 1):
        for k, f in enumerate((fn, other)):
            start = time.perf_counter()
            f()  # type: ignore[operator]
            if rep:
                times[k].append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


def _measure(weight: torch.Tensor, rows: int) -> tuple[float, float]:
    # NOTE: a generator of its own: measuring must not move the caller's random stream
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype,
                    generator=torch.Generator().manual_seed(rows))  # fmt: skip
    with torch.no_grad():
        return _best_of(lambda: torch.nn.functional.linear(x, weight),
                        lambda: onednn_linear(x, weight, None))  # fmt: skip


def choose_products(weight: torch.Tensor) -> ProductChoice:
    """The libraries for a model's fp32 products, by ``AGENTCACHE_FP32_PRODUCTS`` or, by
    default, by timing ``weight`` (``[N, K]`` fp32 CPU, as the forward stores it: pass the
    largest) through both at 16 and 512 rows (five alternating runs each after a warm-up, the
    fastest of each kept). oneDNN is chosen for a class when it took under 90% of MKL's time.
    About 0.1-0.2 s on W1's gate-up weight, once per process for each weight shape and thread
    count (later loads reuse the choice).

    Never raises: oneDNN unavailable (``onednn_problem``) keeps MKL, with the reason.
    """
    setting = os.environ.get(PRODUCTS_ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "mkl", "onednn"):
        logger.warning("agentcache: %s=%r is not auto, mkl or onednn; fp32 products run on MKL",
                       PRODUCTS_ENV, setting)  # fmt: skip
        return MKL_ONLY._replace(reason=f"{PRODUCTS_ENV}={setting!r} not understood")
    if setting == "mkl":
        return MKL_ONLY._replace(reason=f"{PRODUCTS_ENV}=mkl")
    problem = onednn_problem()
    if problem is None and (weight.dtype != torch.float32 or weight.device.type != "cpu"):
        problem = f"weights are {weight.dtype} on {weight.device.type}, not fp32 on the CPU"
    if problem is not None:
        if setting == "onednn":
            logger.warning("agentcache: %s=onednn, but %s; fp32 products run on MKL",
                           PRODUCTS_ENV, problem)  # fmt: skip
        return MKL_ONLY._replace(reason=f"MKL: {problem}")
    if setting == "onednn":
        return ProductChoice("onednn", "onednn", f"{PRODUCTS_ENV}=onednn")
    key = (tuple(weight.shape), torch.get_num_threads())
    with _MEASURING:  # NOTE: engines loading at once measure once and agree
        if key not in _MEASURED:
            _MEASURED[key] = _measured_choice(weight)
        return _MEASURED[key]


_MEASURED: dict[tuple[tuple[int, ...], int], ProductChoice] = {}
"""Measured choices by (weight shape, torch threads): a process measures each once, so that
engines loaded side by side (a benchmark's cache-on and cache-off engines) run the same
products."""
_MEASURING = threading.Lock()


def _measured_choice(weight: torch.Tensor) -> ProductChoice:
    mkl_few, dnn_few = _measure(weight, _FEW_PROBE)
    mkl_many, dnn_many = _measure(weight, _MANY_PROBE)
    few: Library = "onednn" if dnn_few < _MARGIN * mkl_few else "mkl"
    many: Library = "onednn" if dnn_many < _MARGIN * mkl_many else "mkl"
    shape = "x".join(str(s) for s in weight.shape)
    reason = (f"measured on a {shape} weight: {_FEW_PROBE} rows oneDNN {dnn_few * 1e3:.2f} vs MKL "
              f"{mkl_few * 1e3:.2f} ms, {_MANY_PROBE} rows {dnn_many * 1e3:.2f} vs "
              f"{mkl_many * 1e3:.2f} ms")  # fmt: skip
    return ProductChoice(few, many, reason)
