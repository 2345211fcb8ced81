"""Which grammar a chat request decodes under: ``response_format`` and ``tool_choice`` as specs.

``json_object`` / ``json_schema`` become a JSON-schema grammar. Tools with a Hermes template
become an xgrammar structural tag over ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
(Qwen's layout, newlines inside the tags) whose arguments follow each declared tool's schema
(``auto``: text or calls, ``required``: one or more calls and no text, named: that one call,
``parallel_tool_calls=false``: at most one); ``tool_choice="none"`` excludes the ``<tool_call>``
tag from the text. It builds specs only; the engine compiles them and the scheduler masks
logits. It knows no HTTP and no engine internals.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.grammar import GrammarSpec, JsonSchemaSpec, StructuralTagSpec
from runtime.serve.api_error import ApiError
from runtime.serve.protocol import ChatCompletionRequest
from runtime.serve.tool_parser import HERMES_OPEN

__all__ = ["grammar_spec"]


def grammar_spec(req: ChatCompletionRequest, *, has_tool_format: bool) -> GrammarSpec | None:
    """The grammar ``req`` must decode under, or None for free text.

    Args:
        req: the validated chat request (tools already checked: unique names, a named choice
            among them, ``required`` only with tools).
        has_tool_format: the chat template writes Hermes ``<tool_call>`` blocks.

    Raises:
        ApiError: 400 when tools must be enforced but the template has no known call format,
            or when ``response_format`` JSON is combined with tool calls.
    """
    fmt = req.response_format
    wants_json = fmt is not None and fmt.type != "text"
    choice = req.tool_choice
    if req.tools and choice != "none":
        if wants_json:
            raise ApiError(
                400,
                "response_format JSON and tool calls cannot be enforced together; "
                'set tool_choice to "none" or drop response_format',
                param="response_format",
                code="unsupported_value",
            )
        if not has_tool_format:
            if choice in (None, "auto"):
                return None  # NOTE: calls are left in the text, as before (no known format).
            raise ApiError(
                400,
                "this model's chat template has no known tool-call format, so tool_choice "
                f"{_choice_name(req)!r} cannot be enforced",
                param="tool_choice",
                code="unsupported_value",
            )
        return StructuralTagSpec(_tool_call_tag(req))
    if fmt is not None and fmt.type == "json_object":
        return JsonSchemaSpec(None)
    if fmt is not None and fmt.json_schema is not None:
        schema = json.dumps(fmt.json_schema.schema_, sort_keys=True, separators=(",", ":"))
        return JsonSchemaSpec(schema, strict=fmt.json_schema.strict is not False)
    if req.tools and has_tool_format:
        # tool_choice="none": tools stay in the prompt (cacheable), calls are impossible.
        tag = {"type": "structural_tag", "format": {"type": "any_text", "excludes": [HERMES_OPEN]}}
        return StructuralTagSpec(json.dumps(tag, sort_keys=True))
    return None


def _choice_name(req: ChatCompletionRequest) -> str:
    named = req.named_tool_choice()
    return f"function {named}" if named is not None else str(req.tool_choice or "auto")


def _tool_call_tag(req: ChatCompletionRequest) -> str:
    """The Hermes/Qwen tool-call structural tag for ``req``'s tools and choice (JSON text)."""
    import xgrammar as xgr

    tools: list[Any] = [
        tool.model_dump(exclude_none=True, by_alias=True) for tool in req.tools or []
    ]
    named = req.named_tool_choice()
    choice: Any = req.tool_choice or "auto"
    if named is not None:
        choice = {"type": "function", "function": {"name": named}}
    tag = xgr.get_model_structural_tag(
        "qwen_3",
        tools=tools,
        tool_choice=choice,
        reasoning="disabled",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        max_whitespace_cnt=_MAX_WHITESPACE,
    )
    body: dict[str, Any] = tag.model_dump(mode="json")
    if choice == "required":
        body["format"] = _calls_only(body["format"])
    return json.dumps(body, sort_keys=True)


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


_MAX_WHITESPACE = 2
"""Longest whitespace run inside tool arguments (bounds a weak model's newline loops)."""
