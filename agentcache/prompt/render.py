"""Render a ``Prompt`` as an OpenAI or Anthropic request body.

OpenAI caches prefixes automatically; the body adds a ``prompt_cache_key`` derived from the stable
segments' fingerprint so requests sharing that prefix are routed together. Anthropic needs explicit
``cache_control`` breakpoints; they come from ``anthropic.plan_breakpoints`` and nowhere else.
This module knows request shapes, not HTTP.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

from agentcache.canonical import JSONValue, canonical_json, stable_hash
from agentcache.exceptions import PromptError
from agentcache.prompt.anthropic import MAX_BREAKPOINTS, Tier, TierSpan, Ttl, plan_breakpoints
from agentcache.prompt.segments import STABLE_KINDS, Message, SegmentKind
from agentcache.prompt.tools import ToolSpec
from agentcache.tokens import estimate_tokens

__all__ = [
    "ANTHROPIC_PARAMS",
    "MarkerSite",
    "anthropic_body",
    "anthropic_marker_sites",
    "anthropic_messages",
    "check_anthropic_markers",
    "count_anthropic_markers",
    "openai_body",
    "order_openai_body",
    "prompt_cache_key",
]


class Prompt(Protocol):
    """What rendering reads from a built prompt (``builder.Prompt`` satisfies it).

    A Protocol so this module never imports the builder that calls it (dependencies run one way).
    """

    @property
    def namespace(self) -> str: ...
    @property
    def system(self) -> str: ...
    @property
    def tools(self) -> tuple[ToolSpec, ...]: ...
    @property
    def history(self) -> tuple[Message, ...]: ...
    @property
    def user(self) -> str | None: ...
    @property
    def volatile(self) -> str | None: ...
    @property
    def fingerprints(self) -> Mapping[SegmentKind, str]: ...
    def documents_block(self) -> str: ...
    def tool_schemas(self) -> list[dict[str, JSONValue]]: ...
    def to_messages(self) -> list[dict[str, JSONValue]]: ...


ANTHROPIC_DEFAULT_MAX_TOKENS = 1024
"""``max_tokens`` is required by the Messages API; this is used when the caller gives none."""


def prompt_cache_key(prompt: Prompt) -> str:
    """``prompt_cache_key`` for OpenAI: a hash of the namespace and the stable prefix fingerprint.

    The key reveals neither the namespace nor any prompt content.
    """
    stable = [fp for kind, fp in prompt.fingerprints.items() if kind in STABLE_KINDS]
    return "ac-" + stable_hash(prompt.namespace, stable[-1] if stable else "")[:32]


_derived_cache_key = prompt_cache_key  # NOTE: openai_body's keyword shadows the function name.


OPENAI_RENDERED = frozenset({"messages", "tools"})
"""Body fields ``openai_body`` renders itself; ``params`` may not replace them (an explicit
``prompt_cache_key`` has its own keyword)."""
ANTHROPIC_RENDERED = frozenset({"messages", "tools", "system"})
"""Body fields ``anthropic_body`` renders itself; ``params`` may not replace them."""


def _check_params(params: Mapping[str, Any], rendered: frozenset[str], builder: str) -> None:
    clash = sorted(rendered & params.keys())
    if clash:
        raise PromptError(
            f"{builder}: {clash} are rendered from the prompt and cannot be passed as params; "
            "set them through PromptBuilder, or edit the returned body if you really mean to"
        )


def openai_body(
    prompt: Prompt, *, model: str, prompt_cache_key: str | None = None, **params: Any
) -> dict[str, Any]:
    """OpenAI Chat Completions body: ``model``, ``messages``, ``tools``, ``prompt_cache_key``.

    Top-level fields come in stable-to-volatile order, ``messages`` last (see
    ``order_openai_body``).

    Args:
        prompt: The built prompt.
        model: Model name.
        prompt_cache_key: Explicit routing key instead of the derived one (see
            ``prompt_cache_key()``).
        **params: Other body fields (``max_tokens``, ``temperature``...), added last.

    Raises:
        PromptError: ``params`` names a rendered field (``messages``, ``tools``); replacing it
            would silently drop the built prompt.
    """
    _check_params(params, OPENAI_RENDERED, "to_openai")
    body: dict[str, Any] = {"model": model, "messages": prompt.to_messages()}
    if prompt.tools:
        body["tools"] = prompt.tool_schemas()
    body["prompt_cache_key"] = prompt_cache_key or _derived_cache_key(prompt)
    body.update(params)
    return order_openai_body(body)


def order_openai_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Chat Completions body in stable-to-volatile order: ``model``, the other fields sorted,
    ``tools``, then ``messages`` last; keys inside every object sorted.

    Serialized in order (as httpx does), one turn's body minus its closing ``]}`` is then a byte
    prefix of the next turn's, which byte-order-sensitive relays and caches need. Call it again
    after adding fields to a rendered body.

    Raises:
        CanonicalizationError: a value is not JSON (e.g. a float NaN or a set).
    """
    out: dict[str, Any] = {"model": body["model"]} if "model" in body else {}
    out.update(_sorted({k: v for k, v in body.items() if k not in ("model", "tools", "messages")}))
    out.update((key, _sorted_value(body[key])) for key in ("tools", "messages") if key in body)
    return out


def _sorted(body: dict[str, Any]) -> dict[str, Any]:
    """The body with every object's keys in canonical order, whatever serializer runs next."""
    result: dict[str, Any] = json.loads(canonical_json(body))
    return result


ANTHROPIC_PARAMS = frozenset(
    {
        "max_tokens",
        "metadata",
        "service_tier",
        "stop_sequences",
        "stream",
        "temperature",
        "thinking",
        "tool_choice",
        "top_k",
        "top_p",
    }
)
"""Messages API body fields ``anthropic_body`` accepts as keywords (API reference, reviewed
2026-12-01); anything else goes through ``extra_body`` so a misspelt option is never sent."""


def anthropic_body(
    prompt: Prompt,
    *,
    model: str,
    ttl: Mapping[Tier, Ttl] | None = None,
    count_tokens: Callable[[str], int] = estimate_tokens,
    min_cacheable_tokens: int | None = None,
    extra_body: Mapping[str, Any] | None = None,
    **params: Any,
) -> dict[str, Any]:
    """Anthropic Messages body with ``cache_control`` breakpoints at stability-tier boundaries.

    Top-level fields come in stable-to-volatile order (``model``, the sampling fields, then
    ``tools``, ``system``, ``messages`` last) so that serialized in order, as httpx does, one
    turn's body minus its closing ``]}`` is a byte prefix of the next turn's wherever the moving
    conversation marker allows; keys inside every object are sorted. Markers found in the
    history (for example inside ``tool_result`` content) are stripped: the planner's at most
    ``MAX_BREAKPOINTS`` are the only ones, and the final body is checked.

    Args:
        prompt: The built prompt.
        model: Anthropic model id (selects the minimum cacheable length).
        ttl: Tier -> ``"5m"``/``"1h"`` (default 5m everywhere); see ``plan_breakpoints``.
        count_tokens: Token counter for the minimum-length rule. Anthropic publishes no local
            tokenizer, so the default is the labelled estimate of ``agentcache.tokens``.
        min_cacheable_tokens: Overrides the model's minimum cacheable length, tokens (for a
            model the table does not know or a changed provider rule).
        extra_body: Body fields outside ``ANTHROPIC_PARAMS``, sent as given (sorted, before
            ``tools``).
        **params: Body fields named in ``ANTHROPIC_PARAMS`` (``max_tokens`` defaults to 1024).

    Raises:
        PromptError: ``params`` names a rendered field (``messages``, ``tools``, ``system``) or
            a field outside ``ANTHROPIC_PARAMS``; ``extra_body`` names a rendered field.
        PromptError: the history holds a ``system``/``developer`` message (Anthropic takes the
            system prompt only as the top-level ``system`` field).
        ValueError: ``min_cacheable_tokens`` is not a positive int.
    """
    _check_params(params, ANTHROPIC_RENDERED, "to_anthropic")
    _check_known(params)
    _check_params(extra_body or {}, ANTHROPIC_RENDERED | {"model"}, "to_anthropic extra_body")
    tools: list[dict[str, Any]] = [tool.anthropic() for tool in prompt.tools]
    system: list[dict[str, Any]] = [
        {"type": "text", "text": text} for text in (prompt.system, prompt.documents_block()) if text
    ]
    messages, anchor = anthropic_messages(prompt)
    spans = [
        TierSpan("tools", _count(tools, count_tokens), ("tools", len(tools) - 1)),
        TierSpan("system", count_tokens(prompt.system), ("system", 0)),
        TierSpan("documents", count_tokens(prompt.documents_block()), ("system", len(system) - 1)),
        TierSpan("conversation", _count(messages, count_tokens), anchor),
    ]
    head: dict[str, Any] = {"max_tokens": ANTHROPIC_DEFAULT_MAX_TOKENS, **(extra_body or {})}
    head.update(params)
    rendered: dict[str, Any] = {"tools": tools, "system": system, "messages": messages}
    plan = plan_breakpoints(spans, model=model, ttl=ttl, min_tokens=min_cacheable_tokens)
    for bp in plan.breakpoints:
        _block_at(rendered, bp.location)["cache_control"] = bp.cache_control
    body: dict[str, Any] = {"model": model, **_sorted(head)}
    body.update((key, _sorted_value(rendered[key])) for key in ("tools", "system") if rendered[key])
    body["messages"] = _sorted_value(messages)
    check_anthropic_markers(body)
    return body


def _check_known(params: Mapping[str, Any]) -> None:
    unknown = sorted(params.keys() - ANTHROPIC_PARAMS)
    if unknown:
        raise PromptError(
            f"to_anthropic: unknown body field(s) {unknown}; known: {sorted(ANTHROPIC_PARAMS)}. "
            "Pass fields the API added since through extra_body={...}"
        )


def _sorted_value(value: Any) -> Any:
    return json.loads(canonical_json(value))


class MarkerSite(NamedTuple):
    """One piece of a Messages body in prefix order: a block that may carry ``cache_control``,
    or a plain string (a ``system`` or message ``content`` given as text, which cannot)."""

    value: dict[str, Any] | str
    tier: Tier
    is_nested: bool


def anthropic_marker_sites(body: Mapping[str, Any]) -> Iterator[MarkerSite]:
    """Every place of a Messages body where Anthropic reads ``cache_control``, in prefix order.

    The one walker of marker positions (counting, stripping, the proxy's trimming and planning
    all use it): tool definitions, ``system`` blocks, message content blocks and the blocks
    inside a ``tool_result``'s content, which come before their parent. Order tools -> system
    -> messages, as Anthropic's prompt-caching docs give the cache prefix. A ``cache_control``
    key anywhere else (a tool parameter of that name, a tool input) is data, not a marker.
    """
    for tool in _as_list(body.get("tools")):
        if isinstance(tool, dict):
            yield MarkerSite(tool, "tools", False)
    system = body.get("system")
    if isinstance(system, str):
        yield MarkerSite(system, "system", False)
    for block in _as_list(system):
        yield from _block_sites(block, "system")
    for message in _as_list(body.get("messages")):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield MarkerSite(content, "conversation", False)
        for block in _as_list(content):
            yield from _block_sites(block, "conversation")


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _block_sites(block: Any, tier: Tier) -> Iterator[MarkerSite]:
    if not isinstance(block, dict):
        return
    if block.get("type") == "tool_result":
        for child in _as_list(block.get("content")):
            if isinstance(child, dict):
                yield MarkerSite(child, tier, True)
    yield MarkerSite(block, tier, False)


def count_anthropic_markers(body: Mapping[str, Any]) -> int:
    """Number of ``cache_control`` markers in a Messages body (see ``anthropic_marker_sites``)."""
    return sum(
        1
        for site in anthropic_marker_sites(body)
        if isinstance(site.value, dict) and "cache_control" in site.value
    )


def check_anthropic_markers(body: Mapping[str, Any]) -> None:
    """Refuse a Messages body with more ``cache_control`` markers than Anthropic accepts.

    Raises:
        PromptError: more than ``MAX_BREAKPOINTS`` markers, nested ones included (the provider
            would answer 400).
    """
    found = count_anthropic_markers(dict(body))
    if found > MAX_BREAKPOINTS:
        raise PromptError(
            f"Anthropic body carries {found} cache_control markers; at most {MAX_BREAKPOINTS} "
            "are allowed (build it with to_anthropic, which strips markers inside the history)"
        )


def _strip_markers(body: Mapping[str, Any]) -> None:
    """Remove every ``cache_control`` marker of ``body``, in place."""
    for site in anthropic_marker_sites(body):
        if isinstance(site.value, dict):
            site.value.pop("cache_control", None)


def _count(value: list[dict[str, Any]], count_tokens: Callable[[str], int]) -> int:
    return count_tokens(canonical_json(value)) if value else 0


def _block_at(body: dict[str, Any], location: tuple[str | int, ...]) -> dict[str, Any]:
    node: Any = body
    for key in location:
        node = node[key]
    assert isinstance(node, dict), f"breakpoint location {location} is not a block"
    return node


def anthropic_messages(prompt: Prompt) -> tuple[list[dict[str, Any]], tuple[str | int, ...]]:
    """Convert history + user/volatile tail to Anthropic messages (all content as blocks).

    Returns:
        The messages and the location of the conversation tier's last stable block: the user
        turn's text block when there is one (the volatile block after it is never cached), else
        the last history block.
    """
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(prompt.history):
        role, blocks = _convert(message, index)
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(blocks)  # NOTE: the API merges same-role turns anyway.
        elif blocks:
            messages.append({"role": role, "content": blocks})
    _strip_markers({"messages": messages})  # NOTE: the planner's markers are the only ones
    anchor: tuple[str | int, ...] = ()
    if messages:
        anchor = ("messages", len(messages) - 1, "content", len(messages[-1]["content"]) - 1)
    tail = [{"type": "text", "text": t} for t in (prompt.user, prompt.volatile) if t is not None]
    if tail:
        if not (messages and messages[-1]["role"] == "user"):
            messages.append({"role": "user", "content": []})
        content = messages[-1]["content"]
        content.extend(tail)
        if prompt.user is not None:
            anchor = ("messages", len(messages) - 1, "content", len(content) - len(tail))
    return messages, anchor


def _convert(message: Mapping[str, JSONValue], index: int) -> tuple[str, list[dict[str, Any]]]:
    role = message["role"]
    content = message.get("content")
    if role == "tool":
        block = {
            "type": "tool_result",
            "tool_use_id": message.get("tool_call_id"),
            "content": copy.deepcopy(content),
        }
        return "user", [block]
    if role not in ("user", "assistant"):
        raise PromptError(
            f"history[{index}]: Anthropic has no {role!r} messages; put it in .system() instead"
        )
    blocks: list[dict[str, Any]] = []
    if isinstance(content, str) and content:
        blocks.append({"type": "text", "text": content})
    elif isinstance(content, list):
        blocks.extend(copy.deepcopy(part) for part in content if isinstance(part, dict))
    for call in message.get("tool_calls") or []:  # type: ignore[union-attr]
        blocks.append(_tool_use(call, index))
    return str(role), blocks


def _tool_use(call: Any, index: int) -> dict[str, Any]:
    try:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        return {
            "type": "tool_use",
            "id": call["id"],
            "name": function["name"],
            "input": json.loads(arguments) if isinstance(arguments, str) else arguments,
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise PromptError(f"history[{index}]: malformed tool call {call!r}: {exc}") from exc
