"""Model names the runtime accepts, checked in microseconds: no torch, transformers or network.

A name is a bundled short name (``runtime.models``), an existing folder, or a hub id
``owner/name``; anything else is refused at once with the bundled models listed, so a typo never
costs a torch import and a failed hub lookup. Whether the named model then loads is
``model_runner``'s business.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from runtime.exceptions import ModelLoadError
from runtime.models import BUNDLED_MODELS

__all__ = ["HUB_ID", "check_model_name", "is_local_path", "no_such_folder"]

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
"""A Hugging Face hub id with its owner, ``owner/name`` (letters, digits, ``_.-``)."""
_PATH_STARTS = ("/", "./", "../", "~", ".\\", "..\\")


def is_local_path(model: str) -> bool:
    """True when ``model`` names a filesystem path rather than a hub id.

    Paths start with ``/``, ``./``, ``../`` or ``~``, or contain a separator without being a
    valid ``namespace/name`` hub id (``a/b/c`` is a path, ``Qwen/Qwen2.5-0.5B`` a hub id).
    """
    if model.startswith(_PATH_STARTS) or model in {".", ".."}:
        return True
    has_sep = os.sep in model or (os.altsep is not None and os.altsep in model)
    return has_sep and not HUB_ID.match(model)


def check_model_name(model: str) -> None:
    """Refuse a model name that cannot be loaded, before anything slow starts.

    Args:
        model: What the user gave as ``--model``.

    Raises:
        ModelLoadError: ``model`` is neither in ``BUNDLED_MODELS``, an existing folder, nor a
            hub id ``owner/name`` (bare hub names such as ``gpt2`` need their owner,
            ``openai-community/gpt2``). The one-line message lists the bundled models and the
            closest one (``difflib``); a path (see ``is_local_path``) is named as a missing
            folder.
    """
    if model in BUNDLED_MODELS or HUB_ID.match(model) or Path(model).expanduser().is_dir():
        return
    if is_local_path(model):
        raise ModelLoadError(no_such_folder(model))
    close = difflib.get_close_matches(model, BUNDLED_MODELS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ModelLoadError(
        f"unknown model {model!r}: {hint}bundled models: {', '.join(BUNDLED_MODELS)}; "
        "or give a local folder or a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def no_such_folder(model: str) -> str:
    """The one-line message for a model path that is not a folder (lists the bundled models)."""
    return (
        f"no such model directory {model!r} (looked at "
        f"{os.path.abspath(os.path.expanduser(model))!r}); give an existing folder, a hub id "
        f"like 'Qwen/Qwen2.5-0.5B-Instruct', or a bundled name: {', '.join(BUNDLED_MODELS)}"
    )
