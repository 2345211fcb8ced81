"""A GGUF file as a standard Hugging Face folder: safetensors, config, tokenizer.

transformers reads the GGUF (the ``gguf`` package; quantized tensors are dequantized to float32)
but refuses ``save_pretrained`` on a model loaded that way, so the weights are written with
safetensors (a tied LM head kept once, under the input embedding's name as ``save_pretrained``
writes it, which llama.cpp's ``convert_hf_to_gguf.py`` needs) and the config without its
``quantization_config``. The tokenizer, chat template included, is saved as read. Knows nothing
of where the file came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["WEIGHTS_FILE", "gguf_to_folder", "load_gguf"]

WEIGHTS_FILE = "model.safetensors"


def load_gguf(gguf: Path, *, dtype: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` read from a GGUF file with transformers (float32 unless ``dtype``).

    Raises:
        ModelLoadError: the file cannot be read (not a GGUF, an architecture or tokenizer
            transformers does not convert, ``gguf``/``accelerate`` missing).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.exceptions import ModelLoadError, one_line

    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=dtype if dtype is not None else torch.float32
        )
    except ImportError as exc:
        raise ModelLoadError(
            f"cannot read {str(gguf)!r}: {one_line(exc)} (pip install 'agentcache[local]', "
            "which brings gguf and accelerate)"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - NOTE: the GGUF reader raises many types.
        raise ModelLoadError(f"cannot read GGUF file {str(gguf)!r}: {one_line(exc)}") from exc
    # NOTE: the weights are now plain float tensors; the config must not claim otherwise (a
    # saved quantization_config would make the next load look for the GGUF again).
    model.config.__dict__.pop("quantization_config", None)
    return model, tokenizer


def gguf_to_folder(gguf: Path, out: Path) -> list[str]:
    """Write ``gguf``'s weights, config, generation config and tokenizer into folder ``out``.

    Returns:
        The names of the files written (for the manifest's checksums).

    Raises:
        ModelLoadError: as ``load_gguf``.
        OSError: ``out`` cannot be written.
    """
    import safetensors.torch

    model, tokenizer = load_gguf(gguf)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state = _untied_state(model)
    safetensors.torch.save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    return sorted(p.name for p in out.iterdir() if p.is_file())


def _untied_state(model: Any) -> dict[str, Any]:
    """``model``'s state dict, contiguous, with each tied weight (transformers'
    ``all_tied_weights_keys``: e.g. ``lm_head.weight`` -> ``model.embed_tokens.weight``) left to
    its source name, as ``save_pretrained`` does."""
    state = model.state_dict()
    for tied, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if tied in state and source in state and state[tied].data_ptr() == state[source].data_ptr():
            del state[tied]
    return {name: tensor.contiguous() for name, tensor in state.items()}
