"""Response bodies: the final JSON of a request and its SSE chunk stream (chat and completions).

Builds ``chat.completion`` / ``text_completion`` objects and ``data: {...}`` events in the shape
the official ``openai`` client parses, splitting tool calls out of the text. It knows the plan
and the engine call it reads from; it never validates input or decides admission.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from runtime.outputs import Completion, StreamDelta, TokenLogprob, Usage
from runtime.serve.engine_call import EngineCall
from runtime.serve.logprobs import CompletionLogprobs, chat_logprobs
from runtime.serve.metrics import Outcome
from runtime.serve.protocol import error_body, tool_call_dicts, usage_dict
from runtime.serve.request_plan import RequestPlan
from runtime.serve.tool_parser import ParsedToolCall

__all__ = ["ChoiceStream", "final_json"]

_log = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _head(plan: RequestPlan, *, chunk: bool) -> dict[str, Any]:
    kinds = {"chat": "chat.completion", "completion": "text_completion"}
    kind = kinds[plan.kind] + (".chunk" if chunk and plan.kind == "chat" else "")
    return {"id": plan.id, "object": kind, "created": plan.created, "model": plan.model}


def _logprobs(
    plan: RequestPlan,
    pending: list[tuple[TokenLogprob | None, int]],
    offsets: CompletionLogprobs | None,
) -> dict[str, Any] | None:
    """The ``logprobs`` of a choice (or chunk) for ``(entry, token id)`` pairs; None when not
    requested. An entry is None only for the first prompt token under ``echo``."""
    if plan.token_text is None:
        return None
    if plan.kind == "chat":
        return chat_logprobs([e for e, _ in pending if e is not None], plan.token_text)
    offsets = offsets or CompletionLogprobs(plan.token_text)
    return offsets.build([e for e, _ in pending], [t for _, t in pending])


def _output(plan: RequestPlan, completion: Completion) -> list[tuple[TokenLogprob | None, int]]:
    """``(logprob, id)`` of the generated tokens the response shows."""
    if plan.is_output_dropped:
        return []
    entries: list[TokenLogprob | None] = [None] * len(completion.token_ids)
    if completion.logprobs is not None:
        entries = list(completion.logprobs)
    return list(zip(entries, completion.token_ids, strict=True))


def _echoed(plan: RequestPlan, prompt_logprobs: list[TokenLogprob | None] | None) -> list[Any]:
    """``(logprob, id)`` of the echoed prompt tokens (empty without prompt logprobs)."""
    if prompt_logprobs is None or not isinstance(plan.prompt, list):
        return []
    return list(zip(prompt_logprobs, plan.prompt, strict=True))


def _usage(plan: RequestPlan, completion: Completion) -> dict[str, Any]:
    usage = completion.usage
    if plan.is_output_dropped:
        usage = Usage(usage.prompt_tokens, usage.cached_tokens, 0)
    return usage_dict(usage)


def final_json(plan: RequestPlan, completion: Completion) -> tuple[dict[str, Any], Outcome]:
    """The non-streaming response body for a finished request, and its ``finish_reason``."""
    body = _head(plan, chunk=False)
    finish: Outcome = completion.finish_reason
    if plan.kind == "completion":
        text = "" if plan.is_output_dropped else completion.text
        choice: dict[str, Any] = {"index": 0, "text": (plan.echo_text or "") + text}
    else:
        content, calls = completion.text, list[ParsedToolCall]()
        if plan.parser is not None:
            content, calls = plan.parser.parse(completion.text)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            finish = "tool_calls"
            message["tool_calls"] = tool_call_dicts(calls, plan.id)
            for call in message["tool_calls"]:
                del call["index"]
        else:
            message["content"] = content
        choice = {"index": 0, "message": message, "logprobs": None}
    pending = _echoed(plan, completion.prompt_logprobs) + _output(plan, completion)
    choice["logprobs"] = _logprobs(plan, pending, None)
    choice["finish_reason"] = finish
    body["choices"] = [choice]
    body["usage"] = _usage(plan, completion)
    return body, finish


class ChoiceStream:
    """SSE events of one streaming request, starting from its first engine delta.

    With a tool parser, text is streamed only up to a possible ``<tool_call>`` tag; the rest is
    held and parsed when the request finishes (calls are then sent whole, one chunk).
    ``outcome`` is this stream's own result once ``events`` ended: the finish reason sent, or
    "error"; None while unfinished or when the client left first.
    """

    def __init__(self, plan: RequestPlan, call: EngineCall, first: StreamDelta | None) -> None:
        self._plan = plan
        self._call = call
        self._first = first
        self._text = ""
        self._sent = 0
        self._logprobs: list[tuple[TokenLogprob | None, int]] = []
        """``(logprob, id)`` of tokens not yet sent; the next chunk of any kind carries them."""
        self._offsets = CompletionLogprobs(plan.token_text) if plan.token_text is not None else None
        self.outcome: Outcome | None = None

    def _chunk(
        self, *, text: str | None = None, extra: dict[str, Any] | None = None, finish: str | None
    ) -> str:
        body = _head(self._plan, chunk=True)
        if self._plan.kind == "chat":
            delta: dict[str, Any] = dict(extra or {})
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice["logprobs"] = None
        if self._logprobs:
            choice["logprobs"] = _logprobs(self._plan, self._logprobs, self._offsets)
            self._logprobs = []
        choice["finish_reason"] = finish
        body["choices"] = [choice]
        if self._plan.include_usage:
            body["usage"] = None
        return _event(body)

    def _feed(self, text: str) -> str:
        """Add new text; return the part that can be sent as content now."""
        self._text += text
        parser = self._plan.parser
        safe = len(self._text) if parser is None else parser.safe_prefix_len(self._text)
        out = self._text[self._sent : max(safe, self._sent)]
        self._sent += len(out)
        return out

    def _finish(self, completion: Completion) -> tuple[list[str], Outcome]:
        """Events after the last delta (held text, tool calls, finish, usage) and the finish."""
        events: list[str] = []
        rest = self._text[self._sent :]
        finish: Outcome = completion.finish_reason
        if self._plan.parser is not None and rest:
            rest, calls = self._plan.parser.parse(rest)
            if calls:
                finish = "tool_calls"
                if rest:
                    events.append(self._chunk(text=rest, finish=None))
                rest = ""
                extra = {"tool_calls": tool_call_dicts(calls, self._plan.id)}
                events.append(self._chunk(extra=extra, finish=None))
        if rest:
            events.append(self._chunk(text=rest, finish=None))
        events.append(self._chunk(text=None if self._plan.kind == "chat" else "", finish=finish))
        if self._plan.include_usage:
            usage = _head(self._plan, chunk=True)
            usage["choices"] = []
            usage["usage"] = _usage(self._plan, completion)
            events.append(_event(usage))
        return events, finish

    async def events(self) -> AsyncIterator[str]:
        """Yield ``data: ...`` events, ending with ``data: [DONE]``."""
        if self._plan.kind == "chat":
            yield self._chunk(text="", extra={"role": "assistant"}, finish=None)
        if self._plan.echo_text is not None:
            first = self._first
            self._logprobs = _echoed(self._plan, first.prompt_logprobs if first else None)
            yield self._chunk(text=self._plan.echo_text, finish=None)
        try:
            delta = self._first
            while delta is not None:
                if not self._plan.is_output_dropped:
                    self._logprobs.extend(zip(delta.logprobs, delta.token_ids, strict=False))
                out = "" if self._plan.is_output_dropped else self._feed(delta.text)
                if out:
                    yield self._chunk(text=out, finish=None)
                if delta.completion is not None:
                    break
                delta = await self._call.next()
            if self._call.completion is None:
                raise RuntimeError("engine stream ended without a completion")
            events, finish = self._finish(self._call.completion)
            for event in events:
                yield event
            self.outcome = finish
        except Exception as exc:  # the engine failed mid-stream: tell the client, keep serving
            _log.exception("stream %s failed", self._plan.id)
            self.outcome = "error"
            yield _event(error_body(f"generation failed: {exc}", type="server_error"))
        yield DONE
