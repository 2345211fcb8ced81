"""A GGUF file's own quantized blocks (Q8_0, Q4_1) by transformers module name, read raw.

For ``weights="q8_0"`` / ``"q4_1"`` on a model loaded from a ``.gguf`` file, the compact
forward keeps the file's blocks as they are instead of quantizing the dequantized weights again
(``CompactLlama``'s ``blocks``): the same bytes, no second rounding, no work at load. It reads
tensors and metadata only; it knows nothing of the model object or the kernels.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["gguf_blocks"]

_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""GGUF's layer tensor names (llama.cpp's ``LLM_TENSOR_*``) -> the transformers Llama modules."""
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_FORMATS = {"q8_0": "Q8_0", "q4_1": "Q4_1"}
_PERMUTED_ARCHS = frozenset({"llama"})
"""Architectures whose q/k rows llama.cpp's converter permutes for its RoPE (``permute`` in
``convert_hf_to_gguf.py``'s LlamaModel) and transformers' loader un-permutes."""


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens"
    if name == "output.weight":
        return "lm_head"
    match = _LAYER.fullmatch(name)
    if match is None or match.group(2) not in _NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_NAMES[match.group(2)]}"


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _unpermute(blocks: np.ndarray, heads: int) -> np.ndarray:
    """Undo the converter's q/k row permutation on a block array ``[N, K / 32, bytes]``, with
    transformers' own function (``LlamaTensorProcessor._reverse_permute_weights``, which
    reshapes rows as ``[heads, N / heads / 2, 2, ...]`` and swaps the middle axes): the
    permutation moves output rows, and a block holds 32 inputs of one row, so rows of blocks
    move exactly as rows of weights do."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={})  # type: ignore[no-untyped-call]
    out: np.ndarray = processor._reverse_permute_weights(blocks, heads, heads)
    return out


def gguf_blocks(path: str | Path, fmt: str) -> dict[str, torch.Tensor]:
    """The tensors of the GGUF file at ``path`` stored in ``fmt`` (``"q8_0"`` or ``"q4_1"``, and
    Q8_0 tensors for a ``q4_1`` model's head: ``QUANT_HEAD_FORMAT``) as uint8 block arrays
    ``[N, K / 32, bytes]`` (``quantize_weight``'s layout, which is the file's), keyed by the
    transformers module they load into (``model.layers.0.self_attn.q_proj``, ``lm_head``,
    ``model.embed_tokens``). For the ``llama`` architecture the q and k rows are un-permuted as
    transformers does on load, so each block array equals ``quantize_weight`` of the weight
    transformers loads from the file. Tensors in other formats (f32 norms, f16, other quants) are
    left out: the compact forward quantizes those weights itself.

    Raises:
        ValueError: ``fmt`` is not a quantized format.
        OSError: the file cannot be read (gguf's reader raises its own errors for a damaged one).
    """
    from gguf import GGMLQuantizationType, GGUFReader

    from runtime.model.kernels import QUANT_HEAD_FORMAT

    if fmt not in _FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; valid: {', '.join(_FORMATS)}")
    wanted = {GGMLQuantizationType[_FORMATS[fmt]], GGMLQuantizationType.Q8_0}
    # NOTE: copy-on-write mapping: the blocks stay file-backed pages (no copy; never written)
    reader = GGUFReader(str(path), "c")
    arch = _field(reader, "general.architecture")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or heads
    head_fmt = GGMLQuantizationType[_FORMATS[QUANT_HEAD_FORMAT[fmt]]]  # type: ignore[index]
    layer_fmt = GGMLQuantizationType[_FORMATS[fmt]]
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None or tensor.tensor_type not in wanted:
            continue
        is_head = name in ("lm_head", "model.embed_tokens")
        if tensor.tensor_type != (head_fmt if is_head else layer_fmt):
            continue
        k, n = (int(d) for d in tensor.shape[:2])  # NOTE: GGUF lists dims innermost first
        blocks = np.asarray(tensor.data).reshape(n, k // 32, -1)
        if arch in _PERMUTED_ARCHS and name.endswith((".q_proj", ".k_proj")) and heads:
            blocks = _unpermute(blocks, int(heads if name.endswith("q_proj") else kv_heads))
        out[name] = torch.from_numpy(np.ascontiguousarray(blocks))
    return out
