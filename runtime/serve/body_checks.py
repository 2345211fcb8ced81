"""Checks of a parsed JSON body before any model validation: nesting depth and lone surrogates.

Each refuses with an ``ApiError`` 400 naming where; no FastAPI, no engine.
"""

from __future__ import annotations

import re
from typing import Any

from runtime.serve.api_error import ApiError

__all__ = [
    "MAX_JSON_DEPTH",
    "SURROGATE_ESCAPE",
    "json_depth",
    "refuse_lone_surrogates",
    "too_deep",
]

MAX_JSON_DEPTH = 100
"""Deepest nesting of arrays/objects accepted in a body (deeper: 400, before any validation)."""


def too_deep() -> ApiError:
    """The 400 of a body nested deeper than ``MAX_JSON_DEPTH``."""
    return ApiError(
        400,
        f"request body is nested deeper than {MAX_JSON_DEPTH} levels of arrays/objects",
        code="invalid_json",
    )


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
"""A JSON ``\\uD800``-``\\uDFFF`` escape: the only way a lone surrogate gets into a body (a
UTF-8 byte sequence cannot encode one), so bodies without it skip the walk below."""


def refuse_lone_surrogates(body: Any) -> None:
    """400 naming a string (key or value) that holds a lone UTF-16 surrogate.

    NOTE: ``json.loads`` keeps an unpaired ``\\ud800`` escape as a lone surrogate, which is not
    Unicode text: the tokenizer then fails (a 500 on ``/v1/completions`` and ``/tokenize``, a
    ``TextEncodeInput`` message on chat). A valid pair (an emoji) is joined and passes.

    Raises:
        ApiError: 400 with ``param`` the string's path (``messages[0].content``).
    """
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str) and not _is_unicode(item):
            raise ApiError(
                400,
                f"{path}: text has a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                "which is not valid Unicode; send the pair or drop it",
                param=path,
                code="invalid_value",
            )
        if isinstance(item, dict):
            for key, value in item.items():
                stack.append((f"{path}.{key}" if path else key, value))
                stack.append((path or "body", key))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", value) for i, value in enumerate(item))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, ``[]`` is 1), without recursion."""
    depth, level = 0, [value]
    while True:
        containers = [item for item in level if isinstance(item, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [
            child
            for item in containers
            for child in (item.values() if isinstance(item, dict) else item)
        ]
