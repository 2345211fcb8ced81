"""Models bundled with the runtime, and the mapping from short names to their folders.

Each bundled model is a standard Hugging Face folder (config, safetensors, tokenizer) shipped as
package data, so it loads through the same ``from_pretrained`` path as a downloaded model. This
module does not import torch or transformers and never touches the network.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUNDLED_MODELS", "resolve_model"]

_MODELS_DIR = Path(__file__).resolve().parent

BUNDLED_MODELS: tuple[str, ...] = ("tiny",)
"""Short names accepted by :func:`resolve_model`; ``"tiny"`` is a toy trained by the project."""


def resolve_model(name_or_path: str) -> str:
    """Map a bundled model's short name to its folder; pass anything else through unchanged.

    Args:
        name_or_path: A short name from :data:`BUNDLED_MODELS` (for example ``"tiny"``), a local
            folder, or a hub id such as ``"Qwen/Qwen2.5-0.5B-Instruct"``.

    Returns:
        The absolute folder of a bundled model, or ``name_or_path`` itself. A local folder
        that happens to share a bundled name wins only when given as a path (``"./tiny"``).

    Raises:
        FileNotFoundError: If a bundled model's files are missing from the installation.
    """
    if name_or_path not in BUNDLED_MODELS:
        return name_or_path
    folder = _MODELS_DIR / name_or_path
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"bundled model {name_or_path!r} is missing at {str(folder)!r}; reinstall agentcache "
            "or retrain it with `python scripts/train_tiny.py`"
        )
    return str(folder)
