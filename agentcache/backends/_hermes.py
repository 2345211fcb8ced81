"""Hermes tool markup for chat templates that know no tools (SmolLM2's plain ChatML).

Such a template drops ``tools`` and cannot render an assistant turn's ``tool_calls`` or a
``tool`` message; these messages are rewritten before the template sees them: the tool
signatures go at the end of the system message (``templates/hermes_tools.jinja``), calls become
``<tool_call>`` blocks in the assistant's text and results ``<tool_response>`` blocks in a user
turn, as Hermes/Qwen templates write them. Deterministic (canonical JSON), append-only: a
message renders the same whatever follows it, so prefixes stay cacheable. Knows no tokenizer.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from agentcache.canonical import canonical_json
from agentcache.prompt._templates import render_template

__all__ = ["knows_tools", "with_hermes_markup"]


def knows_tools(chat_template: str) -> bool:
    """Whether a chat template renders ``tools`` itself (it reads a ``tools`` variable)."""
    return "tools" in chat_template


def with_hermes_markup(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` with tools, tool calls and tool results written as Hermes text (new list).

    Args:
        messages: OpenAI chat messages (``tool_calls`` in OpenAI's shape).
        tools: OpenAI-format tool schemas; none: only calls and results are rewritten.
    """
    out = [_rewritten(m) for m in messages]
    if tools:
        block = render_template("hermes_tools.jinja", tools=[canonical_json(t) for t in tools])
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _rewritten(message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    if role == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    if role == "assistant" and message.get("tool_calls"):
        calls = [_call_text(call) for call in message["tool_calls"]]
        text = "\n".join([message["content"], *calls] if message.get("content") else calls)
        return {"role": "assistant", "content": text}
    return copy.deepcopy(message)


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = canonical_json(arguments)
    name = json.dumps(function["name"])
    return f'<tool_call>\n{{"name": {name}, "arguments": {arguments}}}\n</tool_call>'
