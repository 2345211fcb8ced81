"""A flat, provider-neutral view of a prompt for lint and diff: ordered parts with their bytes.

A ``Prompt`` or a JSON request body (OpenAI Chat Completions or Anthropic Messages) becomes the
same list of parts in request order, each with a kind, a human label and the text as sent (JSON
parts keep the caller's key order). Knows request shapes; judges nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from agentcache.canonical import canonical_json
from agentcache.exceptions import PromptError
from agentcache.prompt.builder import Prompt
from agentcache.prompt.segments import Document

__all__ = ["Part", "View", "view_of"]


@dataclass(frozen=True, slots=True)
class Part:
    """One comparable unit: the system prompt, one tool, one document or one message."""

    kind: str
    label: str
    text: str
    value: Any = None


@dataclass(frozen=True, slots=True)
class View:
    """Parts in request order plus what lint needs to know about the request."""

    provider: Literal["prompt", "openai", "anthropic"]
    model: str
    parts: tuple[Part, ...]
    num_breakpoints: int = 0
    documents: tuple[Document, ...] = field(default=())


def _raw(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def view_of(source: Prompt | dict[str, Any], *, model: str = "") -> View:
    """Build the view of a ``Prompt`` or a request body.

    Raises:
        PromptError: a body has no ``messages`` list, or its tools/messages are not objects.
    """
    if isinstance(source, Prompt):
        return _from_prompt(source, model)
    if not isinstance(source, dict) or not isinstance(source.get("messages"), list):
        raise PromptError("not a chat request body: expected a JSON object with a 'messages' list")
    tools = source.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise PromptError("'tools' must be a list of objects")
    if not all(isinstance(m, dict) for m in source["messages"]):
        raise PromptError("every entry of 'messages' must be an object")
    is_anthropic = "system" in source or any("input_schema" in t for t in tools)
    is_anthropic = is_anthropic or '"cache_control"' in _raw(source)
    body_model = str(source.get("model") or model)
    builder = _from_anthropic if is_anthropic else _from_openai
    return builder(source, body_model)


def _tool_parts(tools: list[dict[str, Any]]) -> list[Part]:
    parts = []
    for tool in tools:
        fn: dict[str, Any] = tool["function"] if isinstance(tool.get("function"), dict) else tool
        parts.append(Part("tools", f"tool {fn.get('name')!r}", _raw(tool), tool))
    return parts


def _message_parts(messages: list[dict[str, Any]], start: int) -> list[Part]:
    parts = []
    for i, msg in enumerate(messages[start:], start):
        is_last_user = i == len(messages) - 1 and msg.get("role") == "user"
        kind = "user" if is_last_user else "history"
        parts.append(Part(kind, f"message {i} ({msg.get('role')})", _raw(msg), msg))
    return parts


def _from_openai(body: dict[str, Any], model: str) -> View:
    messages: list[dict[str, Any]] = body["messages"]
    parts = _tool_parts(body.get("tools") or [])
    start = 0
    while start < len(messages) and messages[start].get("role") in ("system", "developer"):
        content = messages[start].get("content")
        text = content if isinstance(content, str) else _raw(content)
        parts.append(Part("system", f"system message {start}", text))
        start += 1
    return View("openai", model, tuple(parts + _message_parts(messages, start)))


def _from_anthropic(body: dict[str, Any], model: str) -> View:
    parts = _tool_parts(body.get("tools") or [])
    system = body.get("system")
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system or []
    for i, block in enumerate(blocks):
        text = block.get("text") if isinstance(block, dict) else None
        parts.append(
            Part("system", f"system block {i}", text if isinstance(text, str) else _raw(block))
        )
    num = _raw(body).count('"cache_control"')
    return View("anthropic", model, tuple(parts + _message_parts(body["messages"], 0)), num)


def _from_prompt(prompt: Prompt, model: str) -> View:
    parts: list[Part] = []
    if prompt.system:
        parts.append(Part("system", "system prompt", prompt.system))
    parts += [Part("tools", f"tool {t.name!r}", t.json, t.openai()) for t in prompt.tools]
    parts += [Part("documents", f"document {d.id!r}", d.text) for d in prompt.documents]
    for i, msg in enumerate(prompt.history):
        parts.append(Part("history", f"message {i} ({msg.get('role')})", canonical_json(msg), msg))
    tail = prompt.tail_text()
    if tail is not None:
        msg = {"role": "user", "content": tail}
        parts.append(Part("user", "user turn", canonical_json(msg), msg))
    return View("prompt", model, tuple(parts), 0, prompt.documents)
