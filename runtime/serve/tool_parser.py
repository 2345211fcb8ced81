"""Tool-call parsing of model output: Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks.

Turns generated text into plain content plus structured calls (name + JSON arguments string).
It knows only text formats; it never sees token ids, the engine or HTTP. The behaviour is the
SDK's (``agentcache.agent.parsing.parse_hermes``); one case table (``tests/tool_call_cases.py``)
runs against both: ``"parameters"`` is read when ``"arguments"`` is absent, an unterminated last
block (cut at ``max_tokens``) is parsed if its JSON is whole, and a malformed block stays in the
content, so a model mistake is shown rather than lost.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from runtime.holdback import held_back_len

__all__ = [
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolCallParser",
    "detect_tool_parser",
]

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
# NOTE: a block ends at its close tag or at the end of the text (generation cut at max_tokens).
_HERMES_BLOCK = re.compile(
    re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.DOTALL
)


class ParsedToolCall(NamedTuple):
    """One call found in the output."""

    name: str
    arguments: str
    """Arguments as a canonical JSON object string (the OpenAI wire format)."""


class ParsedOutput(NamedTuple):
    """Generated text split into the visible content and the tool calls."""

    content: str
    tool_calls: list[ParsedToolCall]


class ToolCallParser:
    """Parser for the Hermes format used by Qwen2.5/Qwen3, Hermes and the bundled tiny model.

    Each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (NousResearch
    Hermes function-calling format, also the Qwen2.5 chat template).
    """

    open_tag = HERMES_OPEN

    def parse(self, text: str) -> ParsedOutput:
        """Split finished output into content and calls.

        Args:
            text: the whole generated text of one choice.

        Returns:
            ``ParsedOutput``; content keeps text outside well-formed blocks (stripped when a call
            was found), and any block whose body is not ``{"name": str, "arguments": object}``
            (or ``"parameters"`` instead of ``"arguments"``) stays in the content.
        """
        calls: list[ParsedToolCall] = []
        kept: list[str] = []
        pos = 0
        for match in _HERMES_BLOCK.finditer(text):
            call = _parse_call(match.group(1))
            if call is None:
                continue
            kept.append(text[pos : match.start()])
            pos = match.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept)
        return ParsedOutput(content.strip() if calls else content, calls)

    def safe_prefix_len(self, text: str) -> int:
        """How much of a growing ``text`` can be streamed as content now.

        Returns:
            The length of the prefix that cannot belong to a tool call: everything before the
            first open tag, minus any tail that could still grow into one.
        """
        found = text.find(self.open_tag)
        if found >= 0:
            return found
        return len(text) - held_back_len(text, (self.open_tag,))


def _parse_call(body: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if "arguments" in obj and "parameters" in obj:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False, sort_keys=True))


def detect_tool_parser(chat_template: str | None) -> ToolCallParser | None:
    """Pick the parser for a chat template.

    Args:
        chat_template: the tokenizer's Jinja chat template, or None.

    Returns:
        A ``ToolCallParser`` when the template writes Hermes ``<tool_call>`` blocks, else None
        (tool calls are then left in the text).
    """
    if chat_template and HERMES_OPEN in chat_template:
        return ToolCallParser()
    return None
