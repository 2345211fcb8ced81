"""The compact forward's weight layout: which models it runs (``compact_blocker``), fused
input-major projections whose HF modules become views (``fuse``), the LM head, GGUF blocks.

It knows modules and weight tensors, never positions, KV or attention.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from runtime.model.kernels import (
    quant_format_of,
    quantize_weight,
    repack_q4_1,
)

__all__ = [
    "KERNEL_LAYOUT_ISAS",
    "fused_layer",
    "quantized_copies",
    "to_meta",
    "FAMILY",
    "FUSED_PARTS",
    "Layer",
    "compact_blocker",
    "fuse",
    "given",
    "input_major_head",
    "quantize",
]


FAMILY = frozenset({"llama", "qwen2", "mistral"})


def compact_blocker(model: Any) -> str | None:
    """Why ``CompactLlama`` cannot run ``model`` (so it stays on transformers), or None."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILY:
        return f"model type {kind!r} is not in the compact family {sorted(FAMILY)}"
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        return f"activation {act!r} (the compact MLP is SiLU-gated)"
    window = getattr(config, "sliding_window", None)
    if window is not None and (kind == "mistral" or getattr(config, "use_sliding_window", False)):
        return f"sliding_window={window} (the compact path has no window mask)"
    if getattr(config, "mlp_bias", False):
        return "MLP projections with bias"
    inner = getattr(model, "model", None)
    if not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
        return "no model.rotary_emb / model.layers (not the transformers Llama layout)"
    return None


class Layer(NamedTuple):
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def fuse(modules: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the projections' weights (and biases) and rebind each module to a view.

    The weight is stored input-major: ``[sum(out), in]`` is a transposed view of one contiguous
    ``[in, sum(out)]`` tensor, so ``F.linear`` runs MKL's plain (NN) product. NOTE: measured on
    W1's layer weights (2 threads, this CPU, same run): 4 to 16 rows (a batched decode step)
    took 20-27% less time than with the usual ``[out, in]`` storage, 512 rows (a prefill
    chunk) 17% less, one row about the same (21.6 vs 23.2 ms per 30 layers).
    """
    weight = torch.cat([m.weight.detach().t() for m in modules], dim=1).t()  # [sum(out), in]
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        parts = [b.detach() if b is not None else torch.zeros_like(m.weight[:, 0])
                 for m, b in zip(modules, biases, strict=True)]  # fmt: skip
        bias = torch.cat(parts)
    start = 0
    for m in modules:  # NOTE: the HF modules now read the fused storage: one copy of each weight.
        end = start + m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if m.bias is not None and bias is not None:
            m.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


def input_major_head(model: Any) -> torch.Tensor:
    """Store the LM head input-major (as ``fuse`` does) and rebind it, and a tied input
    embedding, to the ``[vocab, hidden]`` view; returns the view (detached).

    NOTE: the LM head is the largest single product of a decode step (W1: 49,152 x 576); 8 rows
    took 13.8 ms against 26.1 ms with ``[vocab, hidden]`` storage, one row 5.6 vs 6.6 ms (same
    run, 2 threads). An embedding lookup reads a few strided rows of the view, which is cheap.
    """
    head, embed = model.lm_head, model.model.embed_tokens
    is_tied = head.weight is embed.weight
    view: torch.Tensor = head.weight.detach().t().contiguous().t()  # [vocab, hidden], input-major
    param = torch.nn.Parameter(view, requires_grad=head.weight.requires_grad)
    head.weight = param
    if is_tied:
        embed.weight = param
    return view


FUSED_PARTS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",),
)  # fmt: skip
"""The modules whose rows make up each fused weight of a layer: qkv, o, gate_up, down."""


def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    out: torch.Tensor = quantize_weight(weight, fmt)
    return out


def given(
    blocks: Mapping[str, torch.Tensor],
    names: tuple[str, ...],
    weight: torch.Tensor,
    fmt: str,
    *,
    fused: bool = False,
) -> torch.Tensor:
    """``weight`` in ``fmt``'s GGUF blocks: ``blocks[name]`` for each name (``fused``: all of
    them, rows concatenated; else the first present) where given in ``fmt``, else quantized.

    Raises:
        ValueError: the given blocks do not match ``weight``'s shape.
    """
    found = [blocks[n] for n in names if n in blocks]
    if not fused:
        found = found[:1]
    if not found or (fused and len(found) != len(names)):
        return quantize(weight, fmt)
    if any(quant_format_of(b) != fmt for b in found):
        return quantize(weight, fmt)
    out = torch.cat(found) if len(found) > 1 else found[0].contiguous()
    n, k = weight.shape
    if out.dtype != torch.uint8 or out.shape[:2] != (n, k // 32):
        raise ValueError(f"GGUF blocks of {names[0]!r} are {tuple(out.shape)}, the weight "
                         f"[{n}, {k}] needs [{n}, {k // 32}, bytes]")  # fmt: skip
    return out


def fused_layer(layer: Any) -> Layer:
    """One decoder layer's weights in the compact layout (its HF modules rebound to views)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, _ = fuse([mlp.gate_proj, mlp.up_proj])
    o, o_bias = fuse([attn.o_proj])
    down, _ = fuse([mlp.down_proj])
    return Layer(
        layer.input_layernorm.weight.detach(), qkv, qkv_bias, o, o_bias,
        layer.post_attention_layernorm.weight.detach(), gate_up, down,
    )  # fmt: skip


KERNEL_LAYOUT_ISAS = ("avx512",)
"""The kernel ISAs whose Q4_1 copies take the kernel layout (``repack_q4_1``): only where it
measured faster. SmolLM2's 30 layers of products at one row, 2 threads, alternating rounds:
AVX-512 1.03 / 1.07 / 1.15x (1 thread 1.16 / 1.18 / 1.18x), AVX2 0.92 / 0.95 / 0.97x
(``q4_1_lanes.cpp``); NEON unmeasured."""


def quantized_copies(
    layers: Sequence[Layer],
    fmt: str,
    blocks: Mapping[str, torch.Tensor],
    *,
    kernel_layout: bool = False,
) -> list[torch.Tensor]:
    """Per layer the GGUF blocks of qkv, o, gate_up and down in ``fmt``: the given ones
    (fused weights concatenate their parts' rows) where every part is given in ``fmt``, else
    ``quantize_weight`` of the fp32 weight; with ``kernel_layout`` Q4_1 in the kernel layout
    (``repack_q4_1``: the same bytes, which one-row products read without byte shuffles)."""
    copies = []
    for i, layer in enumerate(layers):
        fused = (layer.qkv, layer.o, layer.gate_up, layer.down)
        for parts, weight in zip(FUSED_PARTS, fused, strict=True):
            names = tuple(f"model.layers.{i}.{part}" for part in parts)
            copy = given(blocks, names, weight, fmt, fused=True)
            copies.append(repack_q4_1(copy) if kernel_layout and fmt == "q4_1" else copy)
    return copies


def to_meta(model: Any, layers: list[Layer]) -> tuple[list[Layer], torch.Tensor, bool]:
    """Free the fp32 projection and LM-head weights: ``meta`` tensors (shapes and strides kept,
    no storage) in ``model``'s modules and in ``layers``' fused ones.

    Returns:
        The layers on meta weights, the meta LM head, and whether the embedding is tied to it.
    """

    def meta(module: Any) -> torch.Tensor:
        weight = torch.empty_like(module.weight.detach(), device="meta")
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        return weight

    out = list(layers)
    for i, hf in enumerate(model.model.layers):
        for path in itertools.chain(*FUSED_PARTS):
            meta(hf.get_submodule(path))
        fused = {name: torch.empty_like(getattr(out[i], name), device="meta")
                 for name in ("qkv", "o", "gate_up", "down")}  # fmt: skip
        out[i] = out[i]._replace(**fused)
    head, embed = model.lm_head, model.model.embed_tokens
    tied = head.weight is embed.weight
    return out, meta(head), tied
