"""Tool calls written as text by local chat templates: Hermes/Qwen ``<tool_call>`` JSON blocks.

``parse_hermes`` splits generated text into visible content, well-formed calls and error messages
for malformed blocks (which the agent sends back to the model). ``MarkupFilter`` hides the markup
from streamed output. Knows text formats only; never sees token ids or backends. The server's
parser (``runtime.serve.tool_parser``) behaves the same; one case table
(``tests/tool_call_cases.py``) runs against both, since the SDK may not import the runtime.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from agentcache.canonical import canonical_json

__all__ = ["CLOSE_TAG", "OPEN_TAG", "MarkupFilter", "ParsedText", "TextCall", "parse_hermes"]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# NOTE: a block ends at its close tag or at the end of the text (generation cut at max_tokens).
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)(?:" + re.escape(CLOSE_TAG) + r"|\Z)", re.DOTALL)


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
    template and the bundled tiny model. An unterminated last block is parsed too (generation
    may stop at max_tokens).

    Returns:
        ``ParsedText``: ``content`` is the text outside well-formed blocks (stripped when a call
        was found); a block whose body is not a JSON object with a string ``name`` and an object
        ``arguments`` (or ``parameters``; not both) stays in the content and yields an error
        message instead of a call.
    """
    calls: list[TextCall] = []
    errors: list[str] = []
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        body = match.group(1).strip()
        call, error = _parse_body(body)
        if call is None:
            errors.append(f"could not parse tool call {body[:200]!r}: {error}")
            continue
        kept.append(text[pos : match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept)
    return ParsedText(content.strip() if calls else content, calls, errors)


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
