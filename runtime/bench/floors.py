"""Hardware floors for the W1 figures, measured in the same run as the figures they bound.

Peak GEMM rate (a large fp32 ``torch.matmul``) and memory read bandwidth (a sum over a tensor far
larger than the caches), then each figure's floor: a prefill needs its FLOPs at the peak rate, a
decode step needs every weight and the attended KV read once at the read bandwidth. The FLOP and
byte counts are the standard dense-transformer ones (Kaplan et al. 2020, "Scaling Laws for
Neural Language Models", table 1: 2 FLOPs per weight per token, plus attention). It knows
shapes and timers, never engines.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, get_args

import torch

from runtime.config import WeightsDtype
from runtime.model.kernels import QUANT_BLOCK, QUANT_BLOCK_BYTES, QUANT_FORMATS, QUANT_HEAD_FORMAT
from runtime.model.products import onednn_linear, onednn_problem

__all__ = ["Hardware", "W1Shape", "batching_floor_ratio", "measure_hardware"]


class Hardware(NamedTuple):
    """What this machine sustains now (best of a few runs, so load from others shows less)."""

    gemm_gflops: float
    """fp32 matmul rate, GFLOP/s (``matmul_size``-square matrices)."""
    read_gb_s: float
    """Read bandwidth of a ``tensor.sum()`` over ``read_bytes``, GB/s (1e9 bytes)."""


def measure_hardware(
    *, matmul_size: int = 2048, read_bytes: int = 1 << 29, repeats: int = 5
) -> Hardware:
    """Time a square fp32 matmul and a large sum; best of ``repeats`` (after one warm-up).

    The matmul runs on MKL (``torch.matmul``) and, where it can (``onednn_problem``), on oneDNN,
    which the compact forward may use instead (``runtime.model.products``); the faster sets the
    peak. NOTE: on an AMD EPYC host MKL reached 122-179 GFLOP/s, while the forward's oneDNN
    products of 512 rows ran about twice as fast: a floor from MKL alone was no floor there.
    """
    a = torch.randn(matmul_size, matmul_size)
    b = torch.randn(matmul_size, matmul_size)
    big = torch.ones(read_bytes // 4)  # [read_bytes / 4] fp32
    gemm = _best(lambda: torch.matmul(a, b), repeats)
    if onednn_problem() is None:
        gemm = min(gemm, _best(lambda: onednn_linear(a, b, None), repeats))
    read = _best(lambda: big.sum(), repeats)
    return Hardware(2 * matmul_size**3 / gemm / 1e9, read_bytes / read / 1e9)


def _best(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class W1Shape(NamedTuple):
    """The dimensions a FLOP or byte count needs (read from a transformers Llama config)."""

    num_layers: int
    hidden: int
    q_width: int
    """``num_heads * head_dim``."""
    kv_width: int
    """``num_kv_heads * head_dim``."""
    intermediate: int
    vocab: int
    bytes_per_value: float
    """Bytes of one K/V value as the KV cache stores it."""
    bytes_per_weight: float
    """Bytes of one layer weight as a decode step reads it (``of``: 2 for bf16 copies, 20 / 32
    for Q4_1 blocks)."""
    head_bytes_per_weight: float | None = None
    """Bytes of one weight of the logits matrix; None: ``bytes_per_weight``."""

    @classmethod
    def of(cls, model: Any, *, weights: str = "float32", kv_dtype: str = "auto") -> W1Shape:
        """The shape of ``model`` with the bytes a decode step reads for the engine's
        ``weights`` and ``kv_dtype`` options (``EngineConfig``): ``bfloat16`` 2 bytes a weight
        (its packed copies), ``q8_0`` / ``q4_1`` their GGUF blocks' bytes (34 / 32 and 20 / 32,
        the logits matrix in ``QUANT_HEAD_FORMAT``), ``float32`` and ``float32-packed`` the
        model's element size; a ``float16`` (or ``bfloat16``: ``Engine.kv_dtype`` of a bf16
        model) KV cache 2 bytes a value, ``float32`` 4, ``auto`` the element size.
        NOTE: counts the vectorized kernels' reads (scalar kernels keep no blocks).

        Raises:
            ValueError: an unknown ``weights`` or ``kv_dtype``.
        """
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        size = next(model.parameters()).element_size()
        q_width, kv_width = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
        layer_bytes, head_bytes = _weight_bytes(weights, size)
        kv_sizes = {"auto": size, "float32": 4, "float16": 2, "bfloat16": 2}
        kv_bytes = kv_sizes.get(kv_dtype)
        if kv_bytes is None:
            raise ValueError(f"unknown kv_dtype {kv_dtype!r}; valid: {', '.join(kv_sizes)}")
        return cls(c.num_hidden_layers, c.hidden_size, q_width, kv_width, c.intermediate_size,
                   c.vocab_size, kv_bytes, layer_bytes, head_bytes)  # fmt: skip

    @property
    def layer_weights(self) -> int:
        """Weights of one decoder layer's projections (norms left out: they are tiny)."""
        attn = self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden
        return attn + 3 * self.hidden * self.intermediate

    def prefill_flops(self, cached: int, new: int) -> float:
        """FLOPs of ``new`` tokens after ``cached`` ones: projections, causal attention (QK^T
        and AV over the keys each query sees) and the one logits row."""
        seen = new * cached + new * (new + 1) / 2  # (query, key) pairs attended
        per_layer = 2 * self.layer_weights * new + 4 * self.q_width * seen
        return self.num_layers * per_layer + 2 * self.hidden * self.vocab

    def decode_flops(self, context: int) -> float:
        """FLOPs of one row of a decode step over ``context`` keys: every weight once (the
        logits matrix included) and attention over the keys."""
        weights = self.num_layers * self.layer_weights + self.hidden * self.vocab
        return 2.0 * weights + 4.0 * self.q_width * context * self.num_layers

    def decode_bytes(self, context: int) -> float:
        """Bytes one decode step reads: every weight once (the tied embedding as the logits
        matrix) and the K/V of ``context`` positions."""
        head = self.head_bytes_per_weight
        head = self.bytes_per_weight if head is None else head
        weights = (self.num_layers * self.layer_weights * self.bytes_per_weight
                   + self.hidden * self.vocab * head)  # fmt: skip
        kv = self.num_layers * 2 * self.kv_width * context
        return float(weights + kv * self.bytes_per_value)


def _weight_bytes(weights: str, element_size: int) -> tuple[float, float]:
    """Bytes per weight a decode step reads for the layers and for the logits matrix."""
    if weights in ("float32", "float32-packed"):
        return float(element_size), float(element_size)
    if weights == "bfloat16":
        return 2.0, 2.0
    if weights in QUANT_FORMATS:
        head = QUANT_HEAD_FORMAT[weights]
        return QUANT_BLOCK_BYTES[weights] / QUANT_BLOCK, QUANT_BLOCK_BYTES[head] / QUANT_BLOCK
    raise ValueError(f"unknown weights {weights!r}; valid: {', '.join(get_args(WeightsDtype))}")


def batching_floor_ratio(
    shape: W1Shape, hw: Hardware, *, clients: int, prompt: int, cached: int, completion: int
) -> float:
    """Throughput of ``clients`` requests served together over the same requests one by one,
    with both paths at this machine's floors: what batching can gain on this turn shape.

    Each request has ``prompt`` tokens of which ``cached`` hit the prefix cache and generates
    ``completion`` tokens (the first from its prefill). A prefill costs its FLOPs at the peak
    GEMM rate in both paths (batching a compute-bound prefill saves nothing at the floor). A
    decode step of ``r`` rows at context ``c`` costs the larger of ``r`` rows' FLOPs at the peak
    rate and its bytes at the read bandwidth: the weights and the cached prefix's K/V once (the
    rows share it), each row's other K/V once per row. One by one, ``r = 1``.

    NOTE: two assumptions of ``bench load``'s workload: the ``cached`` tokens are one prefix
    every client shares (its system prompt), and all ``clients`` rows decode in one step (an
    engine whose batch KV budget holds fewer rows runs several smaller steps).

    Returns:
        The ratio (> 0): the ``throughput concurrent/sequential`` an engine at both floors
        would show. An engine nearer its floor on one path than on the other lands off it.

    Raises:
        ValueError: ``clients`` or ``prompt`` below 1, ``cached`` outside ``[0, prompt)``,
            ``completion`` below 1.
    """
    if clients < 1 or prompt < 1 or not 0 <= cached < prompt or completion < 1:
        raise ValueError(
            f"need clients >= 1, 0 <= cached < prompt, completion >= 1; got {clients=}, "
            f"{prompt=}, {cached=}, {completion=}"
        )
    prefill = shape.prefill_flops(cached, prompt - cached) / (hw.gemm_gflops * 1e9)
    alone, together = prefill, clients * prefill
    for step in range(1, completion):
        context = prompt + step
        flops = shape.decode_flops(context) / (hw.gemm_gflops * 1e9)
        row_kv = shape.decode_bytes(context) - shape.decode_bytes(cached)
        alone += max(flops, shape.decode_bytes(context) / (hw.read_gb_s * 1e9))
        step_bytes = shape.decode_bytes(cached) + clients * row_kv
        together += max(clients * flops, step_bytes / (hw.read_gb_s * 1e9))
    return clients * alone / together
