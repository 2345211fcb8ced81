"""Load and render the deterministic Jinja templates of the ``templates`` package.

Templates are read once through ``importlib.resources`` (so they work from a wheel) and compiled
with ``StrictUndefined``: a missing variable is a bug, not an empty string. This module knows the
template names, not what goes into them.
"""

from __future__ import annotations

import functools
import importlib
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

__all__ = ["render_template"]


def _read(name: str) -> str:
    try:
        return resources.files("templates").joinpath(name).read_text(encoding="utf-8")
    except NotADirectoryError:
        # NOTE: an editable install made before templates/ had an __init__.py maps it as a
        # namespace package with a non-directory path entry, which importlib.resources rejects.
        package = importlib.import_module("templates")
        folders = [Path(entry) for entry in package.__path__ if Path(entry).is_dir()]
        return (folders[0] / name).read_text(encoding="utf-8")


@functools.cache
def _template(name: str) -> jinja2.Template:
    source = _read(name)
    env = jinja2.Environment(
        autoescape=False,  # NOTE: prompts are plain text, not HTML.
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=False,
    )
    return env.from_string(source)


def render_template(name: str, **context: Any) -> str:
    """Render ``templates/<name>`` with ``context``; the same context always gives the same text.

    Raises:
        jinja2.UndefinedError: the template uses a variable missing from ``context``.
    """
    return _template(name).render(**context)
