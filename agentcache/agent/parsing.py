"""Tool calls written as text by local chat templates: Hermes/Qwen ``<tool_call>`` JSON blocks.

``parse_hermes`` splits generated text into visible content, well-formed calls and error messages
for malformed blocks (which the agent sends back to the model). ``MarkupFilter`` hides the markup
from streamed output. Knows text formats only; never sees token ids or backends. The server's
parser (``runtime.serve.tool_parser``) behaves the same; one case table
(``tests/tool_call_cases.py``) runs against both, since the SDK may not import the runtime.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from agentcache.canonical import canonical_json

__all__ = ["CLOSE_TAG", "OPEN_TAG", "MarkupFilter", "ParsedText", "TextCall", "parse_hermes"]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_JSON_WHITESPACE = " \t\n\r"  # RFC 8259 section 2
_DECODER = json.JSONDecoder()


class TextCall(NamedTuple):
    """One well-formed call: tool name and canonical JSON arguments."""

    name: str
    arguments: str


class ParsedText(NamedTuple):
    """Generated text split into content, calls and errors (one per malformed block)."""

    content: str
    calls: list[TextCall]
    errors: list[str]


def parse_hermes(text: str) -> ParsedText:
    """Parse ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    The format is the NousResearch Hermes function-calling format, also used by the Qwen2.5 chat
    template and the bundled tiny model. A block's JSON ends where parsing it says
    (``json.JSONDecoder.raw_decode``), so ``</tool_call>`` inside a string argument is part of
    the argument; an unterminated last block is parsed too (generation may stop at max_tokens).

    Returns:
        ``ParsedText``: ``content`` is the text outside well-formed blocks (stripped when a call
        was found); a block whose body is not a JSON object with a string ``name`` and an object
        ``arguments`` (or ``parameters``; not both) stays in the content and yields an error
        message instead of a call.
    """
    calls: list[TextCall] = []
    errors: list[str] = []
    kept: list[str] = []
    pos = search = 0
    while (start := text.find(OPEN_TAG, search)) >= 0:
        body, search = _block(text, start + len(OPEN_TAG))
        body = body.strip()
        call, error = _parse_body(body)
        if call is None:
            errors.append(f"could not parse tool call {body[:200]!r}: {error}")
            continue
        kept.append(text[pos:start])
        pos = search
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept)
    return ParsedText(content.strip() if calls else content, calls, errors)


def _block(text: str, start: int) -> tuple[str, int]:
    """``(body, end)`` of the block whose open tag ends at ``start``: a body that is a whole JSON
    value followed by whitespace and the close tag (or the end of the text, or a cut-off close
    tag) ends with that value; any other ends at the first close tag or the end of the text."""
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
        if text.startswith(CLOSE_TAG, after):
            return text[start:value_end], after + len(CLOSE_TAG)
        if CLOSE_TAG.startswith(text[after:]):
            return text[start:value_end], len(text)
    close = text.find(CLOSE_TAG, start)
    if close < 0:
        return text[start:], len(text)
    return text[start:close], close + len(CLOSE_TAG)


def _parse_body(body: str) -> tuple[TextCall | None, str]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        return None, f"invalid JSON ({exc})"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None, 'expected {"name": "<tool>", "arguments": {...}}'
    if "arguments" in data and "parameters" in data:
        return None, 'give "arguments" or "parameters", not both'
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            return None, f"arguments are not valid JSON ({exc})"
    if not isinstance(arguments, dict):
        return None, "arguments must be a JSON object"
    return TextCall(data["name"], canonical_json(arguments)), ""


class MarkupFilter:
    """Streams text but holds back anything that is, or may become, a ``<tool_call>`` block."""

    def __init__(self) -> None:
        self._buffer = ""
        self._emitted = 0
        self._blocked = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the newly safe-to-show text (may be "")."""
        self._buffer += delta
        if self._blocked:
            return ""
        found = self._buffer.find(OPEN_TAG)
        if found >= 0:
            self._blocked = True
            return self._release(found)
        safe = len(self._buffer)
        for keep in range(min(len(OPEN_TAG) - 1, len(self._buffer)), 0, -1):
            if OPEN_TAG.startswith(self._buffer[-keep:]):
                safe = len(self._buffer) - keep
                break
        return self._release(safe)

    def flush(self) -> str:
        """End of stream: release held-back text that did not become a block."""
        return "" if self._blocked else self._release(len(self._buffer))

    def _release(self, upto: int) -> str:
        out = self._buffer[self._emitted : upto]
        self._emitted = max(self._emitted, upto)
        return out
