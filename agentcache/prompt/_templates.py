"""Load and render the deterministic Jinja templates of the ``templates`` package.

Templates are read once through ``importlib.resources`` (so they work from a wheel) and compiled
with ``StrictUndefined``: a missing variable is a bug, not an empty string. This module knows the
template names, not what goes into them.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import jinja2

__all__ = ["render_template"]


@functools.cache
def _template(name: str) -> jinja2.Template:
    source = resources.files("templates").joinpath(name).read_text(encoding="utf-8")
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
