"""Loading a model: a folder, bundled or named model, ``.gguf`` file or hub id to a transformers
causal LM and its tokenizer; rounding its linear weights (bfloat16, GGUF blocks); the weights'
fingerprint that names its disk-tier files.

It knows files, modules and weight tensors; never KV, positions, requests or the cache.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime import env
from runtime.exceptions import ModelLoadError, one_line
from runtime.model.kernels import (
    QUANT_HEAD_FORMAT,
    dequantize_weight,
    quantize_weight,
)
from runtime.model.names import HUB_ID, is_local_path, no_such_folder

__all__ = [
    "load_model",
    "round_weights_bf16",
    "round_weights_quantized",
    "torch_dtype",
    "weights_fingerprint",
]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """Map ``"float32" | "float16" | "bfloat16"`` to a torch dtype (ValueError otherwise)."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(_DTYPES)}")
    return _DTYPES[name]


def round_weights_bf16(model: Any) -> None:
    """Round, in place, the weight of every ``torch.nn.Linear`` in ``model`` (the LM head and a
    tied input embedding included) to the nearest bfloat16 value (ties to even), kept as fp32.

    Every forward of the model then computes with the same rounded weights, so the compact
    forward's packed bf16 copies (``CompactLlama(packed=torch.bfloat16)``) and its fp32 products
    agree within float32 rounding, and the transformers forward stays their reference.
    Norm weights, biases and an untied embedding keep full precision (a few KB, or a lookup).

    Raises:
        ValueError: a linear weight that is not float32.
    """
    with torch.no_grad():
        for _, module in _float32_linears(model, "bfloat16"):
            module.weight.copy_(module.weight.to(torch.bfloat16))


def _float32_linears(model: Any, weights: str) -> Iterator[tuple[str, torch.nn.Linear]]:
    """``(name, module)`` of every ``torch.nn.Linear`` in ``model``, in module order.

    Raises:
        ValueError: a linear weight that is not float32 (names ``weights`` and the module).
    """
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if module.weight.dtype != torch.float32:
            raise ValueError(f"weights={weights!r} needs float32 weights; {name} is "
                             f"{module.weight.dtype}")  # fmt: skip
        yield name, module


def round_weights_quantized(model: Any, fmt: Literal["q8_0", "q4_1"]) -> None:
    """Round, in place, the weight of every ``torch.nn.Linear`` in ``model`` to the values of
    its GGUF ``fmt`` blocks (``dequantize_weight(quantize_weight(w, fmt))``), the LM head (and a
    tied input embedding) to ``QUANT_HEAD_FORMAT[fmt]``'s, kept as fp32.

    Every forward of the model (transformers', the compact one's fp32 products, the native
    kernels over the blocks) then computes with the same weights, so cached and uncached, kernel
    and torch paths are one model. Weights that already hold such values (a model dequantized
    from a GGUF file of that format) are unchanged: quantizing them again gives the same blocks.
    Norm weights, biases and an untied embedding keep full precision.

    Raises:
        ValueError: a linear weight that is not float32, or whose input size is not a multiple
            of 32 (names the module).
    """
    head = getattr(model, "lm_head", None)
    with torch.no_grad():
        for name, module in _float32_linears(model, fmt):
            weight = module.weight
            kind = QUANT_HEAD_FORMAT[fmt] if module is head else fmt
            try:
                weight.copy_(dequantize_weight(quantize_weight(weight, kind)))
            except ValueError as exc:
                raise ValueError(f"weights={fmt!r}: cannot quantize {name}: {exc}") from exc


def _bundled() -> tuple[Any, tuple[str, ...]]:
    """``(resolve_model, BUNDLED_MODELS)`` of ``runtime.models``, or ``(None, ())`` if absent."""
    try:
        models = importlib.import_module("runtime.models")
    except ImportError:
        return None, ()
    return getattr(models, "resolve_model", None), tuple(getattr(models, "BUNDLED_MODELS", ()))


def _resolve(model: str) -> str:
    """A bundled model name (``runtime.models.resolve_model``) or the path / hub id unchanged."""
    if Path(model).exists():
        return model
    resolve, _ = _bundled()
    if resolve is None:
        return model
    try:
        return str(resolve(model))
    except (KeyError, ValueError, LookupError, FileNotFoundError):
        return model


def load_model(model: str, *, dtype: str, device: str, revision: str | None) -> tuple[Any, Any]:
    """Load model + tokenizer from a local folder or ``.gguf`` file, bundled or named model
    (pulled on first use, see ``runtime.models``), or hub id.

    Raises:
        ModelLoadError: when either cannot be loaded, or (without touching the hub) when
            ``model`` is a filesystem path (see ``is_local_path``) that does not exist.
    """
    path = _resolve(model)
    if path == model and (is_local_path(model) or model.endswith(".gguf")):
        path = os.path.expanduser(model)
        if not Path(path).exists():
            raise ModelLoadError(no_such_folder(model))
    if Path(path).is_file() and path.endswith(".gguf"):
        from runtime.models.convert import load_gguf

        gguf_lm, gguf_tokenizer = load_gguf(Path(path), dtype=torch_dtype(dtype))
        return _placed(gguf_lm, device), gguf_tokenizer
    # NOTE: huggingface_hub reads HF_HUB_OFFLINE once, at import; asking per call honours a value
    # set after that (by a caller or a test) instead of waiting on the network's timeouts.
    local_only = env.hub_offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, revision=revision, local_files_only=local_only
        )
        lm: Any = AutoModelForCausalLM.from_pretrained(
            path, revision=revision, dtype=torch_dtype(dtype), local_files_only=local_only
        )
    except Exception as exc:  # noqa: BLE001 - NOTE: loaders raise their own types (safetensors'
        # SafetensorError for a damaged file, RuntimeError for mismatched shapes, ...)
        where = "" if path == model else f" (resolved to {path!r})"
        if path == model and HUB_ID.match(model) and env.hub_offline():
            raise ModelLoadError(
                f"cannot load hub id {model!r}: HF_HUB_OFFLINE is set and it is not in the "
                "Hugging Face cache; unset HF_HUB_OFFLINE where the hub is reachable, or give a "
                "local folder, a .gguf file or a named model (`agentcache models list`)"
            ) from exc
        raise ModelLoadError(f"cannot load model {model!r}{where}: {one_line(exc)}") from exc
    return _placed(lm, device), tokenizer


def _placed(lm: Any, device: str) -> Any:
    """``lm`` on ``device``, in eval mode."""
    lm.to(torch.device(device))
    lm.eval()
    return lm


_FINGERPRINT_SAMPLES = 4096


def weights_fingerprint(model: Any) -> str:
    """sha256 hex over every parameter and buffer: name, dtype, shape and sampled values.

    Up to 4096 evenly spaced values per tensor (all of them for small tensors) plus the config,
    so any other checkpoint, fine-tune or dtype gives another fingerprint without hashing
    gigabytes at start-up. Names KV blocks on disk (the disk tier never reuses another model's).
    """
    h = hashlib.sha256(b"agentcache-weights-v1\0")
    h.update(model.config.to_json_string(use_diff=False).encode())
    tensors = [*model.named_parameters(), *model.named_buffers()]
    with torch.no_grad():
        for name, tensor in sorted(tensors, key=lambda item: item[0]):
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
            sample = flat[::step][:_FINGERPRINT_SAMPLES].to("cpu").contiguous()
            h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
            h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
