"""Model runner: loads a Hugging Face causal LM + tokenizer and runs forward steps on a KV cache.

It sees token ids, positions and a ``RequestKVCache``; it never sees the radix tree or the pool.
It also decides, from the model's layer types, whether resuming from a cached prefix is exact.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, get_args

import torch
from transformers import DynamicCache

from runtime.config import ForwardPath, KVDtype, WeightsDtype
from runtime.exceptions import ModelLoadError
from runtime.model.attention import Segment, prefill_mask
from runtime.model.batch_kv import BatchKV
from runtime.model.batch_mask import MaskPlan, mask_plan
from runtime.model.compact_llama import CompactLlama
from runtime.model.compact_weights import compact_blocker
from runtime.model.kernels import (
    native_kernels,
)
from runtime.model.kv_cache import RequestKVCache
from runtime.model.loading import (
    load_model,
    round_weights_bf16,
    round_weights_quantized,
    weights_fingerprint,
)
from runtime.model.names import is_local_path
from runtime.model.products import ProductChoice, choose_products

__all__ = [
    "ForwardPath",
    "KVShape",
    "ModelRunner",
    "WeightsDtype",
    "is_local_path",
    "load_model",
    "reuse_blocker",
    "round_weights_bf16",
    "round_weights_quantized",
    "weights_fingerprint",
]

_WEIGHTS: tuple[WeightsDtype, ...] = get_args(WeightsDtype)

logger = logging.getLogger(__name__)

_PACKED: dict[str, torch.dtype | str] = {
    "bfloat16": torch.bfloat16, "float32-packed": torch.float32, "q8_0": "q8_0", "q4_1": "q4_1",
}  # fmt: skip
"""WeightsDtype -> the compact forward's ``packed`` copies."""
# Layer kinds whose KV at position p depends only on tokens <= p, kept whole by RequestKVCache.
_RESUMABLE_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


class KVShape(NamedTuple):
    """Per-layer KV geometry discovered by a probe forward."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def reuse_blocker(config: Any) -> str | None:
    """Why resuming from a cached prefix would not be exact for this model, or None if it is."""
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted(set(layer_types) - _RESUMABLE_LAYER_TYPES)
    if odd:
        return f"layer types {odd} keep state that cannot be resumed from stored KV blocks"
    if getattr(text, "model_type", "") in {"mamba", "mamba2", "rwkv", "jamba", "falcon_mamba"}:
        return f"model type {text.model_type!r} is recurrent (SSM state, no per-token KV)"
    return None


class ModelRunner:
    """Forward passes of one model: prefill on one request's KV row, decode on all rows."""

    def __init__(
        self,
        model: Any,
        *,
        forward: ForwardPath = "auto",
        weights: WeightsDtype = "float32",
        blocks: Mapping[str, torch.Tensor] | None = None,
        kv_dtype: KVDtype = "auto",
    ) -> None:
        """Wrap a loaded model.

        Args:
            model: A loaded transformers causal LM (eval mode).
            forward: Which forward runs it (see ``ForwardPath``).
            weights: ``"bfloat16"`` rounds a float32 model's linear weights in place
                (``round_weights_bf16``); on the compact forward with the native kernels, decode
                steps then read packed bf16 copies (half the weight bytes). Elsewhere it only
                rounds (the same answers, no speed-up). ``"float32-packed"``, on the compact
                forward with vectorized native kernels (any ISA but scalar), moves the linear
                weights into packed fp32 copies (``CompactLlama``'s ``packed``: blocks of 32
                output columns) that every product reads, and frees the weights as loaded
                (``drop_fp32``: the same bytes, the same values); elsewhere it changes nothing
                (the start line says why).
                ``"q8_0"`` / ``"q4_1"`` round the linear weights to GGUF's blocks
                (``round_weights_quantized``) and, on the compact forward with vectorized
                native kernels, keep the blocks for every product of those weights and free
                their fp32 copies (``CompactLlama``'s ``drop_fp32``: the weight memory is the
                blocks', and ``model``'s own forward no longer runs).
            blocks: With a quantized ``weights``, GGUF blocks by module name to keep as they
                are (a ``.gguf`` file's own tensors: ``runtime.model.gguf_blocks``); see
                ``CompactLlama``'s ``blocks``.
            kv_dtype: The KV cache's element type (``EngineConfig.kv_dtype``): ``"float16"``
                rounds keys and values to fp16 when written (the compact forward attends over
                the rounded values everywhere), ``"float32"`` keeps them; ``"auto"``: the
                model's dtype.

        Raises:
            ValueError: ``forward="compact"`` on a model ``compact_blocker`` refuses, an unknown
                ``weights``, ``weights`` other than ``"float32"`` on a model that is not
                float32, a quantized ``weights`` on a model with a linear layer whose input size
                is not a multiple of 32 (named), ``blocks`` that do not fit their weights, or
                a ``kv_dtype`` other than ``"auto"`` on a model that is not float32 or (for
                ``"float16"``) off the compact forward.
        """
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if weights not in _WEIGHTS:
            raise ValueError(f"unknown weights {weights!r}; valid: {sorted(_WEIGHTS)}")
        if weights != "float32" and self.dtype != torch.float32:
            raise ValueError(f"weights={weights!r} needs a float32 model (dtype='float32'), "
                             f"not {self.dtype}")  # fmt: skip
        if kv_dtype != "auto" and self.dtype != torch.float32:
            raise ValueError(f"kv_dtype={kv_dtype!r} needs a float32 model (dtype='float32'), "
                             f"not {self.dtype}")  # fmt: skip
        if weights == "bfloat16":
            round_weights_bf16(model)
        elif weights in ("q8_0", "q4_1"):
            round_weights_quantized(model, weights)
        self.weights: WeightsDtype = weights
        """How the weights are held (``WeightsDtype``)."""
        self.kv_shape = self._probe()
        plan, no_batch = mask_plan(model)
        self.mask_plan: MaskPlan | None = plan
        """How to mask a batched decode step; None means batch size 1 (see ``batch_blocker``)."""
        self.batch_blocker = no_batch
        """Why this model decodes one request at a time, or None when it batches."""
        why = compact_blocker(model) if forward != "transformers" else "forward='transformers'"
        if forward == "compact" and why is not None:
            raise ValueError(f"forward='compact' is not available for this model: {why}")
        # NOTE: the kernels are fp32 on the CPU: other models never build them (35-90 s once).
        is_fp32_cpu = self.dtype == torch.float32 and self.device.type == "cpu"
        native = native_kernels() if why is None and is_fp32_cpu else None
        self.products: ProductChoice | None = None
        """Which library runs the compact forward's fp32 products (MKL or oneDNN, measured at
        load: ``fp32_products.choose_products``); None off the compact forward or not fp32 on
        the CPU (torch's own choice)."""
        if why is None and is_fp32_cpu:
            rows = native.linear_rows if native is not None and native.is_vectorized else None
            self.products = choose_products(_largest_linear(model), rows_kernel=rows)
        # NOTE: read while every weight is there: a quantized compact forward frees the fp32
        # copies of the weights its blocks hold (CompactLlama's drop_fp32)
        self.fingerprint = weights_fingerprint(model)
        """``weights_fingerprint`` of the model as loaded (and rounded): names KV on disk."""
        self.compact = (
            CompactLlama(
                model,
                native=native,
                packed=_PACKED.get(weights),
                products=self.products,
                blocks=blocks,
                drop_fp32=weights in ("q8_0", "q4_1", "float32-packed"),
            )  # fmt: skip
            if why is None
            else None
        )
        if self.compact is not None and self.compact.fp32_dropped:
            _return_freed_memory()
        self.path: Literal["compact", "transformers"] = (
            "compact" if self.compact else "transformers"
        )
        """Which forward runs this model."""
        self.path_reason = why
        """Why the compact forward is not used (None when it is)."""
        if self.compact is not None:
            self.batch_blocker = None  # NOTE: the compact forward builds its own decode masks.
        self.kv_dtype = self._kv_dtype(kv_dtype)
        """The KV cache's element type (``torch.float16``: rounded when written, see
        ``EngineConfig.kv_dtype``); every KV buffer, the batch KV, the pool and the disk tier
        hold it."""

    def _kv_dtype(self, choice: KVDtype) -> torch.dtype:
        """``kv_dtype``'s torch dtype (see ``__init__``).

        Raises:
            ValueError: ``"float16"`` off the compact forward (transformers' attention takes
                one dtype for queries and keys).
        """
        if choice == "float16" and self.compact is None:
            raise ValueError(f"kv_dtype='float16' needs the compact forward: {self.path_reason}")
        if choice == "auto":
            model_dtype: torch.dtype = self.dtype
            return model_dtype
        return torch.float16 if choice == "float16" else torch.float32

    @property
    def decode_attention(self) -> str:
        """``"native"`` when decode steps attend in the C++ kernel (``runtime.model.kernels``), else
        ``"torch"``."""
        return "native" if self.compact is not None and self.compact.native else "torch"

    @property
    def can_batch(self) -> bool:
        """Whether decode steps may run several rows at once."""
        return self.compact is not None or self.mask_plan is not None

    @property
    def can_pack_prefill(self) -> bool:
        """Whether several requests' prefill chunks may run in one forward (``forward_packed``).

        Only the compact forward packs them; the transformers path prefills one at a time.
        """
        return self.compact is not None

    def new_cache(self, capacity: int) -> RequestKVCache:
        """An empty ``RequestKVCache`` able to hold ``capacity`` positions before growing."""
        return RequestKVCache(
            num_layers=self.kv_shape.num_layers,
            num_kv_heads=self.kv_shape.num_kv_heads,
            head_dim=self.kv_shape.head_dim,
            capacity=capacity,
            dtype=self.kv_dtype,
            device=self.device,
        )

    @torch.no_grad()
    def forward(
        self, token_ids: list[int], kv: RequestKVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Run ``token_ids`` at positions ``[kv.length, kv.length + n)``; commit their KV.

        Returns:
            ``[vocab]`` float logits of the last position, or with ``all_logits`` the
            ``[n, vocab]`` logits of every position (prompt logprobs).
        """
        start, n = kv.length, len(token_ids)
        keep = n if all_logits else 1
        kv.reserve(start + n)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        positions = torch.arange(start, start + n, device=self.device).unsqueeze(0)  # [1, n]
        if self.compact is not None:
            mask = prefill_mask(start, n, self.device)
            logits = self.compact.forward(ids, positions, kv.write, mask, logits_to_keep=keep)
        else:
            logits = self.model(
                input_ids=ids,
                position_ids=positions,
                cache=kv,
                use_cache=True,
                logits_to_keep=keep,
            ).logits
        kv.advance(n)
        out: torch.Tensor = logits[0] if all_logits else logits[0, -1]
        return out

    @torch.no_grad()
    def forward_packed(
        self, chunks: Sequence[tuple[list[int], RequestKVCache]], *, shared_len: int = 0
    ) -> torch.Tensor:
        """Prefill several requests' chunks in one forward; commit each one's KV.

        Chunk ``i``'s tokens run at positions ``[kv_i.length, kv_i.length + n_i)`` of its own
        KV and attend only to it, as ``forward`` would run it alone (same math; the larger
        matrix products may round differently in the last bits).

        ``shared_len``: every chunk's KV holds the same bytes at positions ``[0, shared_len)``
        (``BatchKV.common_prefix``): attended once for all of them (``CompactLlama``'s cascade).

        Returns:
            ``[len(chunks), vocab]`` float logits of each chunk's last position.

        Raises:
            ValueError: this runner has no compact forward (``can_pack_prefill`` is False).
        """
        if self.compact is None:
            raise ValueError("packed prefill needs the compact forward (can_pack_prefill)")
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        segments = []
        for token_ids, kv in chunks:
            start, n = kv.length, len(token_ids)
            kv.reserve(start + n)
            ids += token_ids
            positions.append(torch.arange(start, start + n))
            segments.append(Segment(n, kv.write, start, kv.buffer))
        ids_t = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, N]
        pos_t = torch.cat(positions).to(self.device).unsqueeze(0)  # [1, N]
        logits = self.compact.forward_packed(ids_t, pos_t, segments, shared_len=shared_len)
        for token_ids, kv in chunks:
            kv.advance(len(token_ids))
        return logits

    @torch.no_grad()
    def decode(self, token_ids: Sequence[int | None], batch: BatchKV) -> torch.Tensor:
        """One decode step of every live row: row ``i`` feeds ``token_ids[i]`` at its length.

        ``None`` marks an idle row (a request still prefilled in chunks): it is fed a placeholder
        at its length, a scratch position its next prefill chunk overwrites, its KV is not
        committed and its logits row is meaningless. Keys are read up to the longest non-idle row.

        Returns:
            ``[n, vocab]`` logits, one row per live row of ``batch``.
        """
        n = len(token_ids)
        fed = [0 if t is None else t for t in token_ids]
        ids = torch.tensor(fed, dtype=torch.long, device=self.device).unsqueeze(1)  # [n, 1]
        lengths = [kv.length for kv in batch.rows]
        positions = torch.tensor(lengths, device=self.device)  # [n]
        for kv in batch.rows:
            kv.reserve(kv.length + 1)
        idle = [i for i, t in enumerate(token_ids) if t is None]
        kv_len = max(p for p, t in zip(lengths, token_ids, strict=True) if t is not None) + 1
        batch.begin_step(positions, kv_len)
        if self.compact is not None:
            # NOTE: no row shorter than the longest (one row, or equal lengths): every row
            # attends to every key, so no mask (``decode_mask``'s None, without building it).
            allowed = None
            if min(lengths) + 1 < kv_len:
                cols = torch.arange(kv_len, device=self.device)  # [kv_len]
                allowed = (cols.unsqueeze(0) <= positions.unsqueeze(1)).view(n, 1, 1, -1)
            step = self.compact.forward(
                ids, positions.unsqueeze(1), batch.write_step, allowed, slots=batch.step_slots()
            )
            batch.end_step(idle)
            return step[:, -1]
        mask = None
        if self.mask_plan is not None:
            mask = self.mask_plan.build(positions, batch.step_kv_len, self.dtype)
        else:
            assert n == 1, "a model without a mask plan decodes one row at a time"
        out = self.model(
            input_ids=ids,
            position_ids=positions.unsqueeze(1),
            attention_mask=mask,
            cache=batch.step_cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch.end_step(idle)
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    @torch.no_grad()
    def _probe(self) -> KVShape:
        """Run one token through a ``DynamicCache`` to read each layer's KV shape."""
        probe = DynamicCache()
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        try:
            self.model(input_ids=ids, cache=probe, use_cache=True)
            layers: list[Any] = list(probe.layers)
            shapes = {(layer.keys.shape[1], layer.keys.shape[3]) for layer in layers}
        except (AttributeError, TypeError, RuntimeError) as exc:
            raise ModelLoadError(f"model does not expose a per-layer KV cache: {exc}") from exc
        if len(shapes) != 1:
            raise ModelLoadError(f"layers with different KV shapes are not supported: {shapes}")
        heads, head_dim = shapes.pop()
        return KVShape(len(layers), int(heads), int(head_dim))


def _return_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    NOTE: the freed fp32 weights (a few MB each) sit in glibc's heap, which keeps freed memory
    for reuse: SmolLM2-135M with ``q4_1`` held 1,534 MB resident after load, 1,101 MB after the
    trim (float32: 1,522 and 1,518)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # NOTE: not glibc: its allocator returns memory its own way
        pass


def _largest_linear(model: Any) -> torch.Tensor:
    """A copy of the largest projection weight of the first decoder layer as transformers holds
    it (``[N, K]``; W1: the gate projection, 1536 x 576, half of the forward's fused gate-up
    product), stored input-major as the compact forward stores its weights
    (``compact_weights.fuse``), for ``choose_products`` to time."""
    layer = model.model.layers[0]
    weights = [m.weight for m in (*layer.self_attn.children(), *layer.mlp.children())
               if isinstance(m, torch.nn.Linear)]  # fmt: skip
    return max(weights, key=lambda w: w.numel()).detach().t().contiguous().t()
