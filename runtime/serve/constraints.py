"""Which grammar a chat request decodes under: ``response_format`` and ``tool_choice`` as specs.

``json_object`` / ``json_schema`` become a JSON-schema grammar. Tools with a Hermes template
become an xgrammar structural tag over ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
(``runtime.sampling.tool_grammar``: ``auto`` text or calls, ``required`` calls only, named: that one
call, ``parallel_tool_calls=false``: at most one); ``tool_choice="none"`` excludes the
``<tool_call>`` tag from the text. It builds specs only; the engine compiles them and the
scheduler masks logits. It knows no HTTP and no engine internals.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.sampling.grammar import GrammarSpec, JsonSchemaSpec, StructuralTagSpec
from runtime.sampling.tool_grammar import no_tool_call_spec, tool_call_spec
from runtime.serve.api_error import ApiError
from runtime.serve.protocol import ChatCompletionRequest

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
        return _tool_call_tag(req)
    if fmt is not None and fmt.type == "json_object":
        return JsonSchemaSpec(None)
    if fmt is not None and fmt.json_schema is not None:
        schema = json.dumps(fmt.json_schema.schema_, sort_keys=True, separators=(",", ":"))
        return JsonSchemaSpec(schema, strict=fmt.json_schema.strict is not False)
    if req.tools and has_tool_format:
        # tool_choice="none": tools stay in the prompt (cacheable), calls are impossible.
        return no_tool_call_spec()
    return None


def _choice_name(req: ChatCompletionRequest) -> str:
    named = req.named_tool_choice()
    return f"function {named}" if named is not None else str(req.tool_choice or "auto")


def _tool_call_tag(req: ChatCompletionRequest) -> StructuralTagSpec:
    """The Hermes/Qwen tool-call structural tag for ``req``'s tools and choice."""
    tools: list[Any] = [
        tool.model_dump(exclude_none=True, by_alias=True) for tool in req.tools or []
    ]
    named = req.named_tool_choice()
    choice: Any = req.tool_choice or "auto"
    if named is not None:
        choice = {"type": "function", "function": {"name": named}}
    return tool_call_spec(tools, choice, parallel=req.parallel_tool_calls is not False)
