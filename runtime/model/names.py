"""Model names the runtime accepts, checked in microseconds: no torch, transformers or network.

A name is a bundled or named short name (``runtime.models``), an existing folder or ``.gguf``
file, or a hub id ``owner/name``; anything else is refused at once with the short names listed,
so a typo never costs a torch import and a failed hub lookup. Whether the named model then loads is
``model_runner``'s business.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from runtime.exceptions import ModelLoadError
from runtime.models import BUNDLED_MODELS, NAMED_MODELS

__all__ = ["HUB_ID", "check_model_name", "is_local_path", "no_such_folder"]

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
"""A Hugging Face hub id with its owner, ``owner/name`` (letters, digits, ``_.-``)."""
_SHORT_NAMES = (*BUNDLED_MODELS, *NAMED_MODELS)
_NAMES_LINE = (
    f"bundled models: {', '.join(BUNDLED_MODELS)}; named models (pulled on first use): "
    f"{', '.join(NAMED_MODELS)}"
)
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
        ModelLoadError: ``model`` is neither in ``BUNDLED_MODELS`` or ``NAMED_MODELS``, an
            existing folder or ``.gguf`` file, nor a hub id ``owner/name`` (bare hub names such
            as ``gpt2`` need their owner, ``openai-community/gpt2``). The one-line message
            lists the short names and the
            closest one (``difflib``); a path (see ``is_local_path``) is named as a missing
            folder.
    """
    if model in _SHORT_NAMES or Path(model).expanduser().is_dir():
        return
    if model.endswith(".gguf") and Path(model).expanduser().is_file():
        return
    if is_local_path(model) or model.endswith(".gguf"):
        raise ModelLoadError(no_such_folder(model))
    if HUB_ID.match(model):
        return
    close = difflib.get_close_matches(model, _SHORT_NAMES, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ModelLoadError(
        f"unknown model {model!r}: {hint}{_NAMES_LINE}; "
        "or give a local folder, a .gguf file or a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def no_such_folder(model: str) -> str:
    """The one-line message for a model path that is not a folder (lists the short names)."""
    what = "file" if model.endswith(".gguf") else "directory"
    return (
        f"no such model {what} {model!r} (looked at "
        f"{os.path.abspath(os.path.expanduser(model))!r}); give an existing folder or .gguf "
        f"file, a hub id like 'Qwen/Qwen2.5-0.5B-Instruct', or a bundled name: "
        f"{', '.join(BUNDLED_MODELS)} (named, pulled on first use: {', '.join(NAMED_MODELS)})"
    )
