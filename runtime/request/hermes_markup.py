"""Hermes tool markup for chat templates that know no tools (SmolLM2's plain ChatML).

Such a template drops ``tools`` and cannot render an assistant turn's ``tool_calls`` or a
``tool`` message; these messages are rewritten before the template sees them: the tool
signatures go at the end of the system message (``TOOLS_BLOCK``), calls become ``<tool_call>``
blocks in the assistant's text and results ``<tool_response>`` blocks in a user turn, as
Hermes/Qwen templates write them. Deterministic (sorted keys, fixed separators), append-only: a
message renders the same whatever follows it, so prefixes stay cacheable. One implementation for
the engine's ``render_chat`` (so the server) and the SDK's local backend; knows no tokenizer.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["TOOLS_BLOCK", "knows_tools", "needs_hermes_markup", "with_hermes_markup"]

TOOLS_BLOCK = """# Tools

You can call these functions. Their signatures are listed inside <tools></tools>:
<tools>
{signatures}
</tools>

To call a function, answer with a JSON object holding its name and arguments inside \
<tool_call></tool_call> tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
"""The block appended to the system message; ``{signatures}``: one JSON schema a line. The
wording follows the Hermes/Qwen2.5 templates' tool preamble (NousResearch Hermes function
calling), so a model tuned on either reads a familiar shape."""


def knows_tools(chat_template: str) -> bool:
    """Whether a chat template renders ``tools`` itself (it reads a ``tools`` variable)."""
    return "tools" in chat_template


def needs_hermes_markup(
    chat_template: str, messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None
) -> bool:
    """Whether ``messages`` / ``tools`` hold anything ``chat_template`` cannot render itself:
    tools, an assistant turn's ``tool_calls`` or a ``tool`` message, under a template that
    knows no tools."""
    if knows_tools(chat_template):
        return False
    return bool(tools) or any(
        m.get("role") == "tool" or (m.get("role") == "assistant" and m.get("tool_calls"))
        for m in messages
    )


def with_hermes_markup(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` with tools, tool calls and tool results written as Hermes text (new list).

    Args:
        messages: OpenAI chat messages (``tool_calls`` in OpenAI's shape).
        tools: OpenAI-format tool schemas, each written as JSON with sorted keys and no spaces;
            none: only calls and results are rewritten.

    Raises:
        KeyError, AttributeError, TypeError: a tool call without ``function.name``, or whose
            ``function`` is not an object (the server validates calls first, a 400;
            ``RequestBuilder.render_chat`` turns these into ``InvalidRequestError``).
    """
    out = [_rewritten(m) for m in messages]
    if tools:
        block = TOOLS_BLOCK.format(signatures="\n".join(_json(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


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
        arguments = _json(arguments)
    name = json.dumps(function["name"])
    return f'<tool_call>\n{{"name": {name}, "arguments": {arguments}}}\n</tool_call>'
