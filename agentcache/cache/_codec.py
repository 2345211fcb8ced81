"""Result serialization for the result caches: bytes that decode to a value equal to the original.

Three formats, tried in order; the first byte says which:

- ``J`` plain JSON (``json.dumps``, insertion order kept) when the value is built only from exact
  ``dict`` (str keys), ``list``, ``str``, ``int``, ``float``, ``bool`` and ``None``;
- ``T`` tagged JSON that also spells tuples, dataclasses and pydantic models (restored as the same
  class, looked up by import path), checked at encode time by decoding and comparing for equality;
- ``P`` pickle, only when the cache allows it (``allow_pickle=True``), also checked for equality.

Anything else is uncacheable. Knows nothing about keys, stores or tools.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pickle
from typing import Any

from pydantic import BaseModel

__all__ = ["CodecError", "decode", "encode"]

_SCALARS = (str, int, float, bool, type(None))


class CodecError(Exception):
    """A value cannot be encoded exactly, or stored bytes cannot be decoded."""


def encode(value: Any, *, allow_pickle: bool) -> bytes:
    """Serialize ``value`` so that ``decode`` returns an equal value of the same types.

    Raises:
        CodecError: no allowed format reproduces ``value`` exactly; the message says why.
    """
    try:
        if _is_plain(value):
            return b"J" + json.dumps(value, ensure_ascii=True).encode("ascii")
        data = b"T" + json.dumps(_tag(value), ensure_ascii=True).encode("ascii")
        _check_round_trip(value, data, allow_pickle=False)
        return data
    except (CodecError, RecursionError, TypeError, ValueError) as exc:
        if not allow_pickle:
            raise CodecError(f"{exc}; pass allow_pickle=True to cache such results") from exc
    try:
        data = b"P" + pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # NOTE: pickling runs arbitrary __reduce__ code; any failure = skip
        raise CodecError(f"not picklable: {exc}") from exc
    _check_round_trip(value, data, allow_pickle=True)
    return data


def decode(data: bytes, *, allow_pickle: bool) -> Any:
    """Inverse of ``encode``.

    Raises:
        CodecError: unknown format, pickle data while pickle is not allowed, or damaged data.
    """
    kind, body = data[:1], data[1:]
    try:
        if kind == b"J":
            return json.loads(body)
        if kind == b"T":
            return _untag(json.loads(body))
        if kind == b"P" and allow_pickle:
            return pickle.loads(body)
    except Exception as exc:  # NOTE: damaged bytes or a moved class; the caller drops the entry
        raise CodecError(f"cannot decode cached value: {exc}") from exc
    raise CodecError(f"cached value has format {kind!r}, not allowed here")


def _check_round_trip(value: Any, data: bytes, *, allow_pickle: bool) -> None:
    restored = decode(data, allow_pickle=allow_pickle)
    if type(restored) is not type(value) or restored != value:
        raise CodecError(f"a {type(value).__name__} does not survive serialization unchanged")


def _is_plain(value: Any) -> bool:
    kind = type(value)
    if kind is dict:
        return all(type(k) is str and _is_plain(v) for k, v in value.items())
    if kind is list:
        return all(_is_plain(item) for item in value)
    return kind in _SCALARS


def _tag(value: Any) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        return [_tag(item) for item in value]
    if kind is dict:
        if not all(type(k) is str for k in value):
            raise CodecError("dict keys must be str")
        out = {k: _tag(v) for k, v in value.items()}
        return {"$": "dict", "v": out} if "$" in value else out
    if kind is tuple:
        return {"$": "tuple", "v": [_tag(item) for item in value]}
    if isinstance(value, BaseModel):
        return {"$": "model", "cls": _class_path(kind), "v": value.model_dump(mode="json")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _tag(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"$": "dataclass", "cls": _class_path(kind), "v": fields}
    raise CodecError(f"values of type {kind.__module__}.{kind.__qualname__} have no JSON form")


def _untag(value: Any) -> Any:
    if type(value) is list:
        return [_untag(item) for item in value]
    if type(value) is not dict:
        return value
    tag = value.get("$")
    if tag is None:
        return {k: _untag(v) for k, v in value.items()}
    if tag == "dict":
        return {k: _untag(v) for k, v in value["v"].items()}
    if tag == "tuple":
        return tuple(_untag(item) for item in value["v"])
    cls = _resolve(value["cls"])
    if tag == "model" and issubclass(cls, BaseModel):
        return cls.model_validate(value["v"])
    if tag == "dataclass" and dataclasses.is_dataclass(cls):
        return cls(**{k: _untag(v) for k, v in value["v"].items()})
    raise CodecError(f"unknown tag {tag!r} for {value['cls']!r}")


def _class_path(cls: type) -> str:
    path = f"{cls.__module__}:{cls.__qualname__}"
    try:
        found = _resolve(path)
    except Exception as exc:  # NOTE: local classes, __main__ oddities: not importable by name
        raise CodecError(f"class {path} cannot be imported by name") from exc
    if found is not cls:
        raise CodecError(f"class {path} does not resolve to itself by name")
    return path


def _resolve(path: str) -> type:
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise CodecError(f"{path} is not a class")
    return obj
