"""GGUF Q8_0 blocks (an fp16 scale ``d`` and 32 int8 ``q``, value ``d * q``) with a per-block
search for the scale of least squared error; the block layout and its meaning are ggml's.

Knows only float32 values and block bytes: no model, no file, no GGUF reader (blocks read from a
file are kept as the file has them and never pass through here).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["quantize_q8_0", "reference_q8_0"]

_BLOCK = 32
_CHUNK = 16384
"""Blocks searched at once (2 MiB of fp32 values: each candidate's passes stay in cache)."""
_RATIO_CANDIDATES = tuple(range(127, 119, -1))
"""Largest integer ``m`` of the ``amax / m`` scales tried (127 is ggml's reference scale)."""
_GRID_CANDIDATES = 8
"""Number of ``step / k`` scales tried (``k`` from the largest that fits down)."""
_EXACT_DIVISORS = 16
"""Divisors ``t`` tried for the exact candidate's ``g / t`` (see ``_exact_scale``)."""


def reference_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's reference rounding (``quantize_row_q8_0_ref``; ``gguf.quants``' Q8_0, bit for bit):
    ``d = amax / 127`` in float32, ``q = round(x / d)`` half away from zero through ``x * (1 /
    d)``, then ``d`` stored as fp16.

    Args:
        x: ``[B, 32]`` float32 blocks.

    Returns:
        ``(d [B, 1] float32 holding fp16 values, q [B, 32] float32 holding integers)``.
    """
    d = x.abs().amax(1, keepdim=True) / 127
    inverse = torch.where(d == 0, 0.0, 1 / d)
    scaled = x * inverse
    a = scaled.abs()
    floor = a.floor()
    # NOTE: floor(a) + floor(2 (a - floor(a))), as gguf's np_roundf: floor(a + 0.5) would
    # round 0.49999997 up (the sum rounds to 1.0 in float32)
    q = torch.sign(scaled) * (floor + (2 * (a - floor)).floor())
    return d.half().float(), q


def _errors(x: torch.Tensor, d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` squared error of each block's ``d * q`` against ``x``."""
    residual = torch.addcmul(x, d, q, value=-1.0)
    return (residual * residual).sum(1, keepdim=True)


def _rounded(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``[B, 32]`` nearest integers of ``x / d`` in ``[-127, 127]`` (0 where ``d`` is 0)."""
    inverse = torch.where(d == 0, 0.0, 1 / d)  # [B, 1]
    return (x * inverse).round_().clamp_(-127, 127)


def _exact_scale(x: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` fp16 scale under which a block's values are exactly ``d * q`` with integer
    ``|q| <= 127``, where the block is such (0 where not found).

    Every value is an integer multiple of ``2^e``, ``e`` the last bit of the smallest nonzero
    one (float32: 24 significant bits); ``g`` the greatest common divisor of those integers
    (times ``2^e``) divides them all, and so does ``g / t`` for the smallest ``t`` that makes an
    fp16 number. For a block of ``d * q`` (``q`` coprime or sharing a factor up to
    ``_EXACT_DIVISORS``) this finds ``d`` or a multiple of it with the same values: what makes
    quantizing dequantized blocks give the same values again.
    """
    nonzero = x != 0
    _, exponent = torch.frexp(x)
    low = exponent.masked_fill_(~nonzero, 1 << 30).amin(1, keepdim=True)  # [B, 1]
    low = torch.where(low == 1 << 30, 0, low - 24)
    scaled = torch.ldexp(x.double(), -low.double())  # exact: integers below 2^53 or rejected
    largest = scaled.abs().amax(1, keepdim=True)
    fits = largest < 2.0**52
    largest = largest * fits
    g = _gcd(scaled.masked_fill_(~fits, 0), largest / 127)  # NOTE: |q| <= 127 needs g >= it
    g_scale = torch.ldexp(g.double(), low.double())
    return _widest_fp16(g_scale, largest / g.clamp(min=1).double(), g > 0)


def _widest_fp16(scale: torch.Tensor, top: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` float32: ``scale / t`` (float64 ``[B, 1]``) for the smallest ``t`` up to
    ``_EXACT_DIVISORS`` that is an fp16 number and keeps ``top * t <= 127`` (``top``: the block's
    largest ``|q|`` at ``scale``), where ``valid``; else 0."""
    found = torch.zeros_like(scale)
    for t in range(_EXACT_DIVISORS, 0, -1):  # NOTE: downwards: the smallest t wins
        candidate = scale / t
        ok = valid & (candidate.half().double() == candidate) & (top * t <= 127)
        found = torch.where(ok, candidate, found)
    return found.float()


def _candidates(x: torch.Tensor) -> list[torch.Tensor]:
    """``[B, 1]`` fp16 scales to try besides the reference, in order (ties keep the earlier).

    ``amax / m`` for ``m`` just under 127 (llama.cpp's ``make_qx_quants`` tries scales around
    the reference in the same way); ``step / k`` with ``step`` a fifteenth of the block's range,
    for the largest ``k`` that keeps ``|q| <= 127`` and the next smaller ones: a block holding
    Q4_1 values (``m + step * i``, ``i`` in 0..15) then lands on integers up to one common offset;
    and ``_exact_scale``, which a block of Q8_0 values meets with no error.
    """
    amax = x.abs().amax(1, keepdim=True)
    scales = [amax / m for m in _RATIO_CANDIDATES]
    step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 15
    fit = torch.where(amax == 0, 0.0, (127 * step / torch.where(amax == 0, 1.0, amax)).floor())
    scales += [step / (fit - j).clamp(min=1) for j in range(_GRID_CANDIDATES)]
    return [_exact_scale(x)] + [s.half().float() for s in scales]


def _search(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d [B, 1], q [B, 32])`` of least squared error over the reference and ``_candidates``
    (the reference unless a candidate is strictly better)."""
    reference_d, reference_q = reference_q8_0(x)
    best_d, best_e = reference_d, _errors(x, reference_d, reference_q)
    searched = torch.zeros_like(best_e, dtype=torch.bool)  # [B, 1]: a candidate won
    for d in _candidates(x):
        e = _errors(x, d, _rounded(x, d))
        better = e < best_e  # NOTE: NaN errors (inf or NaN inputs) never win: the reference stays
        best_e = torch.where(better, e, best_e)
        best_d = torch.where(better, d, best_d)
        searched |= better
    best_q = torch.where(searched, _rounded(x, best_d), reference_q)  # NOTE: as each was chosen
    return _lowest_terms(best_d, best_q, searched)


def _gcd(values: torch.Tensor, least: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` int64 greatest common divisor of each row of integer ``values`` (0 for a zero
    row), or 0 where it is below ``least`` (``[B, 1]``): the divisor of a row's first four
    values bounds it from above (unless all four are 0), so only the rows it does not rule out
    reduce the rest (most blocks are ruled out at once: Euclid's steps on 31-bit integers are
    this search's costliest)."""
    v = values.long()
    first = torch.gcd(torch.gcd(v[:, :1], v[:, 1:2]), torch.gcd(v[:, 2:3], v[:, 3:4]))
    rows = ((first == 0) | (first.double() >= least)).squeeze(1).nonzero().squeeze(1)
    out = torch.zeros_like(first)
    if rows.numel():
        g = v[rows]
        while g.shape[1] > 1:
            half = g.shape[1] // 2
            g = torch.gcd(g[:, :half], g[:, half:])
        out[rows] = g
    return out


def _lowest_terms(
    d: torch.Tensor, q: torch.Tensor, searched: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values of each searched block in the form ``_exact_scale`` finds for them
    (``d`` times the common factor of ``q``, over the smallest ``t`` that makes an fp16
    number), so blocks quantized again come back byte for byte. Reference blocks stay as
    they are."""
    c = _gcd(q, torch.full_like(d, 2.0, dtype=torch.float64)).clamp(min=1)
    top = q.abs().amax(1, keepdim=True).double() / c.double()
    wider = _widest_fp16(d.double() * c.double(), top, searched)
    ok = wider > 0
    q_wider = (d.double() * q.double() / torch.where(ok, wider, 1).double()).round().float()
    return torch.where(ok, wider, d), torch.where(ok, q_wider, q)


def _encode(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[B, 34]`` uint8 blocks: ``d`` as fp16 bytes, then ``q`` as int8."""
    scale = d.half().view(torch.uint8)  # [B, 2], native (little-endian) byte order as ggml's
    return torch.cat([scale, q.to(torch.int8).view(torch.uint8)], dim=1)


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """Q8_0 blocks of ``values``, each block's fp16 scale chosen for the least squared error.

    For each block of 32 the candidates are ggml's reference scale ``amax / 127`` (what
    ``gguf.quants`` and llama.cpp's converter write), an exact scale (``_exact_scale``), scales
    ``amax / m`` for ``m`` in 120..126 (the idea of llama.cpp's ``make_qx_quants``: try scales
    around the reference, keep the best; our own code) and scales aligned with a Q4_1 grid in
    the block (``_candidates``). Each is rounded to fp16 before its integers are chosen (nearest,
    in ``[-127, 127]``, so llama.cpp reads the blocks with the same meaning); a block keeps the
    reference unless another is strictly better. So every block's squared error is at most the
    reference's, and quantizing dequantized blocks gives the same blocks again.

    Args:
        values: ``[N, K]`` float32, ``K`` a multiple of 32.

    Returns:
        ``[N, K / 32 * 34]`` uint8, GGUF's Q8_0 bytes per row.
    """
    n, k = values.shape
    x = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1, _BLOCK)
    out = torch.empty(x.shape[0], _BLOCK + 2, dtype=torch.uint8)
    threads = torch.get_num_threads()
    # NOTE: one thread: each chunk is about 150 small ops, and on a busy 2-CPU host every
    # parallel region waits for a descheduled worker (SmolLM2's first 1M blocks, same run:
    # 3.7-4.0 s on one thread, 34-55 s on two; all 3.3M on one thread 3.9-4.1 s of CPU time
    # against 3.1-3.3 s for gguf's reference rounding)
    torch.set_num_threads(1)
    try:
        for start in range(0, x.shape[0], _CHUNK):
            d, q = _search(x[start : start + _CHUNK])
            out[start : start + _CHUNK] = _encode(d, q)
    finally:
        torch.set_num_threads(threads)
    return out.reshape(n, k // _BLOCK * (_BLOCK + 2)).numpy()
