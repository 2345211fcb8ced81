"""Tool schemas in one canonical shape, from Python callables, pydantic models or raw dicts.

A callable's type hints and Google-style docstring become a pydantic JSON Schema; a pydantic model
class gives its own schema; an OpenAI- or Anthropic-style dict is read as is. Every schema is
canonical JSON (``agentcache.canonical``). This module knows nothing about ordering or providers.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import pydantic

from agentcache.canonical import JSONValue, canonical_json, normalize_text
from agentcache.exceptions import CanonicalizationError, PromptError

__all__ = ["TOOL_NAME", "ToolLike", "ToolSpec", "tool_spec"]

ToolLike: TypeAlias = Callable[..., Any] | type[pydantic.BaseModel] | Mapping[str, Any]

_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Example|Examples|Note):\s*$"
)
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""Valid tool names: the OpenAI Chat Completions reference (``tools[].function.name``: "a-z, A-Z,
0-9, underscores and dashes, maximum length 64") and the Anthropic tool-use docs (``name`` must
match ``^[a-zA-Z0-9_-]{1,64}$``) state the same rule."""
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
# NOTE: callables and model classes are immutable enough to cache by identity; dicts are not.
_CACHE: weakref.WeakKeyDictionary[Any, ToolSpec] = weakref.WeakKeyDictionary()
_DICT_CACHE: dict[str, ToolSpec] = {}
_DICT_CACHE_SIZE = 4096


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool in canonical form.

    Attributes:
        name: Function name the model calls.
        description: NFC text, trailing whitespace removed.
        parameters: Canonical JSON Schema of the arguments object.
        extras: Other canonical fields of the function object (e.g. ``strict``).
        json: ``canonical_json`` of the OpenAI ``tools`` entry; the bytes that are fingerprinted.
    """

    name: str
    description: str
    parameters: dict[str, JSONValue]
    extras: dict[str, JSONValue]
    json: str

    def openai(self) -> dict[str, JSONValue]:
        """The OpenAI ``tools`` entry: ``{"type": "function", "function": {...}}``."""
        function: dict[str, JSONValue] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        function.update(self.extras)
        return {"type": "function", "function": function}

    def anthropic(self) -> dict[str, JSONValue]:
        """The Anthropic ``tools`` entry: ``{"name", "description", "input_schema"}``."""
        entry: dict[str, JSONValue] = {"name": self.name, "input_schema": self.parameters}
        if self.description:
            entry["description"] = self.description
        return entry


def tool_spec(tool: ToolLike, *, name: str | None = None) -> ToolSpec:
    """Canonicalize one tool given as a callable, a pydantic model class or a dict.

    Args:
        tool: The tool.
        name: Tool name to use instead of the function's, model's or dict's own (needed for
            lambdas and ``functools.partial`` objects).

    Raises:
        PromptError: the tool has no name or its name does not match ``TOOL_NAME`` (e.g. a
            lambda's ``<lambda>``), its schema is not an object, or a parameter type has no
            JSON Schema (the message names the tool).
    """
    if name is not None:
        if callable(tool) and not isinstance(tool, type):
            return _from_callable(tool, name)
        return _renamed(tool_spec(tool), name)
    if isinstance(tool, Mapping):
        return _from_dict_cached(tool)
    try:
        return _CACHE[tool]
    except (KeyError, TypeError):
        pass
    if isinstance(tool, type) and issubclass(tool, pydantic.BaseModel):
        spec = _from_model(tool)
    elif callable(tool):
        spec = _from_callable(tool)
    else:
        raise PromptError(f"tool {tool!r} is not a callable, pydantic model class or dict")
    try:
        _CACHE[tool] = spec
    except TypeError:  # NOTE: some callables (builtins) cannot be weakly referenced.
        pass
    return spec


def _renamed(spec: ToolSpec, name: str) -> ToolSpec:
    function = spec.openai()["function"]
    assert isinstance(function, dict), "ToolSpec.openai() holds a function object"
    return _from_dict({**function, "name": name})


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise PromptError(f"tool has no name: {name!r}; give the function a 'name'")
    if name == "<lambda>":
        raise PromptError(
            "a lambda has no usable tool name ('<lambda>'); use a def function or pass a name "
            "(e.g. ToolRegistry.add(fn, name='lookup'))"
        )
    if not TOOL_NAME.match(name):
        raise PromptError(
            f"tool name {name!r} is invalid: use 1-64 letters, digits, '_' or '-' "
            "(OpenAI and Anthropic both reject other names)"
        )
    return name


def _make(name: str, description: str, parameters: Any, extras: Mapping[str, Any]) -> ToolSpec:
    name = _check_name(name)
    # NOTE: a round trip through canonical JSON leaves every dict with sorted keys, so any later
    # serializer (httpx, a chat template's tojson) emits the canonical order too.
    try:
        params = json.loads(canonical_json(parameters))
        extra = json.loads(canonical_json(dict(extras)))
    except CanonicalizationError as exc:
        raise CanonicalizationError(f"tool {name!r}: {exc}") from exc
    if not isinstance(params, dict):
        raise PromptError(f"tool {name!r}: parameters must be a JSON object schema")
    spec = ToolSpec(name, normalize_text(description or ""), params, extra, "")
    return ToolSpec(spec.name, spec.description, params, extra, canonical_json(spec.openai()))


def _from_dict_cached(tool: Mapping[str, Any]) -> ToolSpec:
    # NOTE: agents pass the same tool dicts every turn. The key is C-speed JSON of the raw dict:
    # equal keys mean equal structure, strings and number spellings, hence equal canonical form.
    # Values json cannot encode (datetimes, non-dict mappings) skip the cache.
    try:
        key = json.dumps(tool, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return _from_dict(tool)
    spec = _DICT_CACHE.get(key)
    if spec is None:
        spec = _from_dict(tool)
        if len(_DICT_CACHE) >= _DICT_CACHE_SIZE:
            _DICT_CACHE.pop(next(iter(_DICT_CACHE)))  # NOTE: FIFO eviction, bounded memory.
        _DICT_CACHE[key] = spec
    return spec


def _from_dict(tool: Mapping[str, Any]) -> ToolSpec:
    if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
        fn = dict(tool["function"])
    else:
        fn = dict(tool)
    fn.pop("type", None)
    fn.pop("cache_control", None)  # NOTE: a provider marker, not part of the tool.
    name = fn.pop("name", "")
    description = fn.pop("description", "")
    params = fn.pop("parameters", None)
    if params is None:
        params = fn.pop("input_schema", {"type": "object", "properties": {}})
    return _make(name, description, params, fn)


def _from_model(model: type[pydantic.BaseModel]) -> ToolSpec:
    schema = dict(model.model_json_schema())
    schema.pop("title", None)
    description = schema.pop("description", "") or ""
    return _make(model.__name__, description, _drop_property_titles(schema), {})


def _from_callable(fn: Callable[..., Any], name: str | None = None) -> ToolSpec:
    name = _check_name(name if name is not None else getattr(fn, "__name__", ""))
    summary, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    try:
        hints = typing.get_type_hints(fn)
        fields: dict[str, Any] = {}
        for param in inspect.signature(fn).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise PromptError(f"tool {name!r}: *args/**kwargs have no JSON Schema")
            default = ... if param.default is param.empty else param.default
            field = pydantic.Field(default, description=arg_docs.get(param.name))
            fields[param.name] = (hints.get(param.name, Any), field)
        model = pydantic.create_model(f"{name}_args", **fields)
        schema = dict(model.model_json_schema())
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, NameError) as exc:
        raise PromptError(f"tool {name!r}: cannot build a JSON Schema: {exc}") from exc
    schema.pop("title", None)
    return _make(name, summary, _drop_property_titles(schema), {})


def _drop_property_titles(schema: dict[str, Any]) -> dict[str, Any]:
    props = schema.get("properties")
    if isinstance(props, dict):
        schema["properties"] = {
            key: {k: v for k, v in value.items() if k != "title"}
            if isinstance(value, dict)
            else value
            for key, value in props.items()
        }
    return schema


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into its summary text and per-argument descriptions."""
    summary: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for line in doc.splitlines():
        header = _SECTION.match(line.strip())
        if header and not line.startswith(" "):
            section, current = header.group(1), None
            continue
        if section is None:
            summary.append(line)
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            match = _ARG_LINE.match(line.strip())
            if match and (len(line) - len(line.lstrip())) <= 4:
                current = match.group(1).lstrip("*")
                args[current] = match.group(3).strip()
            elif current is not None:
                args[current] = f"{args[current]} {line.strip()}".strip()
    return normalize_text("\n".join(summary)).strip(), args
