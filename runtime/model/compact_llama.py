"""A compact forward for the Llama family (Llama, Qwen2, Mistral without a sliding window).

The same math as transformers' modelling code with fewer, larger ops per layer: one fused QKV
projection and one fused gate-up projection, every projection and the LM head stored input-major
(``fuse``: MKL's faster product for a few rows; the HF modules' weights become views into these
tensors, so no weight is stored twice and the HF forward stays a valid reference), grouped-query
attention through ``scaled_dot_product_attention(enable_gqa=True)`` without materializing
expanded K/V, and no per-layer ``Cache`` bookkeeping beyond one write per layer. Rotary embeddings
come from the model's own ``rotary_emb`` module, so every RoPE scaling transformers supports is
kept. It knows tensors and KV layers, never requests, sampling or the prefix cache.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from runtime.model.attention import (
    CASCADE_MIN_SHARED,
    HAS_LSE_ATTENTION,
    KVWrite,
    Segment,
    StepSlots,
    attend_cascade,
    cascade_masks,
    decode_attention,
    decode_mask,
    lse_attention,
    sdpa,
)
from runtime.model.compact_weights import (
    KERNEL_LAYOUT_ISAS,
    compact_blocker,
    fused_layer,
    given,
    input_major_head,
    quantized_copies,
    to_meta,
)
from runtime.model.kernels import (
    QUANT_FORMATS,
    QUANT_HEAD_FORMAT,
    NativeKernels,
    pack_weight,
)
from runtime.model.products import (
    FEW_ROWS,
    MKL_ONLY,
    ProductChoice,
    choose_prefix_attention,
    onednn_linear,
)
from runtime.model.rope_table import RopeTable, signed

__all__ = [
    "PACKED_MAX_ROWS",
    "CompactLlama",
    "KVWrite",
    "Segment",
    "StepSlots",
    "compact_blocker",
]

NATIVE_KV_DTYPES = (torch.float32, torch.float16)
"""KV element types the native attention kernels read as they are (``decode_attention``, the C++
layer loop, ``segment_attention``): an fp16 KV cache's values are widened to fp32 inside the
kernel, so a decode step reads half the bytes and computes on the same values as over a widened
copy (bit for bit)."""

PACKED_MAX_ROWS = FEW_ROWS
"""With packed weights (``CompactLlama``'s ``packed``), products of at most this many rows
(decode steps, the LM head of a prefill, a few new tokens after a hit) read the packed copies;
larger ones (prefill) run MKL's fp32 product over the same values. NOTE: measured on W1's layer
products (30 layers, 2 threads, this host, two rounds of one run), ms for the packed copy vs
fp32 ``F.linear``: bf16: 1 row 11.1-11.5 vs 22.4-22.8, 8 rows 10.3-10.7 vs 33.6-41.1, 16 rows
15.1 vs 39.7-42.4, 64 rows 54.4-65.9 vs 81.8-98.3; fp32: 1 row 20.2-20.5, 8 rows 20.6-22.9,
16 rows 25.4-26.0, 32 rows 48.3-51.7 vs 58.1-60.9, 64 rows 61.4-80.2 (1.23-1.33x). Earlier
(session 9, 8-row tiles) the LM head (49,152 x 576) in bf16: 1.3 vs 5.0 ms for one row."""


class CompactLlama:
    """The compact forward of one loaded transformers model of the Llama family.

    Args:
        model: A ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` (eval mode)
            for which ``compact_blocker`` returns None.
        native: The C++ kernels (``runtime.model.kernels.native_kernels()``) for one-query steps, or
            None for the torch path. Used only for fp32 weights on the CPU.
        packed: With vectorized ``native`` kernels (``is_vectorized``), keep a packed copy
            (``pack_weight``) of each projection and of the LM head in this dtype, on top of the
            fp32 weights, for products of up to ``PACKED_MAX_ROWS`` rows. ``torch.bfloat16``
            (``ModelRunner``'s ``weights="bfloat16"``, whose weights already hold bf16-rounded
            values): half their fp32 bytes, read at half the bytes. ``torch.float32``
            (``weights="float32-packed"``): as many bytes again as the weights, streamed near the
            read bandwidth by products of up to 64 rows (about 1.1x MKL's speed at one row, 1.6-1.8x
            at 8-16). The values are the same, so the answers equal the fp32 products' within
            float32 rounding. ``"q8_0"`` / ``"q4_1"`` (``weights="q8_0"`` / ``"q4_1"``, whose
            weights already hold the blocks' values: ``round_weights_quantized``): GGUF's
            blocks (``quantize_weight``; the LM head in ``QUANT_HEAD_FORMAT``), 8.5 or 5 bits
            a weight, read by ``linear_quantized``. None: no copy.
        products: The library of each class of fp32 product (``fp32_products.choose_products``)
            that no packed copy serves, the C++ layer loop's included; None: MKL (torch's
            ``F.linear``) for all. Either computes in float32: the same answers within float32
            rounding.
        blocks: With ``packed`` a quantized format, GGUF blocks to use as they are (a
            ``.gguf`` file's own tensors, ``runtime.model.gguf_blocks``), by module name
            (``model.layers.0.self_attn.q_proj``, ``lm_head``; a tied head may come as
            ``model.embed_tokens``); a weight whose blocks are absent or in another format is
            quantized from its fp32 values.
        drop_fp32: With ``packed`` a quantized format or ``torch.float32`` and the copies
            kept (vectorized ``native``), free the fp32 weights the copies hold: every
            projection, the LM head and a tied embedding (the model's modules then hold
            ``meta`` tensors of their shapes, so the model's own transformers forward no longer
            runs: read everything it needs, e.g. ``weights_fingerprint``, first). Every product
            of those weights then reads the copies at any row count (``linear_packed``: for
            blocks, ``linear_quantized``'s direct tiles for a decode step and its dequantized
            panels for a prefill), and a tied embedding's rows come from the head's copy
            (dequantized from its Q8_0 blocks, exact: ``d * q`` fits float32; or read from the
            packed fp32 lines as they are). The weights are the copies' values either way, so
            the answers are the same within float32 rounding. Ignored where no copy is kept
            (and for ``torch.bfloat16``, whose copy is rounded).

    Raises:
        ValueError: ``compact_blocker(model)`` names a reason, ``packed`` is another dtype or
            format, or a given block array does not match its weight's shape.
    """

    def __init__(
        self,
        model: Any,
        *,
        native: NativeKernels | None = None,
        packed: torch.dtype | str | None = None,
        products: ProductChoice | None = None,
        blocks: Mapping[str, torch.Tensor] | None = None,
        drop_fp32: bool = False,
    ) -> None:
        why = compact_blocker(model)
        if why is not None:
            raise ValueError(f"compact forward unsupported: {why}")
        config = model.config
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads or self.num_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        inner = model.model
        self.lm_head = input_major_head(model)  # [vocab, hidden]
        self.embed = inner.embed_tokens.weight.detach()  # [vocab, hidden]
        self.rotary = inner.rotary_emb
        self._rope_table = RopeTable(self.rotary) if RopeTable.is_static(self.rotary) else None
        """One-token steps' rotary rows, looked up (None: a dynamic scaling, computed per step)."""
        self.norm = inner.norm.weight  # [hidden]
        self.layers = [fused_layer(layer) for layer in inner.layers]
        fits = self.embed.dtype == torch.float32 and self.embed.device.type == "cpu"
        self.native = native if fits else None
        """The C++ kernels this forward uses (None: the torch path); see ``attend`` and
        ``forward``'s ``slots``."""
        self.products = products if products is not None and fits else MKL_ONLY
        """Which library runs the fp32 products no packed copy serves."""
        self.native_prefix_attention, self.prefix_attention_reason = (
            (False, "no native kernels")
            if self.native is None
            else choose_prefix_attention(
                self.native.prefix_attention, lse_attention, self.num_kv_heads, self.head_dim,
                self.native.isa,
            )
        )  # fmt: skip
        """Whether a packed prefill's shared prefix is attended in the native
        ``prefix_attention`` (else torch's flash kernel), measured at load
        (``fp32_products.choose_prefix_attention``), and why."""
        self._onednn_lo, self._onednn_hi = self.products.onednn_rows()
        self._rows_max = self.products.rows if self.native is not None else 0
        """Products of at most this many rows run in the native ``linear_rows`` (0: none)."""
        if packed not in (None, torch.bfloat16, torch.float32, *QUANT_FORMATS):
            raise ValueError(f"packed must be torch.bfloat16, torch.float32, one of "
                             f"{QUANT_FORMATS} or None, not {packed}")  # fmt: skip
        copies: list[torch.Tensor] = []
        self._head_packed: torch.Tensor | None = None
        self._packed_max_rows = 0
        vectorized = self.native is not None and self.native.is_vectorized
        if vectorized and isinstance(packed, str):
            layout = self.native is not None and self.native.isa in KERNEL_LAYOUT_ISAS
            copies = quantized_copies(self.layers, packed, blocks or {}, kernel_layout=layout)
            # NOTE: a GGUF file stores a tied head once, as the embedding (token_embd)
            tied = model.lm_head.weight is model.model.embed_tokens.weight
            head_names = ("lm_head", "model.embed_tokens") if tied else ("lm_head",)
            self._head_packed = given(blocks or {}, head_names, self.lm_head,
                                       QUANT_HEAD_FORMAT[packed])  # fmt: skip
            self._packed_max_rows = PACKED_MAX_ROWS
        elif vectorized and packed is not None:
            copies = [pack_weight(w, packed) for layer in self.layers
                      for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]  # fmt: skip
            self._head_packed = pack_weight(self.lm_head, packed)
            self._packed_max_rows = PACKED_MAX_ROWS
        self._packed = copies
        """Per layer the packed qkv, o, gate_up and down weights (``pack_weight``), or empty."""
        self._embed_blocks: torch.Tensor | None = None
        """The tied embedding's rows once freed: the head's Q8_0 blocks or packed fp32 lines."""
        self.fp32_dropped = bool(drop_fp32 and copies and packed != torch.bfloat16)
        """Whether the fp32 weights the packed copies hold were freed (``drop_fp32``)."""
        if self.fp32_dropped:
            self._drop_fp32(model)
        self._layers_native = None if self.native is None else self.native.decode_layers(
            *(list(parts) for parts in zip(*self.layers, strict=True)),
            self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale,
            copies, self._packed_max_rows, self._onednn_lo, self._onednn_hi, self._rows_max,
        )  # fmt: skip

    def _drop_fp32(self, model: Any) -> None:
        """Free the fp32 weights the packed copies hold (``drop_fp32``): projections, LM head
        and a tied embedding become ``meta`` tensors (shapes and strides kept, no storage) here
        and in ``model``'s modules; every product then reads the copies (``_packed_max_rows``
        unbounded, no fp32 library path)."""
        assert self._head_packed is not None, "drop_fp32 needs the head's copy"
        self.layers, self.lm_head, tied = to_meta(model, self.layers)
        if tied:
            model.model.embed_tokens.weight = model.lm_head.weight
            self._embed_blocks = self._head_packed
            self.embed = self.lm_head
        self._packed_max_rows = sys.maxsize
        self._rows_max, self._onednn_lo, self._onednn_hi = 0, 1, 0

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``ids`` (any shape): ``[*ids.shape, hidden]`` fp32 (with the
        fp32 embedding freed, its rows read from the tied head's copy: dequantized from Q8_0
        blocks, or gathered from packed fp32 lines ``[vocab / 32, hidden, 32]``)."""
        if self._embed_blocks is None:
            return F.embedding(ids, self.embed)
        flat = ids.reshape(-1)
        if self._embed_blocks.dtype == torch.float32:  # pack_weight: row v at [v // 32, :, v % 32]
            cols = self._embed_blocks.shape[-1]
            return self._embed_blocks[flat // cols, :, flat % cols].view(*ids.shape, -1)
        assert self.native is not None
        out: torch.Tensor = self.native.dequantize_blocks(self._embed_blocks[flat])
        return out.view(*ids.shape, -1)

    @property
    def packed_products(self) -> bool:
        """Whether small products read packed weight copies (``packed`` with ``native``)."""
        return bool(self._packed)

    @property
    def products_label(self) -> str:
        """Where the fp32 products that reach a library run, for the start line: ``"oneDNN
        products"``, ``"... for decode"``, ``"... for prefill"`` or "" (MKL); with packed copies
        (which serve the few-row products) only prefill can be named; with the fp32 weights
        freed (``fp32_dropped``) every product reads the copies: ""."""
        if self.fp32_dropped:
            return ""
        return self.products.describe(packed=self.packed_products)

    @property
    def packed_bytes(self) -> int:
        """Bytes held by the packed copies (0 without them)."""
        copies = [*self._packed, *([] if self._head_packed is None else [self._head_packed])]
        return sum(c.numel() * c.element_size() for c in copies)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention with grouped KV heads; 16-bit inputs are attended in fp32.

        One query per row (a decode step) takes the native kernel when there is one and the
        mask is additive ``[B, 1, 1, kv_len]`` or None, else two batched matrix products and a
        softmax (``decode_attention``); longer queries take SDPA. ``mask``: boolean (True =
        attend) or additive float, broadcast to ``[B, 1, q, kv_len]``. K/V of an fp16 KV cache
        under fp32 queries are attended as their fp32 values (the native kernel widens them
        itself; the torch paths take a widened copy).

        NOTE: torch's bf16 attention on CPU runs about 6x slower than fp32 (measured in issue
        19's profile: ~35 ms vs ~6 ms per decode step on W1), while the upcast of one layer's
        K/V is a cheap copy; weights and the KV cache stay 16-bit, so memory traffic still halves.
        """
        dtype = q.dtype
        if dtype != torch.float32:
            q, k, v = q.float(), k.float(), v.float()
            if mask is not None and mask.dtype != torch.bool:
                mask = mask.float()
        out: torch.Tensor
        if q.shape[2] == 1 and self._native_fits(k, v, mask):
            assert self.native is not None
            flat = None if mask is None else mask.reshape(mask.shape[0], -1)
            out = self.native.decode_attention(q[:, :, 0], k, v, flat, self.scale).unsqueeze(2)
            return out if dtype == torch.float32 else out.to(dtype)
        k, v = k.to(q.dtype), v.to(q.dtype)  # NOTE: fp16 K/V widen exactly; else no copy
        if q.shape[2] == 1:
            out = decode_attention(q, k, v, mask, self.scale)
        else:
            out = sdpa(q, k, v, mask, self.scale)
        return out if dtype == torch.float32 else out.to(dtype)

    def _native_fits(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
        """Whether the native kernel takes this step: CPU, K/V fp32 or fp16 with rows
        contiguous, and the mask None or additive with one value per (row, key)."""
        if self.native is None or k.device.type != "cpu" or k.dtype not in NATIVE_KV_DTYPES:
            return False
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            return False
        return mask is None or (
            mask.dtype == torch.float32
            and mask.shape[0] == k.shape[0]
            and mask.numel() == k.shape[0] * k.shape[2]
        )

    def rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)``, each ``[B, q, 1, D]``, for hidden states ``h`` at ``positions``.

        ``signed_sin`` carries rotate-half's sign (``-sin`` on the first half), so rotating is
        ``x * cos + x.roll(D / 2) * signed_sin``; ``qkv`` consumes the pair.
        """
        if self._rope_table is not None and positions.shape[1] == 1:
            return self._rope_table.lookup(h, positions)
        cos, sin = self.rotary(h, positions)  # [B, q, D] each
        return cos.unsqueeze(2), signed(sin).unsqueeze(2)

    def qkv(
        self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s rotated queries ``[B, H, q, D]``, keys and values ``[B, H_kv, q, D]``.

        ``cos`` / ``sin``: the pair ``rope`` returns. Queries and keys rotate in one op set.
        """
        layer, (b, q, _) = self.layers[i], h.shape
        d, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        x = F.rms_norm(h, (h.shape[-1],), layer.ln1, self.eps)
        qkv = self._linear(x, layer.qkv, layer.qkv_bias, self._pack(i, 0))  # [B, q, (H + 2 H_kv) D]
        qk = qkv[..., : (nh + nkv) * d].view(b, q, nh + nkv, d)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)  # rotate-half RoPE
        vs = qkv[..., (nh + nkv) * d :].view(b, q, nkv, d).transpose(1, 2)
        return qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2), vs

    def finish(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s output projection and MLP over ``attn`` (``[B, H, q, D]``): new ``h``."""
        layer, (b, q, _) = self.layers[i], h.shape
        attn = attn.transpose(1, 2).reshape(b, q, -1)
        h = h + self._linear(attn, layer.o, layer.o_bias, self._pack(i, 1))
        x = F.rms_norm(h, (h.shape[-1],), layer.ln2, self.eps)
        gate, up = self._linear(x, layer.gate_up, None, self._pack(i, 2)).chunk(2, dim=-1)
        return h + self._linear(F.silu(gate).mul_(up), layer.down, None, self._pack(i, 3))

    def _pack(self, i: int, which: int) -> torch.Tensor | None:
        """Layer ``i``'s packed copy of qkv (0), o (1), gate_up (2) or down (3), or None."""
        return self._packed[4 * i + which] if self._packed else None

    def _linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: torch.Tensor | None,
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)``; for at most ``PACKED_MAX_ROWS`` fp32 rows (a decode
        step's LM head, a short prefill chunk, a prompt's few new tokens after a hit) with a
        ``packed`` copy of ``weight`` (``pack_weight``), ``linear_packed`` over it instead: the
        same values, streamed from the packed blocks; else in the native ``linear_rows`` over
        ``weight`` itself (input-major) for at most ``products.rows`` rows; else on oneDNN where
        ``products`` says so for this many rows."""
        rows = x.numel() // x.shape[-1]
        out: torch.Tensor
        if x.dtype == torch.float32 and x.device.type == "cpu":
            if packed is not None and self.native is not None and rows <= self._packed_max_rows:
                out = self.native.linear_packed(x, packed, bias, weight.shape[0])
                return out
            if 0 < rows <= self._rows_max and self.native is not None:
                out = self.native.linear_rows(x, weight, bias)
                return out
            if self._onednn_lo <= rows <= self._onednn_hi:
                return onednn_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[B, q, hidden]`` -> ``[B, q, vocab]``."""
        x = F.rms_norm(h, (h.shape[-1],), self.norm, self.eps)
        return self._linear(x, self.lm_head, None, self._head_packed)

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        write_kv: KVWrite,
        mask: torch.Tensor | None,
        *,
        logits_to_keep: int = 1,
        slots: StepSlots | None = None,
    ) -> torch.Tensor:
        """Run ``ids`` (``[B, q]``) at ``positions`` (``[B, q]``) over the caller's KV.

        Args:
            ids: Token ids, ``[B, q]``.
            positions: Their absolute positions, ``[B, q]`` (RoPE).
            write_kv: Stores each layer's new K/V and returns all K/V attended to.
            mask: ``[B, 1, q, kv_len]`` boolean (True = attend) or additive float mask.
            logits_to_keep: Last positions whose logits are computed.
            slots: The layout ``write_kv`` writes to, for a one-token step: with the native
                kernels the layer loop then runs in C++ (``DecodeLayers``: the same math, equal
                within float32 rounding) and ``write_kv`` is not called.

        Returns:
            ``[B, logits_to_keep, vocab]`` logits.
        """
        h = self.embed_tokens(ids)  # [B, q, hidden]
        cos, sin = self.rope(h, positions)
        if mask is not None and ids.shape[1] == 1 and mask.dtype == torch.bool:
            mask = decode_mask(mask)
        native_slots = slots is not None and slots.buffer.dtype in NATIVE_KV_DTYPES
        if native_slots and ids.shape[1] == 1 and self._layers_native is not None:
            assert slots is not None
            h = self._layers_native.run(
                h, cos, sin, slots.buffer, slots.rows, slots.pos, slots.kv_len, mask,
                slots.src, slots.shared,
            )  # fmt: skip
            return self.logits(h)
        for i in range(len(self.layers)):
            qs, ks, vs = self.qkv(i, h, cos, sin)
            keys, values = write_kv(i, ks, vs)  # [B, H_kv, kv_len, D]
            h = self.finish(i, h, self.attend(qs, keys, values, mask))
        return self.logits(h[:, -logits_to_keep:])

    @torch.no_grad()
    def forward_packed(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[Segment],
        *,
        shared_len: int = 0,
    ) -> torch.Tensor:
        """Several sequences' new tokens packed in one row: one set of projections for all.

        Every projection and MLP runs once over all ``N`` tokens (larger matrix products, one
        pass over the weights); attention runs per segment over that segment's own KV, so no
        token sees another sequence: with the native kernels and every segment's ``buffer``, one
        ``segment_attention`` call per layer writes and attends all segments (``write_kv`` is not
        called); else ``write_kv`` and SDPA per segment.

        Args:
            ids: ``[1, N]`` token ids, the segments' tokens one after another.
            positions: ``[1, N]`` their absolute positions in their own sequences (RoPE).
            segments: In order, lengths summing to ``N``; each with its own KV write and the
                positions before its tokens (its causal mask, ``Segment.mask``).
            shared_len: Every segment's keys and values ``[0, shared_len)`` hold the same
                bytes and precede all its tokens (a prefix the rows copied from the same cache
                blocks). With ``CASCADE_MIN_SHARED`` or more and two segments or more, all
                ``N`` queries attend to that prefix in one product and each segment to the
                rest of its own keys, merged by log-sum-exp (cascade attention: the same
                softmax, summed in another order, so equal within float32 rounding).

        Returns:
            ``[len(segments), vocab]`` logits of each segment's last token.
        """
        assert sum(s.length for s in segments) == ids.shape[1], "segments must cover ids"
        h = self.embed_tokens(ids)  # [1, N, hidden]
        cos, sin = self.rope(h, positions)
        cascade = shared_len >= CASCADE_MIN_SHARED and len(segments) > 1 and HAS_LSE_ATTENTION
        if not cascade and self._segments_fit(h, segments):
            return self._forward_segments(h, cos, sin, segments)
        masks = [seg.mask(h.device) for seg in segments]
        group = self.num_heads // self.num_kv_heads
        own_masks = cascade_masks(masks, shared_len, group) if cascade else []
        for i in range(len(self.layers)):
            qs, ks, vs = self.qkv(i, h, cos, sin)
            parts, start = [], 0
            for seg, mask in zip(segments, masks, strict=True):
                part = slice(start, start + seg.length)
                keys, values = seg.write_kv(i, ks[:, :, part], vs[:, :, part])
                parts.append((part, keys.to(qs.dtype), values.to(qs.dtype), mask))  # fp16 widened
                start += seg.length
            if cascade and qs.dtype == torch.float32 and qs.device.type == "cpu":
                attn = self._attend_cascade(qs, parts, shared_len, own_masks)
            else:
                attn = torch.cat([self.attend(qs[:, :, p], k, v, m) for p, k, v, m in parts], 2)
            h = self.finish(i, h, attn)  # attention [1, H, N, D]
        return self._segment_logits(h, segments)

    def _segment_logits(self, h: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """``[G, vocab]`` logits of each segment's last token of ``h`` (``[1, N, hidden]``)."""
        ends = list(itertools.accumulate(s.length for s in segments))
        return self.logits(h[:, [end - 1 for end in ends]])[0]

    def _segments_fit(self, h: torch.Tensor, segments: Sequence[Segment]) -> bool:
        """Whether ``forward_packed`` attends in the native ``segment_attention``: vectorized
        kernels, fp32 on CPU, a head dim it takes (a multiple of 16 up to 128), and every
        segment's buffer known (``Segment.buffer``), all fp32 or all fp16 (an fp16 KV cache: the
        kernel stores the new K/V rounded and attends over the rounded values)."""
        native = self.native
        if native is None or not native.is_vectorized or h.dtype != torch.float32:
            return False
        if h.device.type != "cpu" or self.head_dim % 16 != 0 or self.head_dim > 128:
            return False
        dtypes = {None if s.buffer is None else s.buffer.dtype for s in segments}
        return len(dtypes) == 1 and dtypes <= set(NATIVE_KV_DTYPES)

    def _forward_segments(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[Segment]
    ) -> torch.Tensor:
        """``forward_packed``'s layer loop with each layer's attention in one native call
        (``segment_attention``, which also writes every segment's new K/V into its buffer
        instead of ``write_kv``): ``h`` ``[1, N, hidden]`` -> ``[G, vocab]`` logits."""
        assert self.native is not None
        buffers = [s.buffer for s in segments]
        past, lengths = [s.past for s in segments], [s.length for s in segments]
        for i in range(len(self.layers)):
            qs, ks, vs = self.qkv(i, h, cos, sin)
            attn: torch.Tensor = self.native.segment_attention(
                qs[0], ks[0], vs[0], buffers, i, past, lengths, self.scale
            )  # [H, N, D]
            h = self.finish(i, h, attn.unsqueeze(0))
        return self._segment_logits(h, segments)

    def _attend_prefix(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unmasked attention of ``q`` ``[1, H_kv, M, D]`` to ``k``, ``v`` ``[1, H_kv, S, D]``
        and its log-sum-exp ``[1, H_kv, M]``: the native ``prefix_attention`` where it is used
        (``native_prefix_attention``; ``D`` a multiple of 16 up to 128), else torch's flash
        kernel; the same numbers within float32 rounding."""
        d = q.shape[-1]
        native = self.native if self.native_prefix_attention else None
        if native is not None and d % 16 == 0 and d <= 128 and v.stride(-1) == 1:
            out, lse = native.prefix_attention(q[0], k[0], v[0], self.scale)
            return out.unsqueeze(0), lse.unsqueeze(0)
        return lse_attention(q, k, v, None, self.scale)

    def _attend_cascade(
        self,
        qs: torch.Tensor,
        parts: list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor | None]],
        shared_len: int,
        own_masks: list[torch.Tensor | None],
    ) -> torch.Tensor:
        """``forward_packed``'s attention with a shared prefix (``attention.attend_cascade``),
        the prefix attended by ``_attend_prefix``."""
        return attend_cascade(qs, parts, shared_len, own_masks, self.scale, self._attend_prefix)
