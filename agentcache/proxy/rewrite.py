"""Rewrite an app's request body into its cache-friendly form without changing what it means.

What carries no meaning is made canonical: JSON key order inside tool schemas, tool-call
arguments and tool results, and (by default) the order of tools, sorted by name. The text of
messages is never touched. Anthropic bodies get ``cache_control`` breakpoints from the SDK's one
planner when the client sent none; a client's own markers are kept, trimmed to the provider's
limit of 4 (nested ones counted) and to those that reach the minimum cacheable length. OpenAI
bodies get a ``prompt_cache_key`` when the client set none. Knows request shapes, not HTTP.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from agentcache.canonical import stable_hash
from agentcache.prompt.anthropic import (
    MAX_BREAKPOINTS,
    Tier,
    TierSpan,
    min_cacheable_tokens,
    plan_breakpoints,
)
from agentcache.prompt.render import anthropic_marker_sites, count_anthropic_markers
from agentcache.tokens import estimate_tokens

__all__ = [
    "Provider",
    "RewriteOptions",
    "RewriteResult",
    "rewrite",
    "stable_fingerprint",
]

Provider = Literal["openai", "anthropic"]


@dataclass(frozen=True, slots=True)
class RewriteOptions:
    """What the rewrite may change (every switch on by default)."""

    sort_tools: bool = True
    """Sort tools by name (tool order carries no meaning for the model's choice of tool)."""
    plan_breakpoints: bool = True
    """Anthropic: place ``cache_control`` markers when the client sent none."""
    set_prompt_cache_key: bool = True
    """OpenAI: set ``prompt_cache_key`` (session id, else the stable-prefix fingerprint)."""


class RewriteResult(NamedTuple):
    """The rewritten body (a new object) and what changed, in words without content."""

    body: dict[str, Any]
    changes: tuple[str, ...]


def _sorted_json(value: Any) -> Any:
    """``value`` with every object's keys sorted (recursively); strings are left as they are."""
    if isinstance(value, dict):
        return {k: _sorted_json(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_json(v) for v in value]
    return value


def _canonical_json_text(text: Any) -> Any:
    """A JSON object/array held in a string, re-serialized with sorted keys; anything else as is."""
    if not isinstance(text, str) or text[:1] not in ("{", "["):
        return text
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return json.dumps(_sorted_json(parsed), ensure_ascii=False, separators=(",", ":"))


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _tool_name(tool: Any) -> str:
    if not isinstance(tool, dict):
        return ""
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
    return name if isinstance(name, str) else ""


def _rewrite_tools(body: dict[str, Any], options: RewriteOptions, changes: list[str]) -> None:
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return
    canonical = [_sorted_json(t) for t in tools]
    if json.dumps(canonical) != json.dumps(tools):
        changes.append("tool schema keys sorted")
    if options.sort_tools:
        ordered = sorted(canonical, key=_tool_name)
        if [_tool_name(t) for t in ordered] != [_tool_name(t) for t in canonical]:
            changes.append("tools sorted by name")
        canonical = ordered
    body["tools"] = canonical


def _rewrite_openai_messages(messages: list[Any], changes: list[str]) -> None:
    for message in messages:
        if not isinstance(message, dict):
            continue
        for call in message.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and "arguments" in fn:
                new = _canonical_json_text(fn["arguments"])
                if new != fn["arguments"]:
                    fn["arguments"] = new
                    changes.append("tool-call arguments canonicalized")
        if message.get("role") == "tool":
            new = _canonical_json_text(message.get("content"))
            if new != message.get("content"):
                message["content"] = new
                changes.append("tool result canonicalized")


def _rewrite_anthropic_messages(messages: list[Any], changes: list[str]) -> None:
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else []:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use" and isinstance(block.get("input"), dict):
                new = _sorted_json(block["input"])
                if list(_walk_keys(new)) != list(_walk_keys(block["input"])):
                    changes.append("tool-use input canonicalized")
                block["input"] = new
            elif block.get("type") == "tool_result":
                new = _canonical_json_text(block.get("content"))
                if new != block.get("content"):
                    block["content"] = new
                    changes.append("tool result canonicalized")


def _walk_keys(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _walk_keys(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk_keys(item)


def stable_fingerprint(body: dict[str, Any]) -> str:
    """SHA-256 hex of the stable prefix of a body: its tools and system part (canonical JSON)."""
    messages = _list(body.get("messages"))
    system = body.get("system")
    if system is None:
        system = [
            m for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer")
        ]
    stable = {"tools": _sorted_json(body.get("tools") or []), "system": _sorted_json(system)}
    return stable_hash("agentcache-proxy-stable-v1", json.dumps(stable, sort_keys=True))


def _set_prompt_cache_key(body: dict[str, Any], session_id: str | None, changes: list[str]) -> None:
    if body.get("prompt_cache_key") is not None:
        return
    source = session_id if session_id else stable_fingerprint(body)
    body["prompt_cache_key"] = "ac-" + stable_hash("agentcache-proxy-key-v1", source)[:32]
    changes.append("prompt_cache_key set")


class _Block(NamedTuple):
    """An object that can carry a marker, with the (estimated) tokens up to and including it."""

    block: dict[str, Any]
    tier: Tier
    prefix_tokens: int
    is_nested: bool


_NO_MARKER_TYPES = frozenset({"thinking", "redacted_thinking"})


def _anthropic_blocks(body: dict[str, Any]) -> list[_Block]:
    """Every object that can carry ``cache_control`` (``anthropic_marker_sites``), in prefix order,
    with the estimated tokens up to and including it (``estimate_tokens``: the minimum-length rule
    is applied on them). A ``tool_result`` whose content is blocks counts through its children."""
    out: list[_Block] = []
    total = 0
    for site in anthropic_marker_sites(body):
        if isinstance(site.value, str):
            total += estimate_tokens(site.value)
            continue
        block = site.value
        if not (block.get("type") == "tool_result" and isinstance(block.get("content"), list)):
            total += estimate_tokens(json.dumps(block, ensure_ascii=False))
        out.append(_Block(block, site.tier, total, site.is_nested))
    return out


def _trim_client_markers(body: dict[str, Any], model: str, changes: list[str]) -> None:
    """Keep the client's markers that reach the minimum, at most the last ``MAX_BREAKPOINTS``."""
    minimum = min_cacheable_tokens(model)
    marked = [b for b in _anthropic_blocks(body) if b.block.get("cache_control") is not None]
    for b in marked:
        if b.prefix_tokens < minimum:
            del b.block["cache_control"]
            changes.append(f"cache_control below the {minimum}-token minimum removed")
    kept = [b for b in marked if "cache_control" in b.block]
    for b in kept[: max(0, len(kept) - MAX_BREAKPOINTS)]:
        del b.block["cache_control"]
        changes.append(f"cache_control beyond the limit of {MAX_BREAKPOINTS} removed")


def _plan_markers(body: dict[str, Any], model: str, changes: list[str]) -> None:
    """Place markers at the end of the tools, system and conversation tiers (the SDK planner)."""
    if isinstance(body.get("system"), str) and body["system"]:
        body["system"] = [{"type": "text", "text": body["system"]}]
    blocks = _anthropic_blocks(body)
    last: dict[Tier, _Block] = {}
    for b in blocks:
        if not b.is_nested and b.block.get("type") not in _NO_MARKER_TYPES:
            last[b.tier] = b
    spans, previous, by_index = [], 0, {}
    for i, tier in enumerate(("tools", "system", "conversation")):
        if tier in last:
            spans.append(TierSpan(tier, last[tier].prefix_tokens - previous, (i,)))
            by_index[i] = last[tier].block
            previous = last[tier].prefix_tokens
    plan = plan_breakpoints(spans, model=model)
    for bp in plan.breakpoints:
        by_index[int(bp.location[0])]["cache_control"] = {"type": "ephemeral"}
        changes.append(f"cache_control placed after {bp.tier}")


def rewrite(
    body: dict[str, Any],
    provider: Provider,
    *,
    session_id: str | None = None,
    options: RewriteOptions | None = None,
) -> RewriteResult:
    """Return the cache-friendly form of ``body`` (a deep copy; ``body`` is not modified).

    Args:
        body: An OpenAI Chat Completions or Anthropic Messages request body.
        provider: Which API the body is for.
        session_id: Caller's session id; OpenAI's ``prompt_cache_key`` derives from it if given,
            else from the stable-prefix fingerprint (tools + system).
        options: What may change; default: everything.

    Returns:
        The new body and the list of changes (no prompt content in them).
    """
    options = options or RewriteOptions()
    out = copy.deepcopy(body)
    changes: list[str] = []
    _rewrite_tools(out, options, changes)
    messages = _list(out.get("messages"))
    if provider == "openai":
        _rewrite_openai_messages(messages, changes)
        if options.set_prompt_cache_key:
            _set_prompt_cache_key(out, session_id, changes)
        return RewriteResult(out, tuple(dict.fromkeys(changes)))
    _rewrite_anthropic_messages(messages, changes)
    model = str(out.get("model") or "")
    if count_anthropic_markers(out):
        _trim_client_markers(out, model, changes)
    elif options.plan_breakpoints:
        _plan_markers(out, model, changes)
    return RewriteResult(out, tuple(dict.fromkeys(changes)))
