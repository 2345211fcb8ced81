"""``agentcache serve``'s engine flags, derived from ``EngineConfig`` and ``SchedulerConfig``.

One flag per field (``--kv-cache-bytes`` for ``kv_cache_bytes``; a field's ``metadata["flag"]``
renames it), its help the field's docstring, its default the dataclass's: a new engine option is
one field. No torch and no FastAPI: ``agentcache serve --help`` reads only these records.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Any, Literal, get_args, get_origin

from runtime.config import EngineConfig, field_docs, validate
from runtime.scheduler.config import SchedulerConfig
from runtime.serve.argtypes import non_negative_float, non_negative_int, positive_int

__all__ = ["add_engine_flags", "engine_config", "flag_of"]

_NESTED = ("scheduler",)
"""EngineConfig fields that are records: their own fields become flags."""


def flag_of(name: str) -> str:
    """The serve flag of field ``name`` (``kv_disk_flush_s`` -> ``--kv-disk-flush-seconds``)."""
    for cls in (EngineConfig, SchedulerConfig):
        for f in dataclasses.fields(cls):
            if f.name == name:
                return str(f.metadata.get("flag", "--" + name.replace("_", "-")))
    return name


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag per ``EngineConfig`` field (and per ``SchedulerConfig`` limit) to ``parser``.

    Every flag's default is None (not given), so ``engine_config`` keeps the dataclass's.
    """
    engine = parser.add_argument_group("engine options (runtime.config.EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        if f.name not in _NESTED:
            _add(engine, EngineConfig, f)
    limits = parser.add_argument_group("scheduler limits (runtime.scheduler.SchedulerConfig)")
    for f in dataclasses.fields(SchedulerConfig):
        _add(limits, SchedulerConfig, f)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of the flags given in ``args`` (the dataclass's defaults elsewhere).

    Raises:
        ValueError: a value out of range or flags that do not go together, the flags named as
            typed (``--kv-disk-bytes needs --kv-disk-dir``).
    """
    given = _given(args, EngineConfig)
    limits = _given(args, SchedulerConfig)
    validate(given, spell=flag_of)
    try:
        scheduler = SchedulerConfig(**limits)
    except ValueError as exc:
        raise ValueError(f"scheduler limits: {exc}") from None
    return EngineConfig(**given, scheduler=scheduler)


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(cls) if f.name not in _NESTED]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _add(group: Any, cls: type, f: dataclasses.Field[Any]) -> None:
    hint = typing.get_type_hints(cls)[f.name]
    default = getattr(cls(), f.name)
    doc = field_docs(cls).get(f.name, "").replace("%", "%%")
    flag = flag_of(f.name)
    if hint is bool:
        help_text = f"{doc} (default: {'on' if default else 'off'})"
        group.add_argument(flag, dest=f.name, action="store_const", const=not default,
                           default=None, help=help_text)  # fmt: skip
        return
    choices = _choices(hint)
    kind = _kind(hint, f.name)
    help_text = _with_default(doc, default, f.name)
    group.add_argument(flag, dest=f.name, type=kind, choices=choices, default=None, help=help_text)


def _choices(hint: Any) -> tuple[str, ...] | None:
    if get_origin(hint) is Literal:
        return get_args(hint)
    args = [a for a in get_args(hint) if a is not type(None)]
    literal = [a for a in args if get_origin(a) is Literal]
    return get_args(literal[0]) if literal else None


def _kind(hint: Any, name: str) -> Any:
    args = {a for a in get_args(hint) if a is not type(None)} or {hint}
    if int in args:
        zero_ok = name.endswith("_bytes") or name == "max_waiting"
        return non_negative_int if zero_ok else positive_int
    if float in args:
        return non_negative_float
    return str


def _with_default(doc: str, default: object, name: str) -> str:
    """``doc`` ending with the default: a ``(none: X)`` note becomes ``(default: X)``."""
    if default is None:
        return re.sub(r"\(none: ([^)]*)\)", r"(default: \1)", doc) if "(none:" in doc else doc
    if name.endswith("_bytes") and isinstance(default, int):
        return f"{doc} (default: {_bytes(default)})"
    return f"{doc} (default: {default})"


def _bytes(value: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value and value % (1 << shift) == 0:
            return f"{value >> shift} {unit}"
    return f"{value} bytes"
