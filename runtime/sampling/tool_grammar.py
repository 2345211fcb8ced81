"""Grammars of Hermes tool calls: ``tool_choice`` as an xgrammar structural tag spec.

Tools with a Hermes template become a structural tag over
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen's layout, newlines inside the
tags) whose arguments follow each declared tool's schema (``auto``: text or calls,
``required``: one or more calls and no text, named: that one call, ``parallel=False``: at most
one); ``none`` excludes the ``<tool_call>`` tag from the text. Shared by the server's
``tool_choice`` and the SDK's local backend; builds specs only (the engine compiles them).
"""

from __future__ import annotations

import json
from typing import Any, cast

from runtime.sampling.grammar import StructuralTagSpec

__all__ = ["HERMES_OPEN", "ToolChoice", "no_tool_call_spec", "tool_call_spec"]

HERMES_OPEN = "<tool_call>"
"""The opening tag of a Hermes tool-call block."""

ToolChoice = str | dict[str, Any]
"""``"auto"``, ``"required"`` or OpenAI's named choice ``{"type": "function", ...}``."""

_MAX_WHITESPACE = 2
"""Longest whitespace run inside tool arguments (bounds a weak model's newline loops)."""


def tool_call_spec(
    tools: list[dict[str, Any]], choice: ToolChoice = "auto", *, parallel: bool = True
) -> StructuralTagSpec:
    """The Hermes/Qwen tool-call structural tag for OpenAI-format ``tools`` and ``choice``.

    Args:
        tools: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``.
        choice: ``"auto"`` (text or calls), ``"required"`` (calls only, at least one) or a
            named choice (that one call).
        parallel: False allows at most one call.
    """
    import xgrammar as xgr

    tag = xgr.get_model_structural_tag(
        "qwen_3",
        tools=cast(Any, tools),
        tool_choice=cast(Any, choice),
        reasoning="disabled",
        parallel_tool_calls=parallel,
        max_whitespace_cnt=_MAX_WHITESPACE,
    )
    body: dict[str, Any] = tag.model_dump(mode="json")
    if choice == "required":
        body["format"] = _calls_only(body["format"])
    return StructuralTagSpec(json.dumps(body, sort_keys=True))


def no_tool_call_spec() -> StructuralTagSpec:
    """Free text that never contains ``<tool_call>`` (``tool_choice="none"``)."""
    tag = {"type": "structural_tag", "format": {"type": "any_text", "excludes": [HERMES_OPEN]}}
    return StructuralTagSpec(json.dumps(tag, sort_keys=True))


def _calls_only(triggered: dict[str, Any]) -> dict[str, Any]:
    """``required``: xgrammar's triggered tags, with no text before, between or after the calls.

    NOTE: xgrammar's ``qwen_3`` tag for ``required`` is ``triggered_tags`` with ``at_least_one``,
    which still allows free text around the calls (a weak model wrote text after its call,
    returned as ``content`` next to ``tool_calls``). OpenAI's ``required`` answers with tool
    calls only, so the same tags become ``tags_with_separator``: one call, or several (when
    parallel calls are allowed) separated by the newline Qwen's chat template puts between them.
    """
    assert triggered["type"] == "triggered_tags", f"unexpected xgrammar tag {triggered['type']!r}"
    return {
        "type": "tags_with_separator",
        "tags": triggered["tags"],
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": triggered["stop_after_first"],
    }
