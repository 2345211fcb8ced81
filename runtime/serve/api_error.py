"""OpenAI-style API errors: ``ApiError`` (an HTTP status and the four-key error body) and the
400 a pydantic validation error becomes, naming the offending field as OpenAI writes its path.

It knows the error body's shape and pydantic's error records, not the request models (their
field names are passed in), HTTP routing or the engine.
"""

from __future__ import annotations

import re
from collections.abc import Set
from typing import Any, Literal

from pydantic import ValidationError

__all__ = ["ApiError", "ErrorType", "error_body", "validation_error"]

_INSTANCE_OF = re.compile(r"a valid dictionary or instance of \w+")
ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "server_error",
]


class ApiError(Exception):
    """An error to answer with an OpenAI-style body ``{"error": {...}}`` and an HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers
        """Response headers the error brings (``Retry-After`` of a 429), else None."""

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Build the OpenAI error object (same four keys on every error)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(exc: ValidationError, field_names: Set[str]) -> ApiError:
    """Turn a pydantic error into a 400 naming the offending field, OpenAI style.

    ``param`` is the field's path as OpenAI writes it (``messages[0].content``): pydantic's
    union-member tags (``str``, ``list[int]``, model names) are dropped, list indices bracketed.
    Of several errors (one per union member) the deepest path wins, as it names the member that
    matched furthest; the messages of every error at that path are joined. ``field_names``:
    the request models' field names (any other part of an error's location is a union tag).
    """
    errors = [
        (
            _param_path(e["loc"], field_names, is_extra=e["type"] == "extra_forbidden"),
            _UNKNOWN_FIELD if e["type"] == "extra_forbidden" else _clean_message(e["msg"]),
        )
        for e in exc.errors()
    ]
    param = max((path for path, _ in errors), key=_depth)
    hints = list(dict.fromkeys(msg for path, msg in errors if path == param))
    message = "; or ".join(hints[:3])
    code = "unknown_parameter" if hints == [_UNKNOWN_FIELD] else "invalid_value"
    return ApiError(400, f"{param}: {message}" if param else message, param=param, code=code)


_UNKNOWN_FIELD = "unrecognized request argument: this server does not honour it, so omit it"


def _param_path(
    loc: tuple[int | str, ...], field_names: Set[str], *, is_extra: bool = False
) -> str | None:
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in field_names or (is_extra and i == len(loc) - 1):
            path += f".{part}" if path else part
    return path or None


def _depth(path: str | None) -> int:
    return 0 if path is None else path.count(".") + path.count("[") + 1


def _clean_message(message: str) -> str:
    # NOTE: pydantic names our model classes ("instance of FunctionName") and prefixes our own
    # ValueErrors with "Value error, "; neither means anything to an API client.
    message = _INSTANCE_OF.sub("an object", message)
    return message.removeprefix("Value error, ")
