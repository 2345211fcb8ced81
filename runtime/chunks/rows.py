"""A forward pass of chosen prompt rows over a KV buffer whose other positions are already filled.

Chunk reuse (``runtime.chunks``) places stored chunk KV in a request's buffer, then runs only
some positions through the model: the non-chunk tokens (exact mode), or those plus the chunk
tokens whose KV deviates most (blend mode, CacheBlend's selection: layer 0 for every row, layer 1's
K/V compared with the stored ones). Each chosen row attends causally by position to every key in
the buffer and writes its K/V at its own position. It runs on ``CompactLlama``'s layer pieces; it
knows tensors, never requests, the chunk store or the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.model.compact_llama import CompactLlama

__all__ = ["RowForward"]

_QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class RowForward:
    """Rows ``start + r`` (``r`` in the rows given) of ``ids`` over ``kv``.

    Args:
        model: The compact forward of the model.
        kv: ``[L, 2, H_kv, n, D]`` view of the request's KV; positions outside the rows hold
            their final KV already (a cached head, placed chunks), rows are (over)written.
        ids: The prompt's ``n`` token ids.
        start: First position any row may have (the head before it is never recomputed).
    """

    def __init__(self, model: CompactLlama, kv: torch.Tensor, ids: Sequence[int], start: int):
        self.model, self.kv, self.start = model, kv, start
        device = kv.device
        self.positions = torch.arange(start, kv.shape[3], device=device)  # [n - start]
        self.cols = torch.arange(kv.shape[3], device=device)  # [n]
        self.ids = torch.tensor([list(ids[start:])], device=device)  # [1, n - start]

    @torch.no_grad()
    def run(self, rows: torch.Tensor) -> torch.Tensor:
        """Every layer for ``rows`` (sorted, the last row last); ``[vocab]`` logits of it."""
        h, cos, sin = self._embed(rows)
        for i in range(len(self.model.layers)):
            h = self._layer(i, h, rows, self.model.qkv(i, h, cos, sin))
        return self.model.logits(h[:, -1:])[0, -1]

    @torch.no_grad()
    def blend(self, in_span: torch.Tensor, num_pick: int) -> tuple[torch.Tensor, torch.Tensor]:
        """CacheBlend: layer 0 for every row; then the non-span rows and the ``num_pick`` span
        rows whose layer-1 K/V deviate most (squared L2 over heads and dims) from the stored ones
        run through layers 1..L-1.

        Returns:
            ``[vocab]`` logits of the last row and the rows recomputed past layer 0.
        """
        every = torch.arange(len(self.positions), device=self.cols.device)
        h, cos, sin = self._embed(every)
        h = self._layer(0, h, every, self.model.qkv(0, h, cos, sin))
        if len(self.model.layers) == 1:  # NOTE: nothing to blend: layer 0 ran for every row
            return self.model.logits(h[:, -1:])[0, -1], every
        qs, ks, vs = self.model.qkv(1, h, cos, sin)  # [1, H(_kv), rows, D]
        stored = self.kv[1, :, :, self.start :]  # [2, H_kv, rows, D]
        dev = ((ks[0] - stored[0]) ** 2).sum((0, 2)) + ((vs[0] - stored[1]) ** 2).sum((0, 2))
        dev = dev.float().masked_fill(~in_span, -1.0)
        keep = ~in_span
        if num_pick:
            keep[torch.topk(dev, num_pick).indices] = True
        rows = keep.nonzero().squeeze(1)
        h, cos, sin = h[:, rows], cos[:, rows], sin[:, rows]
        qkv: _QKV = (qs[:, :, rows], ks[:, :, rows], vs[:, :, rows])
        for i in range(1, len(self.model.layers)):
            h = self._layer(i, h, rows, qkv if i == 1 else self.model.qkv(i, h, cos, sin))
        return self.model.logits(h[:, -1:])[0, -1], rows

    def _embed(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden states ``[1, r, hidden]`` of ``rows`` and their ``[1, r, 1, D]`` RoPE pair."""
        h = self.model.embed_tokens(self.ids[:, rows])
        cos, sin = self.model.rope(h, self.positions[rows].unsqueeze(0))
        return h, cos, sin

    def _layer(self, i: int, h: torch.Tensor, rows: torch.Tensor, qkv: _QKV) -> torch.Tensor:
        """Layer ``i`` for ``rows`` (``h`` is theirs): write their K/V, attend causally to all."""
        qs, ks, vs = qkv
        at = self.positions[rows]  # [r]
        self.kv[i, 0].index_copy_(1, at, ks[0].to(self.kv.dtype))  # an fp16 KV rounds here
        self.kv[i, 1].index_copy_(1, at, vs[0].to(self.kv.dtype))
        allowed = self.cols.unsqueeze(0) <= at.unsqueeze(1)  # [r, n]
        keys, values = self.kv[i, 0].unsqueeze(0), self.kv[i, 1].unsqueeze(0)
        attn = self.model.attend(qs, keys, values, allowed.view(1, 1, len(rows), -1))
        return self.model.finish(i, h, attn)
