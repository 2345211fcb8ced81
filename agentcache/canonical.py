"""Canonical JSON and stable hashes: the same logical value always gives the same bytes.

Used by the prompt builder (tool schemas, JSON in prompts) and the result caches (tool arguments,
cache keys). Rules, decided once here and nowhere else:

- objects: keys sorted by code point; separators ``,`` and ``:``; non-ASCII kept as UTF-8, in NFC;
- numbers: ``bool`` stays ``true``/``false``; integral floats with ``|x| < 2**53`` render as
  integers (``1.0`` -> ``1``, ``-0.0`` -> ``0``); other floats use Python's shortest round-trip
  repr; NaN and infinities are rejected (JSON cannot spell them); ``Decimal`` keeps its exact value;
- tuples render as lists; sets and frozensets as lists sorted by their elements' canonical JSON;
- ``datetime``/``date``/``time`` as ISO 8601 strings, ``UUID`` and paths as strings, ``Enum`` as
  its value; pydantic models via ``model_dump(mode="json")``, dataclasses field by field.

Anything else, text with a lone UTF-16 surrogate (no UTF-8 form), and values nested deeper
than ``MAX_DEPTH`` raise ``CanonicalizationError`` naming the JSON path of the offending value.
This module knows nothing about prompts or caches.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
import json
import math
import unicodedata
import uuid
from collections.abc import Mapping
from decimal import Decimal
from pathlib import PurePath
from typing import Any, TypeAlias

from agentcache.exceptions import CanonicalizationError

__all__ = [
    "MAX_DEPTH",
    "JSONValue",
    "canonical_bytes",
    "canonical_json",
    "normalize_text",
    "stable_hash",
    "to_canonical",
]

JSONValue: TypeAlias = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]

_MAX_EXACT_INT_FLOAT = 2**53  # NOTE: above this, float -> int conversion would invent digits.

MAX_DEPTH = 256
"""Most objects and lists ``to_canonical`` accepts one inside another (sets count as lists).

A fixed limit, so whether a value is accepted never depends on the caller's stack: past about
450 levels the recursion (two frames per level) met Python's default recursion limit of 1000
and raised a bare ``RecursionError``. 256 is twice serde_json's default recursion limit (128)
and far above real tool schemas and arguments, while leaving room below that limit for callers
and for ``json.dumps``, which recurses once per level as well."""


def normalize_text(text: str) -> str:
    """Return ``text`` in NFC, with ``\\r\\n``/``\\r`` as ``\\n`` and no trailing whitespace.

    Trailing spaces and tabs are removed from every line and trailing newlines from the end, so two
    renders that differ only in invisible whitespace produce the same bytes and tokens.

    Raises:
        CanonicalizationError: ``text`` holds a lone UTF-16 surrogate (not Unicode text).
    """
    _check_unicode(text, "text")
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip(" \t") for line in text.split("\n")).rstrip("\n")


def to_canonical(value: Any, path: str = "$") -> JSONValue:
    """Convert ``value`` to plain JSON data under the module's canonical rules.

    Args:
        value: Any supported Python value (see the module docstring).
        path: JSON path of ``value``, used in error messages.

    Returns:
        ``None``, ``bool``, ``int``, ``float``, NFC ``str``, ``list`` or ``dict`` with ``str`` keys.

    Raises:
        CanonicalizationError: ``value`` (or something inside it) has no canonical JSON form, or
            it is nested deeper than ``MAX_DEPTH``; the message names its path and type.
    """
    return _convert(value, path, 0)


def _convert(value: Any, path: str, depth: int) -> JSONValue:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, enum.Enum):
        return _convert(value.value, path, depth)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _canonical_float(value, path)
    if isinstance(value, str):
        _check_unicode(value, path)
        return unicodedata.normalize("NFC", value)
    if isinstance(value, Decimal):
        return _canonical_decimal(value, path)
    if isinstance(value, Mapping):
        return _canonical_mapping(value, path, depth)
    if isinstance(value, list | tuple):
        _check_depth(depth, path)
        return [_convert(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, set | frozenset):
        _check_depth(depth, path)
        items = [_convert(item, f"{path}[*]", depth + 1) for item in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
    return _canonical_object(value, path, depth)


def _check_depth(depth: int, path: str) -> None:
    """Refuse a container with ``depth`` (0 at the top) containers around it at ``MAX_DEPTH``."""
    if depth >= MAX_DEPTH:
        raise CanonicalizationError(
            f"{path}: nested more than {MAX_DEPTH} levels deep; flatten the value "
            "(deeper nesting has no place in a prompt or a cache key)"
        )


def _check_unicode(text: str, path: str) -> None:
    """Refuse a lone surrogate (``"\\ud800"``): it has no UTF-8 form, so hashing or sending the
    text later failed with a bare ``UnicodeEncodeError``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CanonicalizationError(
            f"{path}: lone UTF-16 surrogate {exc.object[exc.start]!r} at character {exc.start} "
            "is not Unicode text; pass the full pair or drop it"
        ) from exc


def _canonical_float(value: float, path: str) -> JSONValue:
    if not math.isfinite(value):
        raise CanonicalizationError(f"{path}: {value!r} has no JSON form (NaN/Infinity)")
    if value.is_integer() and abs(value) < _MAX_EXACT_INT_FLOAT:
        return int(value)
    return value


def _canonical_decimal(value: Decimal, path: str) -> JSONValue:
    if not value.is_finite():
        raise CanonicalizationError(f"{path}: Decimal {value!r} has no JSON form")
    if value == value.to_integral_value():
        return int(value)
    # NOTE: float(str) would round; keep the exact digits as a JSON number via a float only when the
    # round trip is exact, else render the decimal as a string so no information is lost.
    as_float = float(value)
    return as_float if Decimal(repr(as_float)) == value else format(value.normalize(), "f")


def _canonical_mapping(value: Mapping[Any, Any], path: str, depth: int) -> dict[str, JSONValue]:
    _check_depth(depth, path)
    out: dict[str, JSONValue] = {}
    for key, item in value.items():
        if isinstance(key, enum.Enum):
            key = key.value
        if isinstance(key, bool) or not isinstance(key, str | int):
            raise CanonicalizationError(
                f"{path}: object key {key!r} of type {type(key).__name__} is not a string"
            )
        _check_unicode(str(key), path)
        name = unicodedata.normalize("NFC", str(key))
        if name in out:
            raise CanonicalizationError(f"{path}: keys collide after normalization: {name!r}")
        out[name] = _convert(item, f"{path}.{name}", depth + 1)
    return out


def _canonical_object(value: Any, path: str, depth: int) -> JSONValue:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID | PurePath):
        return str(value)
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):  # pydantic v2 model
        return _convert(model_dump(mode="json"), path, depth)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return _canonical_mapping(fields, path, depth)
    raise CanonicalizationError(
        f"{path}: values of type {type(value).__module__}.{type(value).__qualname__} have no "
        "canonical JSON form; pass a JSON-compatible value, a pydantic model or a dataclass"
    )


def canonical_json(value: Any) -> str:
    """Render ``value`` as canonical JSON text (see module docstring).

    Raises:
        CanonicalizationError: as ``to_canonical``.
    """
    return json.dumps(
        to_canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def canonical_bytes(value: Any) -> bytes:
    """UTF-8 bytes of ``canonical_json(value)``."""
    return canonical_json(value).encode("utf-8")


def stable_hash(*parts: str | bytes) -> str:
    """SHA-256 hex digest over ``parts``, each length-prefixed so part boundaries cannot shift.

    Reproducible across processes and Python versions (never Python's ``hash()``). Used for cache
    keys and chained segment fingerprints: pass the namespace and the parent hash as leading parts.
    """
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()
