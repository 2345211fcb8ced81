"""Attention of the compact forward: the records of a step (``Segment`` of a packed prefill,
``StepSlots`` of a decode step, ``KVWrite``), torch's SDPA, the flash kernel with its
log-sum-exp (cascade merges), decode masks and the prefill mask.

It knows query/key/value tensors and positions, never weights, requests or the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "attend_cascade",
    "cascade_masks",
    "CASCADE_MIN_SHARED",
    "HAS_LSE_ATTENTION",
    "KVWrite",
    "Segment",
    "StepSlots",
    "decode_attention",
    "decode_mask",
    "lse_attention",
    "prefill_mask",
    "sdpa",
]


KVWrite = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``(layer_idx, keys, values) -> (all_keys, all_values)``: store ``[B, H_kv, q, D]`` new K/V of a
layer and return ``[B, H_kv, kv_len, D]`` views of everything attended to (a cache layer's
``update``)."""


class Segment(NamedTuple):
    """One sequence's run of tokens inside a packed forward (``CompactLlama.forward_packed``)."""

    length: int
    """Tokens of this sequence in the packed row."""
    write_kv: KVWrite
    """Stores its ``[1, H_kv, length, D]`` K/V per layer; returns all K/V it attends to."""
    past: int
    """Positions of its KV before these tokens (where ``write_kv`` writes): its causal mask is
    ``prefill_mask(past, length)``."""
    buffer: torch.Tensor | None = None
    """The buffer ``write_kv`` writes to (``RequestKVCache.buffer``, ``[L, 2, H_kv, capacity,
    D]``), so the native ``segment_attention`` can write and read it itself; None: call
    ``write_kv``."""

    def mask(self, device: torch.device) -> torch.Tensor | None:
        """``[1, 1, length, past + length]`` boolean mask (True = attend), None for one token."""
        return prefill_mask(self.past, self.length, device)


class StepSlots(NamedTuple):
    """Where a decode step's ``write_kv`` stores K/V (``BatchKV.step_slots``), so that the C++
    layer loop can write and read them itself: layer ``i``'s keys are ``buffer[i, 0]``, row
    ``rows[j]`` writes at ``pos[j]`` and keys ``[0, kv_len)`` are read. The C++ loop attends step
    row ``j`` over buffer row ``j``, so ``rows`` must be ``0..B-1`` (``BatchKV`` passes
    ``arange(B)``); it refuses anything else with a RuntimeError."""

    buffer: torch.Tensor
    """``[L, 2, R, H_kv, capacity, D]``."""
    rows: torch.Tensor
    """``[B]`` int64."""
    pos: torch.Tensor
    """``[B]`` int64."""
    kv_len: int
    src: torch.Tensor | None = None
    """``[B]`` int64 with ``shared``: row ``j``'s keys ``[0, shared[j])`` are byte for byte row
    ``src[j]``'s (a prefix both copied from the same pinned cache blocks), so the native kernel
    reads them once for all such rows; None: every row reads its own."""
    shared: torch.Tensor | None = None
    """``[B]`` int64 shared lengths (positions), see ``src``."""


CASCADE_MIN_SHARED = 512
"""Shared positions from which ``forward_packed`` attends to the prefix once for all segments.
NOTE: measured with 16 segments of 20-35 tokens, 2 threads. W1 (30 layers) over 1,250 shared:
the attention 511-652 against 773-865 ms per segment, the prefill step 1.06-1.07x faster
(median). The bundled ``tiny`` (4 layers), where per-call overhead dominates: over 300 shared
the step was 10% slower (91 against 81 ms median), over 2,000 10% faster (151 against 168).
Against the native ``segment_attention`` (the attention alone, 30 layers, 16 segments of 25
tokens): 512 shared 94 vs cascade 106 ms, 768 125 vs 117, 1,024 150 vs 144, 1,250 180 vs 163;
the crossover lies near this threshold too, so it stays."""

HAS_LSE_ATTENTION = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def lse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``[B, H, L, D]`` and its log-sum-exp ``[B, H, L]`` (torch's CPU flash kernel,
    what SDPA itself calls on CPU; ``mask`` additive float or None)."""
    # NOTE: the overload itself: the packet resolves its schema from the arguments per call.
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    out, lse = op(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out, lse


def decode_mask(allowed: torch.Tensor) -> torch.Tensor | None:
    """A decode step's boolean mask as what ``decode_attention`` reads fastest: None when every
    row attends to every key (one sequence, or rows of equal length), else additive (0 / -inf),
    built once per step instead of once per layer."""
    if bool(allowed.all()):
        return None
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query per row over grouped KV heads: ``[B, H, 1, D]`` -> ``[B, H, 1, D]``.

    The ``H / H_kv`` queries sharing a KV head form one ``[G, D] x [D, kv_len]`` product, so K/V
    are read once per KV head and never expanded. NOTE: measured on W1 (30 layers, 2,000 cached
    tokens, 2 threads) at ~125 us per layer against ~245 us for SDPA's CPU flash kernel, which
    blocks a single query poorly.
    """
    b, nh, _, d = q.shape
    nkv = k.shape[1]
    scores = torch.matmul(q.reshape(b, nkv, nh // nkv, d), k.transpose(-1, -2))  # [B, H_kv, G, T]
    scores.mul_(scale)
    if mask is not None:  # [B, 1, 1, T] -> one row per KV head group
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).view(b, nh, 1, d)


def prefill_mask(start: int, q: int, device: torch.device) -> torch.Tensor | None:
    """``[1, 1, q, start + q]`` causal mask for ``q`` new tokens after ``start`` cached ones.

    None when ``q == 1`` (one query attends to everything before it: no mask needed).
    """
    if q == 1:
        return None
    rows = torch.arange(q, device=device).unsqueeze(1) + start  # [q, 1]
    cols = torch.arange(start + q, device=device).unsqueeze(0)  # [1, start + q]
    return (cols <= rows).view(1, 1, q, start + q)


def cascade_masks(
    seg_masks: Sequence[torch.Tensor | None], shared_len: int, group: int
) -> list[torch.Tensor | None]:
    """Each segment's additive mask over its keys past ``shared_len``, from its boolean
    ``Segment.mask`` (``[1, 1, length, kv_len]``, None for one token), rows folded as
    ``attend_cascade`` folds queries (``group`` query heads per KV head): ``[1, 1, G * length,
    kv_len - shared_len]`` (None for one token). Built once per forward; every layer uses them."""
    masks: list[torch.Tensor | None] = []
    for mask in seg_masks:
        if mask is None:
            masks.append(None)
            continue
        rest = mask[0, 0, :, shared_len:].repeat(group, 1)  # bool, True = attend
        own = torch.zeros(rest.shape, device=rest.device).masked_fill_(~rest, float("-inf"))
        masks.append(own.view(1, 1, group * mask.shape[2], -1))
    return masks


def attend_cascade(
    qs: torch.Tensor,
    parts: list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    shared_len: int,
    own_masks: list[torch.Tensor | None],
    scale: float,
    attend_prefix: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
    ],
) -> torch.Tensor:
    """A packed forward's attention with a shared prefix: ``[1, H, N, D]`` queries, each part
    ``(its query slice, its keys and values [1, H_kv, kv_len, D], its mask)`` and its folded mask
    past the prefix (``cascade_masks``); the prefix by ``attend_prefix`` (output and LSE), each
    part's own keys by ``lse_attention``, merged by log-sum-exp.

    The ``G = H / H_kv`` query heads of a KV head are folded into the query length, so each
    product is one plain attention per KV head (K/V never expanded).
    """
    _, nh, n, d = qs.shape
    nkv = parts[0][1].shape[1]
    g = nh // nkv
    folded = qs.reshape(1, nkv, g * n, d)  # rows (g, token)
    k0, v0 = parts[0][1][:, :, :shared_len], parts[0][2][:, :, :shared_len]
    out, lse = attend_prefix(folded, k0, v0)
    out, lse = out.view(1, nkv, g, n, d), lse.view(1, nkv, g, n)
    own_out, own_lse = torch.empty_like(out), torch.empty_like(lse)
    for (part, keys, values, _), own_mask in zip(parts, own_masks, strict=True):
        m = part.stop - part.start
        o2, l2 = lse_attention(
            qs[:, :, part].reshape(1, nkv, g * m, d),
            keys[:, :, shared_len:], values[:, :, shared_len:], own_mask, scale,
        )  # fmt: skip
        own_out[:, :, :, part] = o2.view(1, nkv, g, m, d)
        own_lse[:, :, :, part] = l2.view(1, nkv, g, m)
    top = torch.maximum(lse, own_lse)
    w_shared, w_own = torch.exp(lse - top), torch.exp(own_lse - top)
    total = w_shared + w_own
    w_shared, w_own = (w_shared / total).unsqueeze(-1), (w_own / total).unsqueeze(-1)
    merged = out * w_shared + own_out * w_own
    return merged.view(1, nh, n, d)
