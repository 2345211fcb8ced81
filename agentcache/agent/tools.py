"""Tools from plain Python functions, and running tool calls safely through the tool cache.

Schemas come from the prompt builder's ``tool_spec`` (type hints + Google-style docstrings); this
module only registers functions, wraps them in ``ToolCache`` and turns every failure (unknown
tool, bad JSON, wrong arguments, an exception in the tool) into a message for the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from agentcache.cache.scope import validate_scope_kind
from agentcache.cache.tool import cached_tool_scope
from agentcache.canonical import canonical_json
from agentcache.exceptions import AgentCacheError, ConfigError
from agentcache.prompt.tools import ToolSpec, tool_spec

if TYPE_CHECKING:
    from agentcache.backends.base import ToolCall
    from agentcache.cache import ToolCache
    from agentcache.cache.scope import ScopeKind
    from agentcache.cache.tool import DependsOn

__all__ = ["Tool", "ToolOutcome", "ToolRegistry"]

MAX_RESULT_CHARS = 8000
"""Tool results longer than this are cut (with a note) so one call cannot flood the context."""


@dataclass(frozen=True, slots=True)
class Tool:
    """A registered tool."""

    spec: ToolSpec
    """Canonical schema (name, description, parameters)."""
    fn: Callable[..., Any]
    """The callable that runs (the ``ToolCache`` wrapper when cached)."""
    is_cached: bool
    """Results go through the tool cache."""


class ToolOutcome(NamedTuple):
    """The text sent back to the model for one call, and whether it reports an error."""

    content: str
    is_error: bool


class ToolRegistry:
    """Name -> tool; executes calls and never raises for model mistakes."""

    def __init__(
        self, tool_cache: ToolCache | None = None, *, scope: ScopeKind = "narrowest"
    ) -> None:
        """Create an empty registry.

        Args:
            tool_cache: Wraps tools registered with ``cache=True``.
            scope: Default scope of the tools it wraps (rule in ``agentcache.cache.scope``).

        Raises:
            ConfigError: ``scope`` is not a scope kind (the valid ones are named).
        """
        self._tools: dict[str, Tool] = {}
        self.tool_cache = tool_cache
        # NOTE: checked even without a tool_cache, so a typo fails here, not once one is added.
        self.scope = validate_scope_kind(scope)

    def add(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        cache: bool = True,
        version: str | None = None,
        ttl_s: float | None = None,
        scope: ScopeKind | None = None,
        depends_on: DependsOn | None = None,
    ) -> Tool:
        """Register ``fn`` as a tool.

        A function already wrapped by a ``ToolCache`` is registered as it is (cached, with the
        scope it was wrapped with), never wrapped again.

        Args:
            fn: Function with type hints and a Google-style docstring.
            name: Tool name (default: the function name).
            cache: Run through the tool cache (needs one; ignored without it). Use ``False`` for
                tools with side effects or with their own cache (retrieval).
            version: Bump to invalidate cached results when the tool's behaviour changes.
            ttl_s: Time to live of cached results, seconds.
            scope: Who shares its cached results (default: the registry's ``scope``).
            depends_on: Version of the state its answer depends on (see ``ToolCache.wrap``).

        Raises:
            ConfigError: A tool with that name is already registered, or options (``version``,
                ``ttl_s``, ``scope``, ``depends_on``) are given for an already wrapped tool.
            PromptError: No JSON Schema can be derived from ``fn``, or its name is not a valid
                tool name (a lambda needs ``name=``).
        """
        spec = tool_spec(fn, name=name)
        if spec.name in self._tools:
            raise ConfigError(f"tool {spec.name!r} is already registered; pick another name=")
        runner = fn
        is_cached = cache and self.tool_cache is not None
        if cached_tool_scope(fn) is not None:
            options = {"version": version, "ttl_s": ttl_s, "scope": scope, "depends_on": depends_on}
            given = sorted(name for name, value in options.items() if value is not None)
            if given:
                raise ConfigError(
                    f"tool {spec.name!r} is already wrapped by a ToolCache; set {given} "
                    "where it was wrapped"
                )
            is_cached = True
        elif is_cached:
            assert self.tool_cache is not None
            runner = self.tool_cache.wrap(
                fn,
                name=spec.name,
                version=version,
                ttl_s=ttl_s,
                scope=scope or self.scope,
                depends_on=depends_on,
            )
        tool = Tool(spec=spec, fn=runner, is_cached=is_cached)
        self._tools[spec.name] = tool
        return tool

    def extend(self, fns: Iterable[Callable[..., Any]]) -> None:
        """Register several functions with default options.

        Raises:
            ConfigError: ``fns`` is not a collection of tools: one tool (a function, a pydantic
                model class, a schema dict), a string or None (the message shows the fix).
        """
        for fn in _tool_list(fns):
            self.add(fn)

    def specs(self) -> list[ToolSpec]:
        """Every tool's schema (the prompt builder sorts them by name)."""
        return [tool.spec for tool in self._tools.values()]

    def names(self) -> list[str]:
        """Registered tool names, sorted."""
        return sorted(self._tools)

    def run(self, call: ToolCall) -> ToolOutcome:
        """Execute one tool call; every failure becomes an error message for the model."""
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolOutcome(
                f"error: unknown tool {call.name!r}; available tools: {', '.join(self.names())}",
                True,
            )
        try:
            arguments = call.parsed_arguments()
        except ValueError as exc:
            return ToolOutcome(
                f"error: arguments of {call.name!r} are not a JSON object: {exc}", True
            )
        problem = _check_arguments(tool.fn, arguments)
        if problem:
            return ToolOutcome(f"error: bad arguments for {call.name!r}: {problem}", True)
        try:
            result = tool.fn(**arguments)
        except AgentCacheError:
            raise  # NOTE: cache/scope misconfiguration is the caller's bug, not the model's.
        except Exception as exc:  # noqa: BLE001 - any tool failure is reported to the model
            return ToolOutcome(
                f"error: tool {call.name!r} raised {type(exc).__name__}: {exc}", True
            )
        return ToolOutcome(_to_text(result), False)


def _check_arguments(fn: Callable[..., Any], arguments: dict[str, Any]) -> str:
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as exc:
        return str(exc)
    except ValueError:
        return ""  # NOTE: no introspectable signature (some builtins): let the call decide.
    return ""


def _to_text(result: Any) -> str:
    text = result if isinstance(result, str) else canonical_json(result)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n[truncated: {len(text)} characters in total]"
    return text


def _tool_list(fns: object) -> list[Callable[..., Any]]:
    """``fns`` as a list, or a ConfigError for the usual slips: one tool given bare (LangChain,
    pydantic-ai and the OpenAI Agents SDK take lists too), a tool's name, None."""
    fix = "tools= takes a list of tools (functions, pydantic model classes or schema dicts)"
    if isinstance(fns, str):
        raise ConfigError(f"{fix}; got the string {fns!r}; pass the function itself in a list")
    if isinstance(fns, Mapping):
        raise ConfigError(f"{fix}; got a dict; pass tools=[...] with one entry per tool")
    if callable(fns):
        name = getattr(fns, "__name__", type(fns).__name__)
        raise ConfigError(f"{fix}; got the single tool {name!r}; pass tools=[{name}]")
    if fns is None:
        raise ConfigError(f"{fix}; got None; pass tools=[] for no tools")
    try:
        return list(cast("Iterable[Callable[..., Any]]", fns))
    except TypeError:
        raise ConfigError(f"{fix}; got a {type(fns).__name__}") from None
