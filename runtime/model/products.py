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

The products of a few rows (a decode step of one to ``ROWS_MAX`` requests, where every weight
is read for little arithmetic) have a third candidate where the native kernels are vectorized
(any ISA but scalar): ``runtime.model.kernels``' ``linear_rows``, which streams the same input-major
weights (no copy) and is chosen for up to ``ROWS_MAX`` rows when it took under 90% of the
few-row library's time at 16 rows, else for one row when it did so at 1 row. NOTE: measured on
W1's 30 layers of products (AMD EPYC host with AVX-512, 2 threads, same run), ms for
``linear_rows`` / oneDNN / MKL: 1 row 13.4-15.7 / 30.9-35.4 / 30.5-32.6; 4 rows 20.5-22.5 /
29.7-33.1 / 65.1-76.8; 8 rows 25.7-31.7 / 30.8-37.2 / 54.7-82.4; 16 rows 38.4-56.1 / 39.7-45.3;
the LM head (49,152 x 576) at 1 row 4.5 / 10.8 / 5.6. From 3 rows ``linear_rows`` now runs
register tiles (``runtime/model/kernels/products.cpp``): on SmolLM2-135M's 30 layers of products
(1 thread, CPU time, same run) 16 rows 24.9 vs oneDNN 28.5 ms, 32 rows 39.3 vs 45.2, 64 rows
69.8 vs 72.1 (hence ``ROWS_MAX = 32``); the LM head at 16 rows 9.3 vs 9.1 (a tie).

``AGENTCACHE_FP32_PRODUCTS``: ``auto`` (or unset) measures; ``mkl`` or ``onednn`` forces one for
every product, ``linear_rows`` included (``onednn`` only where it can run: see
``onednn_problem``); any other value keeps MKL and says so in the log (a switch that is not
understood is not taken as on).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Literal, NamedTuple, TypeAlias

import torch

__all__ = [
    "FEW_ROWS",
    "ROWS_MAX",
    "PRODUCTS_ENV",
    "MKL_ONLY",
    "Library",
    "ProductChoice",
    "choose_prefix_attention",
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

ROWS_MAX = 32
"""Products of at most this many rows may run in the native ``linear_rows`` kernel
(``ProductChoice.rows``); measured barely faster than oneDNN at 64 rows (module docstring)."""

# rows timed for each class (a 16-row step, a 512-token chunk) and for linear_rows
_FEW_PROBE, _MANY_PROBE, _ROWS_PROBE = 16, 512, 16
_STREAM_BYTES = 256 << 20
"""``linear_rows`` is timed over copies of the weight totalling about this many bytes (at most
``_STREAM_COPIES``; W1: 64 of 3.5 MB), more than a last-level cache, as a decode step reads its
weights: from memory. NOTE: timed on the one W1 weight (3.5 MB, cache-resident) it tied oneDNN
at 4 rows (0.06 vs 0.07 ms) while over the 30 layers it was 1.4x faster; the copies live only
while measuring."""
_STREAM_COPIES = 64
"""At most this many copies: a model whose weights are this small (a test's) stays in cache in
its decode steps too, and thousands of tiny products would only cost load time."""
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
    rows: int = 0
    """Products of at most this many rows (0, 1 or ``ROWS_MAX``) run in the native ``linear_rows``
    kernel instead of either library (packed weight copies, where they exist, still come
    first)."""

    def onednn_rows(self) -> tuple[int, int]:
        """``(lo, hi)``: the products of ``lo`` to ``hi`` rows (inclusive) that run on oneDNN
        (``lo > hi``: none), as the C++ layer loop reads the choice."""
        if self.many == "onednn":
            return (1 if self.few == "onednn" else FEW_ROWS + 1), 1 << 62
        return 1, FEW_ROWS if self.few == "onednn" else 0

    def describe(self, *, packed: bool = False) -> str:
        """``"oneDNN products"``, ``"oneDNN products for prefill"`` (many rows only), ``"oneDNN
        products for decode"`` (few rows only), or "" (MKL), then with ``rows``
        ``"linear_rows up to 32 rows"`` (joined by ", "). ``packed``: packed weight copies serve
        the few-row products (``CompactLlama.packed_products``), so only the many-row class is
        named."""
        if packed:
            return "oneDNN products for prefill" if self.many == "onednn" else ""
        if self.few == self.many:
            library = "oneDNN products" if self.few == "onednn" else ""
        else:
            library = f"oneDNN products for {'decode' if self.few == 'onednn' else 'prefill'}"
        rows = (f"linear_rows up to {self.rows} rows" if self.rows > 1
                else "linear_rows for 1 row" if self.rows else "")  # fmt: skip
        return ", ".join(part for part in (library, rows) if part)


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


_Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _measure(
    weights: list[torch.Tensor], rows: int, first: _Product | None = None,
    second: _Product | None = None,
) -> tuple[float, float]:  # fmt: skip
    """Best seconds of ``first`` (default MKL) and ``second`` (default oneDNN), each run one
    product of ``rows`` rows per weight of ``weights`` (all of one shape)."""
    # NOTE: a generator of its own: measuring must not move the caller's random stream
    x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype,
                    generator=torch.Generator().manual_seed(rows))  # fmt: skip
    one, two = first or torch.nn.functional.linear, second or onednn_linear
    with torch.no_grad():
        return _best_of(lambda: [one(x, w, None) for w in weights],
                        lambda: [two(x, w, None) for w in weights])  # fmt: skip


def _stream_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """Input-major copies of ``weight`` (``_STREAM_BYTES`` in all, at most ``_STREAM_COPIES``),
    so that a pass over them streams from memory as a decode step's weights do."""
    count = min(
        _STREAM_COPIES, max(1, -(-_STREAM_BYTES // (weight.numel() * weight.element_size())))
    )
    return [weight.t().clone(memory_format=torch.contiguous_format).t() for _ in range(count)]


def choose_products(weight: torch.Tensor, *, rows_kernel: _Product | None = None) -> ProductChoice:
    """The libraries for a model's fp32 products, by ``AGENTCACHE_FP32_PRODUCTS`` or, by
    default, by timing ``weight`` (``[N, K]`` fp32 CPU, as the forward stores it: pass the
    largest) through both at 16 and 512 rows (five alternating runs each after a warm-up, the
    fastest of each kept). oneDNN is chosen for a class when it took under 90% of MKL's time.
    With ``rows_kernel`` (the native ``linear_rows``; None where the kernels are scalar or off)
    it is timed against the few-row library at 16 rows too, and ``rows`` set to ``ROWS_MAX``
    when it took under 90% of that library's time, else timed at 1 row and ``rows`` set to 1
    when it did so there. About 0.1-0.3 s on W1's gate-up weight, once
    per process for each weight shape, thread count and kernel presence (later loads reuse the
    choice).

    Never raises: oneDNN unavailable (``onednn_problem``) keeps MKL, with the reason (and
    ``rows_kernel`` is still measured against MKL).
    """
    setting = os.environ.get(PRODUCTS_ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "mkl", "onednn"):
        logger.warning("agentcache: %s=%r is not auto, mkl or onednn; fp32 products run on MKL",
                       PRODUCTS_ENV, setting)  # fmt: skip
        return MKL_ONLY._replace(reason=f"{PRODUCTS_ENV}={setting!r} not understood")
    if setting == "mkl":
        return MKL_ONLY._replace(reason=f"{PRODUCTS_ENV}=mkl")
    is_fp32_cpu = weight.dtype == torch.float32 and weight.device.type == "cpu"
    problem = onednn_problem()
    if problem is None and not is_fp32_cpu:
        problem = f"weights are {weight.dtype} on {weight.device.type}, not fp32 on the CPU"
    if problem is not None and setting == "onednn":
        logger.warning("agentcache: %s=onednn, but %s; fp32 products run on MKL",
                       PRODUCTS_ENV, problem)  # fmt: skip
        return MKL_ONLY._replace(reason=f"MKL: {problem}")
    if setting == "onednn":
        return ProductChoice("onednn", "onednn", f"{PRODUCTS_ENV}=onednn")
    if problem is not None and (rows_kernel is None or not is_fp32_cpu):
        return MKL_ONLY._replace(reason=f"MKL: {problem}")
    key = (tuple(weight.shape), torch.get_num_threads(), rows_kernel is not None)
    with _MEASURING:  # NOTE: engines loading at once measure once and agree
        if key not in _MEASURED:
            _MEASURED[key] = _measured_choice(weight, problem, rows_kernel)
        return _MEASURED[key]


_MEASURED: dict[tuple[tuple[int, ...], int, bool], ProductChoice] = {}
"""Measured choices by (weight shape, torch threads, with ``linear_rows``): a process measures
each once, so that engines loaded side by side (a benchmark's cache-on and cache-off engines)
run the same products."""
_MEASURING = threading.Lock()


def _measured_choice(
    weight: torch.Tensor, onednn_missing: str | None, rows_kernel: _Product | None
) -> ProductChoice:
    shape = "x".join(str(s) for s in weight.shape)
    if onednn_missing is None:
        mkl_few, dnn_few = _measure([weight], _FEW_PROBE)
        mkl_many, dnn_many = _measure([weight], _MANY_PROBE)
        few: Library = "onednn" if dnn_few < _MARGIN * mkl_few else "mkl"
        many: Library = "onednn" if dnn_many < _MARGIN * mkl_many else "mkl"
        reason = (f"measured on a {shape} weight: {_FEW_PROBE} rows oneDNN {dnn_few * 1e3:.2f} vs "
                  f"MKL {mkl_few * 1e3:.2f} ms, {_MANY_PROBE} rows {dnn_many * 1e3:.2f} vs "
                  f"{mkl_many * 1e3:.2f} ms")  # fmt: skip
    else:
        few = many = "mkl"
        reason = f"MKL: {onednn_missing}"
    if rows_kernel is None:
        return ProductChoice(few, many, reason)
    library = onednn_linear if few == "onednn" else None
    lib_s, rows_s = _measure(_stream_copies(weight), _ROWS_PROBE, library, rows_kernel)
    name = "oneDNN" if few == "onednn" else "MKL"
    reason += (f"; {_ROWS_PROBE} rows linear_rows {rows_s * 1e3:.2f} vs {name} "
               f"{lib_s * 1e3:.2f} ms")  # fmt: skip
    if rows_s < _MARGIN * lib_s:
        return ProductChoice(few, many, reason, ROWS_MAX)
    # NOTE: a tie at several rows can still hide a clear win at one row (a decode step of one
    # request): on an AMD EPYC with AVX2 forced, W1, 4 rows tied oneDNN (6.73 vs 6.59 ms)
    # and leaving linear_rows out cost the decode rate a quarter (0.76x the AVX-512 build's).
    lib_1, rows_1 = _measure(_stream_copies(weight), 1, library, rows_kernel)
    reason += f", 1 row {rows_1 * 1e3:.2f} vs {lib_1 * 1e3:.2f} ms"
    return ProductChoice(few, many, reason, 1 if rows_1 < _MARGIN * lib_1 else 0)


PrefixAttention = Callable[..., object]
_PREFIX_PROBE = (512, 1024)  # queries per KV head, shared keys: a burst's cascade, scaled down
_PREFIX_MEASURED: dict[tuple[int, int, int, str], tuple[bool, str]] = {}


def choose_prefix_attention(
    native: PrefixAttention, flash: PrefixAttention, num_kv_heads: int, head_dim: int, isa: str
) -> tuple[bool, str]:
    """Whether a packed prefill's shared prefix (the cascade, ``CompactLlama.forward_packed``)
    is attended in the native ``prefix_attention`` rather than torch's flash kernel, and why:
    timed once per process for each (KV heads, head dim, torch threads, ISA) on 512 queries per
    KV head over 1,024 keys (five alternating runs after a warm-up, the fastest of each); the
    native kernel is kept where it took under 90% of the flash kernel's time. Both give the
    same numbers within float32 rounding. Never raises.

    Args:
        native: ``NativeKernels.prefix_attention``.
        flash: ``attention.lse_attention`` (torch's CPU flash kernel, with the LSE).
        num_kv_heads, head_dim: The model's.
        isa: ``NativeKernels.isa`` (part of the key: each ISA's build is measured on its own).

    NOTE: the winner depends on the CPU, hence the measurement. At W1's shapes (3 KV heads of 64,
    1,920 queries per head, 1,360 keys, 2 threads, same run), native vs flash: AMD EPYC (Zen 4)
    AVX-512 9.2 vs 13.3 ms; Intel Xeon (Sapphire Rapids) AVX-512 22.9 vs 12.1 ms, AVX2 31.5 vs
    12.1 ms; AMD EPYC (Zen 3) AVX2 17.2 vs 14.6 ms.
    """
    if head_dim % 16 or head_dim > 128:
        return False, f"head dim {head_dim} is not a multiple of 16 up to 128"
    key = (num_kv_heads, head_dim, torch.get_num_threads(), isa)
    with _MEASURING:
        if key not in _PREFIX_MEASURED:
            _PREFIX_MEASURED[key] = _measure_prefix_attention(native, flash, num_kv_heads, head_dim)
        return _PREFIX_MEASURED[key]


def _measure_prefix_attention(
    native: PrefixAttention, flash: PrefixAttention, heads: int, head_dim: int
) -> tuple[bool, str]:
    queries, keys = _PREFIX_PROBE
    generator = torch.Generator().manual_seed(head_dim)  # NOTE: the caller's stream untouched
    q, k, v = (torch.randn(heads, n, head_dim, generator=generator) for n in (queries, keys, keys))
    scale = head_dim**-0.5
    with torch.no_grad():
        native_s, flash_s = _best_of(
            lambda: native(q, k, v, scale), lambda: flash(q[None], k[None], v[None], None, scale)
        )
    use = native_s < _MARGIN * flash_s
    why = f"measured at {heads} x {queries} queries over {keys} keys: native {native_s * 1e3:.2f}"
    return use, f"{why} vs torch's flash kernel {flash_s * 1e3:.2f} ms"
