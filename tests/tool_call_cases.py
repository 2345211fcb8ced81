"""The one spec of Hermes ``<tool_call>`` parsing, as a case table run against both parsers.

The SDK (``agentcache.agent.parsing``) may not import the runtime and the runtime never imports
the SDK, so each has its own parser; ``tests/test_tool_call_spec.py`` runs every row here against
both, so they cannot drift apart.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Case(NamedTuple):
    id: str
    text: str
    content: str
    """Visible content after parsing."""
    calls: list[tuple[str, dict[str, Any]]]
    """(name, arguments) of every well-formed call, in order."""
    num_malformed: int = 0
    """Blocks that stay in the content as text (the SDK reports one error each)."""


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS = ("get_weather", {"city": "Paris"})

CASES = [
    Case("plain text unchanged", "  plain answer \n", "  plain answer \n", []),
    Case("one call, content is the rest", f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>",
         "Let me look.", [PARIS]),
    Case("two calls in order, string arguments",
         '<tool_call>{"name": "a", "arguments": {"z": 1}}</tool_call>\n'
         '<tool_call>{"name": "b", "arguments": "{\\"k\\": \\"v\\"}"}</tool_call>',
         "", [("a", {"z": 1}), ("b", {"k": "v"})]),
    Case("parameters instead of arguments",
         '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', "", [("f", {"x": 1})]),
    Case("no arguments means {}", '<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
    Case("both arguments and parameters",
         '<tool_call>{"name": "f", "arguments": {}, "parameters": {"x": 1}}</tool_call>',
         '<tool_call>{"name": "f", "arguments": {}, "parameters": {"x": 1}}</tool_call>', [], 1),
    Case("cut at max_tokens after whole JSON", f"ok <tool_call>\n{CALL}\n", "ok", [PARIS]),
    Case("cut at max_tokens inside the JSON", 'ok <tool_call>{"name": "get_wea',
         'ok <tool_call>{"name": "get_wea', [], 1),
    Case("malformed JSON stays as text", "before <tool_call>not json</tool_call> after",
         "before <tool_call>not json</tool_call> after", [], 1),
    Case("no name", '<tool_call>{"arguments": {}}</tool_call>',
         '<tool_call>{"arguments": {}}</tool_call>', [], 1),
    Case("empty name", '<tool_call>{"name": "", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "", "arguments": {}}</tool_call>', [], 1),
    Case("arguments not an object", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
         '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [], 1),
    Case("arguments string not JSON", '<tool_call>{"name": "f", "arguments": "{x"}</tool_call>',
         '<tool_call>{"name": "f", "arguments": "{x"}</tool_call>', [], 1),
    Case("body not an object", "<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>",
         [], 1),
    Case("a good call next to a bad one",
         f"<tool_call>{CALL}</tool_call> <tool_call>oops</tool_call>",
         "<tool_call>oops</tool_call>", [PARIS], 1),
    # Issue 35: a grammar-valid argument may contain the tags; the JSON's own end ends the block.
    Case("close tag inside a string argument",
         '<tool_call>\n{"name": "say", "arguments": {"text": "a </tool_call> b"}}\n</tool_call>',
         "", [("say", {"text": "a </tool_call> b"})]),
    Case("both tags inside arguments, then a second call",
         '<tool_call>{"name": "a", "arguments": {"s": "<tool_call>x</tool_call>"}}</tool_call>\n'
         '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
         "", [("a", {"s": "<tool_call>x</tool_call>"}), ("b", {})]),
    Case("close tag inside a string-encoded arguments value",
         '<tool_call>{"name": "f", "arguments": "{\\"s\\": \\"</tool_call>\\"}"}</tool_call>',
         "", [("f", {"s": "</tool_call>"})]),
    Case("close tag inside arguments, cut at max_tokens after the JSON",
         'ok <tool_call>{"name": "say", "arguments": {"text": "</tool_call>"}}\n',
         "ok", [("say", {"text": "</tool_call>"})]),
    Case("cut at max_tokens inside the close tag", f"<tool_call>\n{CALL}\n</tool_", "", [PARIS]),
    Case("text after the JSON stays malformed",
         '<tool_call>{"name": "f"} more</tool_call>', '<tool_call>{"name": "f"} more</tool_call>',
         [], 1),
    Case("malformed, close tag in a string: cut at the first close tag",
         '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}} x</tool_call>',
         '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}} x</tool_call>', [], 1),
]  # fmt: skip

HOLDBACK = [
    ("hello", 5),
    ("hello <tool", 6),
    ("hello <", 6),
    ("hello <tool_call>{", 6),
    ("<tool_call>", 0),
    ("a < b", 5),
    ("a <table>", 9),
    ("", 0),
]
"""(streamed text so far, how much of it may be shown): never a possible open tag or after one."""
