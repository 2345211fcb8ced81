"""Tool-call parsing of model output: Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks.

Turns generated text into plain content plus structured calls (name + JSON arguments string).
It knows only text formats; it never sees token ids, the engine or HTTP. The behaviour is the
SDK's (``agentcache.agent.parsing.parse_hermes``); one case table (``tests/tool_call_cases.py``)
runs against both: ``"parameters"`` is read when ``"arguments"`` is absent, a block's JSON ends
where parsing it says (so ``</tool_call>`` inside a string argument is text), an unterminated last
block (cut at ``max_tokens``) is parsed if its JSON is whole, and a malformed block stays in the
content, so a model mistake is shown rather than lost.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from runtime.request.hermes_markup import knows_tools
from runtime.request.holdback import held_back_len

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
_JSON_WHITESPACE = " \t\n\r"  # RFC 8259 section 2
_DECODER = json.JSONDecoder()


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
        pos = search = 0
        while (start := text.find(HERMES_OPEN, search)) >= 0:
            body, search = _block(text, start + len(HERMES_OPEN))
            call = _parse_call(body)
            if call is None:
                continue
            kept.append(text[pos:start])
            pos = search
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


def _block(text: str, start: int) -> tuple[str, int]:
    """The body of the ``<tool_call>`` block whose open tag ends at ``start``, and its end.

    A body that starts with a whole JSON value followed only by whitespace and the close tag (or
    by the end of the text, or a cut-off close tag: generation stopped at ``max_tokens``) ends
    where ``json.JSONDecoder.raw_decode`` says the value ends, so a ``</tool_call>`` inside a
    string argument stays part of it. Any other body (not JSON, or text after the JSON) ends at
    the first close tag or the end of the text, and stays malformed.

    Args:
        text: the whole generated text.
        start: the index just past the block's open tag.

    Returns:
        ``(body, end)``: the body text (JSON plus leading whitespace when well formed) and the
        index just past the block (its close tag included).
    """
    value_start = start
    while value_start < len(text) and text[value_start] in _JSON_WHITESPACE:
        value_start += 1
    try:
        _, value_end = _DECODER.raw_decode(text, value_start)
    except ValueError:
        value_end = -1
    if value_end >= 0:
        after = value_end
        while after < len(text) and text[after] in _JSON_WHITESPACE:
            after += 1
        if text.startswith(HERMES_CLOSE, after):
            return text[start:value_end], after + len(HERMES_CLOSE)
        if HERMES_CLOSE.startswith(text[after:]):
            return text[start:value_end], len(text)
    close = text.find(HERMES_CLOSE, start)
    if close < 0:
        return text[start:], len(text)
    return text[start:close], close + len(HERMES_CLOSE)


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
        A ``ToolCallParser`` when the template writes Hermes ``<tool_call>`` blocks, or knows no
        tools (the engine then writes them as Hermes text: ``runtime.request.hermes_markup``),
        else None (a template with another tool format: calls are left in the text).
    """
    if chat_template and (HERMES_OPEN in chat_template or not knows_tools(chat_template)):
        return ToolCallParser()
    return None
