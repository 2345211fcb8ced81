"""Native (C++) kernels of the compact forward, built on this machine on first use, for the best
instruction set the CPU has (AVX-512, AVX2+FMA, ARM NEON) or a scalar path.

The kernels (sources beside this file; ``vec.h`` says how one source serves every ISA):
``decode_attention``, one query per row over grouped KV heads, fp32 (K/V fp32 or fp16, widened
exactly: ``half.h``), as flash-decoding does it (blocks of keys on torch's intra-op threads,
block-local softmax, one merge); ``DecodeLayers``, the layer loop of a compact decode step in C++
(RMSNorm and RoPE as plain loops, RoPE'd keys and the values written straight into the KV slots,
fp32 or fp16 rounded to nearest even), equal to the Python loop within float32 rounding
without the Python and dispatch overhead of about 25 small ops per layer; ``linear_packed``, a
product over weights packed in blocks of 32 output columns (``pack_weight``), as bfloat16 (half
the bytes) or float32 (a copy that small products stream at the read bandwidth);
``linear_quantized``, a product straight from GGUF's Q8_0 / Q4_1 blocks (``quantize_weight``:
8.5 and 5 bits a weight);
``linear_rows``, a product of 1-8 rows straight from the compact forward's own input-major fp32
weights (no copy); and ``prefix_attention``, the unmasked attention of a packed prefill's tokens
to the prefix their segments share, flash-style with register tiles.

NOTE: measured on W1 (30 layers, 3 KV heads of 64, 2 threads, same process, AVX-512 host):
the attention over 2,001 cached tokens took 7.9 ms per decode step against 14.6 ms for the two
``torch.matmul`` of ``attention.decode_attention``; the whole decode step after 2,000
tokens, 6 rounds alternating, was 1.37-1.53x faster than the torch path.

``AGENTCACHE_KERNEL_ISA`` picks the path: ``native`` (default: the best this CPU has), ``avx512``,
``avx2``, ``neon``, ``scalar`` or ``off`` (the torch path); ``_isa.py`` has the rules and flags.
``AGENTCACHE_NATIVE_KERNELS=0`` is the older ``off``. Each ISA is built once per machine into its
own folder of ``$AGENTCACHE_KERNEL_DIR`` (default ``~/.cache/agentcache/kernels``); a failed build
is remembered there so later processes take the torch path at once (``_build.py``). ``python -m
runtime.model.kernels info`` says what was chosen and why; ``python -m runtime.model.kernels build``
builds (or retries) one ISA, or only compiles it with another compiler. No compiler at all (a bare
macOS or Windows machine) still imports and runs: on the torch path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal, NamedTuple, TypeAlias

from runtime.model.kernels import _build, _isa
from runtime.model.kernels._build import KERNEL_DIR_ENV
from runtime.model.kernels._isa import DISABLE_ENV, ISA_ENV, ISAS, Isa, IsaChoice

__all__ = [
    "DISABLE_ENV",
    "ISAS",
    "ISA_ENV",
    "KERNEL_DIR_ENV",
    "PACKED_COLUMNS",
    "QUANT_BLOCK",
    "QUANT_BLOCK_BYTES",
    "QUANT_FORMATS",
    "QUANT_HEAD_FORMAT",
    "DecodeAttention",
    "Isa",
    "IsaChoice",
    "NativeKernels",
    "NativeStatus",
    "chosen_isa",
    "native_kernels",
    "native_status",
    "dequantize_weight",
    "pack_weight",
    "quant_format_of",
    "quantize_weight",
    "repack_q4_1",
    "unpack_q4_1",
    "QuantFormat",
]

_log = logging.getLogger(__name__)

DecodeAttention = Callable[..., Any]
"""``(q [B, H, D], k [B, H_kv, T, D], v, mask [B, T] additive fp32 or None, scale, src=None,
shared=None) -> [B, H, D]``, CPU tensors, fp32 but for K/V, which are both fp32 or both float16
(a 16-bit KV cache; computed in fp32 over their exact values, so the result equals, bit for bit,
the call with ``k.float()``, ``v.float()``); K/V with a contiguous last dim, any other strides.
Another dtype mix raises ``RuntimeError`` naming the dtypes. A row whose every key is masked
gets zeros. ``src`` / ``shared`` (``[B]`` int64,
together): row ``b``'s keys ``[0, shared[b])`` are byte for byte row ``src[b]``'s, so whole
blocks of them are read from there, once for every row sharing them, and those rows' queries
run together (the same output within float32 rounding; see ``BatchKV.share_prefix``)."""


class NativeKernels(NamedTuple):
    """One ISA's built kernels (see the module docstring)."""

    decode_attention: DecodeAttention
    decode_layers: Any
    """The ``DecodeLayers`` class: built from one model's compact weights, ``run`` is the
    layer loop of one decode step (``CompactLlama.forward`` with ``slots``) over an fp32 or
    float16 KV buffer ``[L, 2, R, H_kv, capacity, D]`` (float16: the new K/V stored as
    ``x.half()`` rounds them; another dtype raises ``RuntimeError``)."""
    isa: Isa
    """The instruction set this build runs (``"avx512"``, ``"avx2"``, ``"neon"``, ``"scalar"``)."""
    linear_packed: Callable[..., Any]
    """``(x [..., K] fp32, packed, bias [N] fp32 or None, n) -> [..., N] fp32``: ``x . W^T +
    bias`` with ``W`` (``[N, K]``) packed by ``pack_weight`` (bf16 or fp32); fp32 multiply-adds,
    so it equals ``F.linear`` over the packed (for bf16: rounded) weights within float32
    rounding."""
    linear_quantized: Callable[..., Any]
    """``(x [..., K] fp32, blocks, bias [N] fp32 or None) -> [..., N] fp32``: ``x . W^T + bias``
    with ``W`` in GGUF's Q8_0 or Q4_1 blocks (``quantize_weight``: uint8 ``[N, K / 32, 34]`` or
    ``[N, K / 32, 20]``), or Q4_1 in the kernel layout (``repack_q4_1``: uint8 ``[N, K / 32 *
    20]``, read without byte shuffles); fp32 multiply-adds, so it equals ``F.linear`` over
    ``dequantize_weight(blocks)`` within float32 rounding. ``linear_packed`` takes the same
    blocks (with ``n = N``). Raises ``RuntimeError`` on another layout, dtype or K."""
    dequantize_blocks: Callable[..., Any]
    """``(blocks) -> [N, K] fp32``: the values of GGUF Q8_0 / Q4_1 blocks (uint8 ``[N, K / 32,
    34 | 20]``, or ``repack_q4_1``'s ``[N, K / 32 * 20]``), equal to ``dequantize_weight(blocks)``
    (both compute ``d * q (+ m)`` in float32); rows split over threads. Raises ``RuntimeError``
    on another layout or dtype."""
    linear_rows: Callable[..., Any]
    """``(x [..., K] fp32, w [N, K] fp32 input-major, bias [N] fp32 or None) -> [..., N]``:
    ``x . w^T + bias`` for few rows straight from the compact forward's input-major weights
    (``w`` the ``[N, K]`` view, strides ``(1, N)``, of a contiguous ``[K, N]`` tensor), each
    thread streaming a contiguous range of K; fp32 multiply-adds, so it equals ``F.linear``
    within float32 rounding. Raises ``RuntimeError`` on another layout or dtype."""
    prefix_attention: Callable[..., Any]
    """``(q [H_kv, M, D], k [H_kv, S, D], v, scale) -> [out [H_kv, M, D], lse [H_kv, M]]``, fp32
    CPU (K/V both fp32 or both float16: attended as their exact fp32 values, bit for bit the
    call with ``k.float()``, ``v.float()``), ``D`` a multiple of 16 up to 128, K and V rows
    contiguous: unmasked attention of many queries to one run of keys and the log-sum-exp of
    their scaled scores, as torch's CPU flash kernel returns them (``attention.lse_attention``),
    equal within float32 rounding."""
    segment_attention: Callable[..., Any]
    """``(q [H, N, D], k_new [H_kv, N, D], v_new, buffers, layer, past, lengths, scale) -> [H,
    N, D]``, fp32 CPU, ``D`` a multiple of 16 up to 128: ``forward_packed``'s attention in one
    call. Segment ``s`` (tokens ``[sum(lengths[:s]), + lengths[s])`` of q) first writes its new
    K/V into ``buffers[s]`` (a ``RequestKVCache`` buffer ``[L, 2, H_kv, capacity, D]``, layer
    ``layer``) at positions ``[past[s], past[s] + lengths[s])``; then its token ``j`` attends to
    that buffer's keys ``[0, past[s] + j]``. Equal to SDPA with the causal mask within float32
    rounding. Buffers all fp32 or all float16: float16 ones get the new K/V rounded as
    ``x.half()`` rounds them and are attended as stored (the new tokens' own keys included).
    Raises ``RuntimeError`` on other shapes, dtypes, or a segment past its buffer."""

    @property
    def is_vectorized(self) -> bool:
        """Whether the build uses vector instructions (every ISA but ``scalar``). The compact
        forward keeps packed weight copies and uses ``linear_rows`` only where it does: the
        scalar products are several times slower than torch's."""
        return self.isa != "scalar"


class NativeStatus(NamedTuple):
    """Whether the native kernels run here, and why not when they do not."""

    loaded: bool
    reason: str
    """What was loaded (the library's path) or why nothing was."""
    isa: Isa | None = None
    """The ISA asked for (None: the kernels are off, or the switch was not understood)."""


@functools.cache
def chosen_isa() -> IsaChoice:
    """``AGENTCACHE_KERNEL_ISA`` (and ``AGENTCACHE_NATIVE_KERNELS``) against this CPU, read once
    per process; a mistake is logged once as a warning."""
    choice = _isa.choose_isa()
    if choice.warn:
        _log.warning("agentcache: %s; decode runs on the torch path", choice.reason)
    return choice


@functools.cache
def _load(isa: Isa) -> tuple[ModuleType | None, str]:
    """Load ``isa``'s build, building it first when there is none; a marker of a failed build
    skips it at once. Never raises."""
    lacking = _isa.missing_features(isa)
    if lacking:  # NOTE: its first vector instruction would kill the process (SIGILL)
        return None, f"native kernels: this CPU cannot run {isa} (it lacks {', '.join(lacking)})"
    try:
        import torch  # noqa: F401  (the library links against the loaded torch: load it first)

        b = _build.build_of(isa)
        failed = _build.marker_reason(b)
        if failed is not None:
            _log.warning("agentcache: native kernels (%s): an earlier build failed (%s); see %s; "
                         "to retry, remove it or run "
                         "`python -m runtime.model.kernels build --isa %s`; "
                         "decode runs on the torch path", isa, failed, b.marker, isa)  # fmt: skip
            return None, f"{failed} (remembered in {b.marker})"
        if b.library.exists() and not b.library.is_file():  # NOTE: a build could never replace it
            return None, f"native kernels: {b.library} exists and is not a file"
        if b.library.is_file():
            try:
                return _build.import_library(b.name, b.library), str(b.library)
            except ImportError as exc:  # NOTE: a damaged file (disk, copy): built again below
                _log.warning("agentcache: cannot load %s (%s); rebuilding it", b.library, exc)
        return _build.build(b), str(b.library)
    except _build.BuildFailed as exc:
        _log.warning("agentcache: %s; decode runs on the torch path", exc)
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001  (anything else, a kernel dir that cannot be made)
        lines = [line for line in str(exc).splitlines() if line.strip()]
        reason = f"native kernel build failed ({type(exc).__name__}: {' | '.join(lines[-3:])})"
        _log.warning("agentcache: %s; decode runs on the torch path", reason)
        return None, reason


def native_kernels(isa: Isa | None = None) -> NativeKernels | None:
    """The native kernels of ``isa`` (default: ``chosen_isa()``), or None where they cannot run.

    Builds them on first use in this machine's kernel cache (about 40-90 s once per ISA); never
    raises: a failure leaves the torch path and ``native_status()`` says why. An ``isa`` this CPU
    cannot run gives None without building (its first vector instruction would kill the process;
    ``python -m runtime.model.kernels build --compile-only`` compiles it anyway).

    Raises:
        ValueError: ``isa`` is not one of ``ISAS``.
    """
    if isa is None:
        isa = chosen_isa().isa
        if isa is None:
            return None
    elif isa not in ISAS:
        raise ValueError(f"unknown ISA {isa!r}; valid: {', '.join(ISAS)}")
    module, _ = _load(isa)
    if module is None:
        return None
    return NativeKernels(
        module.decode_attention, module.DecodeLayers, module.isa, module.linear_packed,
        module.linear_quantized, module.dequantize_blocks, module.linear_rows,
        module.prefix_attention, module.segment_attention,
    )  # fmt: skip


def native_status(isa: Isa | None = None) -> NativeStatus:
    """Whether the native kernels of ``isa`` (default: ``chosen_isa()``) loaded (building them
    first if needed), and from where or why not."""
    if isa is None:
        choice = chosen_isa()
        if choice.isa is None:
            return NativeStatus(False, choice.reason)
        isa = choice.isa
    module, reason = _load(isa)
    return NativeStatus(module is not None, reason, isa)


PACKED_COLUMNS = 32
"""Output columns per packed block of ``pack_weight`` (one 64-byte line of bf16, two of fp32,
per input)."""


def _bf16_order() -> list[int]:
    """Column held at each position of a packed bf16 line: 32-bit word ``i`` holds column ``i``
    in its low half (position ``2 i``) and column ``16 + i`` in its high half (``2 i + 1``), so
    the kernel widens a line with one shift and one mask per vector on every ISA (``vec.h``)."""
    half = PACKED_COLUMNS // 2
    return [p // 2 if p % 2 == 0 else half + p // 2 for p in range(PACKED_COLUMNS)]


def pack_weight(weight: Any, dtype: Any) -> Any:
    """``weight`` (``[N, K]`` float, any strides) packed for ``linear_packed``: ``[ceil(N / 32),
    K, 32]`` contiguous ``dtype``, block ``b`` holding output columns ``[32 b, 32 b + 32)`` (zero
    past ``N``), so each block is one contiguous stream of ``K`` lines. The layout is the same
    for every ISA.

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


QuantFormat: TypeAlias = Literal["q8_0", "q4_1"]
QUANT_FORMATS: tuple[QuantFormat, ...] = ("q8_0", "q4_1")
"""GGUF block formats ``linear_quantized`` reads: ``q8_0`` (34 bytes per 32 weights: fp16
scale, 32 int8) and ``q4_1`` (20 bytes: fp16 scale, fp16 minimum, 32 nibbles)."""
QUANT_HEAD_FORMAT: dict[QuantFormat, QuantFormat] = {"q8_0": "q8_0", "q4_1": "q8_0"}
"""The format of the LM head (and a tied embedding) for each layer format: llama.cpp's converter
keeps a tied ``token_embd`` in Q8_0 when the layers are Q4_0/Q4_1 (SmolLM2's shipped Q4_1 file
does), so a model quantized here matches the file."""
QUANT_BLOCK = 32
"""Weights per quantized block (along the input dimension)."""
QUANT_BLOCK_BYTES: dict[QuantFormat, int] = {"q8_0": 34, "q4_1": 20}
"""Bytes per block of ``QUANT_BLOCK`` weights in each format (ggml's ``block_q8_0`` and
``block_q4_1``)."""


def _gguf_type(fmt: str) -> Any:
    from gguf import GGMLQuantizationType

    if fmt not in QUANT_FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; valid: {', '.join(QUANT_FORMATS)}")
    return GGMLQuantizationType.Q8_0 if fmt == "q8_0" else GGMLQuantizationType.Q4_1


def quantize_weight(weight: Any, fmt: str) -> Any:
    """``weight`` (``[N, K]`` float, any strides) in GGUF's ``fmt`` blocks: uint8 ``[N, K / 32,
    34]`` (Q8_0) or ``[N, K / 32, 20]`` (Q4_1), contiguous, block ``b`` of row ``n`` holding
    inputs ``[32 b, 32 b + 32)`` of output ``n``, in the layout of a GGUF file, so a file from
    llama.cpp's converter and a weight quantized here mean the same numbers.

    Q4_1 is ggml's reference rounding (``gguf.quants.quantize``: ``quantize_row_q4_1_ref``).
    Q8_0 searches each block's fp16 scale for the least squared error (``_q8_0.quantize_q8_0``:
    ggml's reference ``amax / 127``, which it keeps unless another is strictly better, scales
    around it as llama.cpp's ``make_qx_quants`` tries them, scales aligned with a Q4_1 grid in
    the block): on SmolLM2-135M's layers (Q4_1 values) its squared error is 0.15x the
    reference's, on Gaussian blocks 0.81x. Quantizing ``dequantize_weight`` of blocks (ours,
    or a file's reference-rounded ones) gives the same blocks again.

    Raises:
        ValueError: ``fmt`` is not one of ``QUANT_FORMATS``, ``weight`` is not 2-D, or ``K`` is not
            a multiple of 32.
    """
    import numpy as np
    import torch
    from gguf.quants import quantize

    from runtime.model.kernels._q8_0 import quantize_q8_0

    qtype = _gguf_type(fmt)
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight: weight must be 2-D [N, K], not {tuple(weight.shape)}")
    n, k = weight.shape
    if k % QUANT_BLOCK != 0 or k == 0:
        raise ValueError(f"quantize_weight: {fmt} needs K (inputs) a positive multiple of "
                         f"{QUANT_BLOCK}, not {k}")  # fmt: skip
    values = np.ascontiguousarray(weight.detach().to(torch.float32).cpu().numpy())
    blocks = quantize_q8_0(values) if fmt == "q8_0" else quantize(values, qtype)
    return torch.from_numpy(np.ascontiguousarray(blocks)).view(n, k // QUANT_BLOCK, -1)


def dequantize_weight(blocks: Any) -> Any:
    """The fp32 ``[N, K]`` values of ``quantize_weight``'s blocks (``gguf.quants.dequantize``:
    ``d * q``, ``d * q + m`` for Q4_1, in float32), the format read from the block size; Q4_1 in
    the kernel layout (``repack_q4_1``'s ``[N, K / 32 * 20]``) is unpacked first.

    Raises:
        ValueError: ``blocks`` is not uint8 ``[N, K / 32, 34 | 20]`` or ``[N, K / 32 * 20]``.
    """
    import numpy as np
    import torch
    from gguf.quants import dequantize

    if blocks.dtype == torch.uint8 and blocks.dim() == 2:
        blocks = unpack_q4_1(blocks)
    if (
        blocks.dtype != torch.uint8
        or blocks.dim() != 3
        or blocks.shape[2] not in QUANT_BLOCK_BYTES.values()
    ):
        raise ValueError(f"dequantize_weight: blocks must be uint8 [N, K / 32, 34 | 20] or "
                         f"[N, K / 32 * 20], not {blocks.dtype} {tuple(blocks.shape)}")  # fmt: skip
    fmt = "q8_0" if blocks.shape[2] == QUANT_BLOCK_BYTES["q8_0"] else "q4_1"
    n, nb, _ = blocks.shape
    raw = np.ascontiguousarray(blocks.reshape(n, -1).numpy())
    values = dequantize(raw, _gguf_type(fmt)).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(values)).view(n, nb * QUANT_BLOCK)


def quant_format_of(blocks: Any) -> QuantFormat:
    """``"q8_0"`` or ``"q4_1"`` from a block array's last dimension (34 or 20 bytes); a 2-D
    array is Q4_1 in the kernel layout (``repack_q4_1``)."""
    return "q8_0" if blocks.dim() == 3 and blocks.shape[-1] == QUANT_BLOCK_BYTES["q8_0"] else "q4_1"


_GROUP_BLOCKS = 4
"""Blocks per nibble group of the kernel layout (``repack_q4_1``)."""


def _nibble_groups(nb: int) -> list[tuple[int, int]]:
    """``(first block, blocks)`` of each nibble group of a row of ``nb`` blocks: groups of 4,
    then the last ``nb % 4`` blocks one by one."""
    whole = nb - nb % _GROUP_BLOCKS
    return [(b, _GROUP_BLOCKS) for b in range(0, whole, _GROUP_BLOCKS)] + [
        (b, 1) for b in range(whole, nb)
    ]


def repack_q4_1(blocks: Any) -> Any:
    """GGUF Q4_1 blocks (uint8 ``[N, K / 32, 20]``, ``quantize_weight``'s or a file's) in the
    kernel layout that ``linear_quantized`` reads without byte shuffles: uint8 ``[N, K / 32 *
    20]``, the same bytes moved within each row, so the same values and size.

    A row of ``nb`` blocks holds their fp16 scales ``d`` (``2 nb`` bytes, block order), their fp16
    minimums ``m`` (``2 nb``), then their nibbles (``16 nb``): groups of 4 blocks where byte
    ``4 i + j`` is block ``4 g + j``'s GGUF byte ``i`` (input ``i`` in the low nibble, ``16 + i``
    in the high one), so a 32-bit lane holds inputs ``i`` and ``16 + i`` of 4 blocks; then the
    last ``nb % 4`` blocks' 16 bytes each as GGUF stores them. ``unpack_q4_1`` reverses it.
    The layout is ours (``quantized.cpp``); GGUF's block format is ggml's ``block_q4_1``.

    Raises:
        ValueError: ``blocks`` is not uint8 ``[N, K / 32, 20]``.
    """
    import torch

    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != 20:
        raise ValueError(f"repack_q4_1: blocks must be uint8 [N, K / 32, 20], not "
                         f"{blocks.dtype} {tuple(blocks.shape)}")  # fmt: skip
    n, nb, _ = blocks.shape
    nibbles = [blocks[:, b : b + size, 4:].transpose(1, 2).reshape(n, 16 * size)
               for b, size in _nibble_groups(nb)]  # fmt: skip
    parts = [blocks[:, :, 0:2].reshape(n, -1), blocks[:, :, 2:4].reshape(n, -1), *nibbles]
    return torch.cat(parts, dim=1).contiguous()


def unpack_q4_1(rows: Any) -> Any:
    """``repack_q4_1``'s kernel layout (uint8 ``[N, K / 32 * 20]``) back to GGUF's Q4_1 blocks
    (uint8 ``[N, K / 32, 20]``).

    Raises:
        ValueError: ``rows`` is not uint8 ``[N, a multiple of 20]``.
    """
    import torch

    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % 20 != 0:
        raise ValueError(f"unpack_q4_1: rows must be uint8 [N, K / 32 * 20], not "
                         f"{rows.dtype} {tuple(rows.shape)}")  # fmt: skip
    n, nb = rows.shape[0], rows.shape[1] // 20
    out = torch.empty(n, nb, 20, dtype=torch.uint8)
    out[:, :, 0:2] = rows[:, : 2 * nb].reshape(n, nb, 2)
    out[:, :, 2:4] = rows[:, 2 * nb : 4 * nb].reshape(n, nb, 2)
    at = 4 * nb
    for b, size in _nibble_groups(nb):
        out[:, b : b + size, 4:] = rows[:, at : at + 16 * size].reshape(n, 16, size).transpose(1, 2)
        at += 16 * size
    return out
