"""Response bodies: the final JSON of a request and its SSE chunk stream (chat and completions).

Builds ``chat.completion`` / ``text_completion`` objects and ``data: {...}`` events in the shape
the official ``openai`` client parses, one ``choices`` entry per choice (``index`` = prompt * n
+ choice, as OpenAI orders them), splitting tool calls out of the text. Usage counts each
prompt once and sums the completions. It knows the plan and the engine call it reads from; it
never validates input or decides admission.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from runtime.outputs import Completion, TokenLogprob, Usage
from runtime.serve.api_error import error_body
from runtime.serve.engine_call import EngineCall
from runtime.serve.logprobs import (
    CompletionLogprobs,
    HeldTokens,
    LoggedToken,
    chat_logprobs,
    cover_text,
)
from runtime.serve.metrics import Outcome
from runtime.serve.request_plan import RequestPlan
from runtime.serve.tool_parser import ParsedToolCall

__all__ = ["ChoiceStream", "final_json", "tool_call_dicts", "total_usage", "usage_dict"]

_log = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _head(plan: RequestPlan, *, chunk: bool) -> dict[str, Any]:
    kinds = {"chat": "chat.completion", "completion": "text_completion"}
    kind = kinds[plan.kind] + (".chunk" if chunk and plan.kind == "chat" else "")
    return {"id": plan.id, "object": kind, "created": plan.created, "model": plan.model}


Pending = list[LoggedToken]
"""Tokens whose logprobs are still to be sent."""


def _logprobs(
    plan: RequestPlan, pending: Pending, offsets: CompletionLogprobs | None
) -> dict[str, Any] | None:
    """The ``logprobs`` of a choice (or chunk) for ``pending``; None when not requested."""
    if plan.token_text is None:
        return None
    if plan.kind == "chat":
        return chat_logprobs(pending)
    return (offsets or CompletionLogprobs()).build(pending)


def _generated(
    plan: RequestPlan, entries: list[TokenLogprob] | None, token_ids: list[int]
) -> Pending:
    """Logged tokens of generated ids (``entries`` None: logprobs were not asked for)."""
    if plan.token_text is None or entries is None:
        return []
    write = plan.token_text.output
    return [LoggedToken(e, t, write) for e, t in zip(entries, token_ids, strict=True)]


def _output(plan: RequestPlan, completion: Completion) -> Pending:
    """The generated tokens the response shows: those that write its text (``cover_text``)."""
    if plan.is_output_dropped:
        return []
    return cover_text(_generated(plan, completion.logprobs, completion.token_ids), completion.text)


def _echoed(
    plan: RequestPlan, index: int, prompt_logprobs: list[TokenLogprob | None] | None
) -> Pending:
    """Choice ``index``'s echoed prompt tokens (empty without prompt logprobs)."""
    if prompt_logprobs is None or plan.token_text is None:
        return []
    write = plan.token_text.prompt
    ids = plan.prompts[index // plan.n]
    return [LoggedToken(e, t, write) for e, t in zip(prompt_logprobs, ids, strict=True)]


def _echo_text(plan: RequestPlan, index: int) -> str:
    return "" if plan.echo_texts is None else plan.echo_texts[index // plan.n] or ""


def total_usage(completions: list[Completion], n: int, *, is_output_dropped: bool = False) -> Usage:
    """Usage of a whole response: each prompt's tokens once (its first choice), outputs summed.

    Args:
        completions: every choice in ``index`` order (``n`` consecutive choices per prompt).
        n: choices per prompt.
        is_output_dropped: ``max_tokens=0`` with ``echo``: the one generated token is not sent
            and not counted.
    """
    firsts = completions[::n]
    return Usage(
        prompt_tokens=sum(c.usage.prompt_tokens for c in firsts),
        cached_tokens=sum(c.usage.cached_tokens for c in firsts),
        completion_tokens=0
        if is_output_dropped
        else sum(c.usage.completion_tokens for c in completions),
        # NOTE: chunk reuse is refused for a batch of prompts: one prompt, one record.
        chunk_reuse=firsts[0].usage.chunk_reuse if len(firsts) == 1 else None,
    )


def _usage(plan: RequestPlan, completions: list[Completion]) -> dict[str, Any]:
    return usage_dict(total_usage(completions, plan.n, is_output_dropped=plan.is_output_dropped))


def _outcome(finishes: list[Outcome]) -> Outcome:
    """One request's outcome from its choices' finish reasons: tool calls if any made one."""
    return "tool_calls" if "tool_calls" in finishes else finishes[0]


def final_json(plan: RequestPlan, completions: list[Completion]) -> tuple[dict[str, Any], Outcome]:
    """The non-streaming response body (choices in ``index`` order) and the request's outcome."""
    body = _head(plan, chunk=False)
    body["choices"] = [_final_choice(plan, i, c) for i, c in enumerate(completions)]
    body["usage"] = _usage(plan, completions)
    return body, _outcome([choice["finish_reason"] for choice in body["choices"]])


def _call_finish(completion: Completion) -> Outcome:
    """The finish reason of a choice that made tool calls: ``"tool_calls"``, unless ``max_tokens``
    cut the output (``"length"``, as OpenAI reports it; a call cut off stays text)."""
    return "length" if completion.finish_reason == "length" else "tool_calls"


def _final_choice(plan: RequestPlan, index: int, completion: Completion) -> dict[str, Any]:
    finish: Outcome = completion.finish_reason
    if plan.kind == "completion":
        text = "" if plan.is_output_dropped else completion.text
        choice: dict[str, Any] = {"index": index, "text": _echo_text(plan, index) + text}
    else:
        content, calls = completion.text, list[ParsedToolCall]()
        if plan.parser is not None:
            content, calls = plan.parser.parse(completion.text)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            finish = _call_finish(completion)
            message["tool_calls"] = tool_call_dicts(calls, f"{plan.id}_{index}")
            for call in message["tool_calls"]:
                del call["index"]
        else:
            message["content"] = content
        choice = {"index": index, "message": message, "logprobs": None}
    pending = _echoed(plan, index, completion.prompt_logprobs) + _output(plan, completion)
    choice["logprobs"] = _logprobs(plan, pending, None)
    choice["finish_reason"] = finish
    return choice


class _ChoiceText:
    """One streamed choice: text sent and held back (tool call), logprobs not yet sent."""

    def __init__(self, plan: RequestPlan) -> None:
        self.text = ""
        self.sent = 0
        self.logprobs: Pending = []
        """Logprobs of tokens not yet sent; the choice's next chunk of any kind carries them."""
        self.held = HeldTokens()
        """Generated tokens whose text is not all final yet (moved to ``logprobs`` once it is)."""
        self.is_started = False
        """True once the choice's first delta arrived (and its echo, if any, went out)."""
        self.offsets = None if plan.token_text is None else CompletionLogprobs()


class ChoiceStream:
    """SSE events of one streaming request (every choice), starting from its first engine delta.

    With a tool parser, a choice's text is streamed only up to a possible ``<tool_call>`` tag;
    the rest is held and parsed when that choice finishes (calls are then sent whole, one chunk).
    ``outcome`` is the stream's own result once ``events`` ended: "tool_calls" if a choice made
    one, else the first choice's finish reason, or "error"; None while unfinished or when the
    client left first.
    """

    def __init__(self, plan: RequestPlan, call: EngineCall, first: Any) -> None:
        self._plan = plan
        self._call = call
        self._first = first
        self._choices = [_ChoiceText(plan) for _ in range(call.num_choices)]
        self._finishes: list[Outcome] = []
        self.outcome: Outcome | None = None

    def _chunk(
        self,
        index: int,
        *,
        text: str | None = None,
        extra: dict[str, Any] | None = None,
        finish: str | None,
    ) -> str:
        body = _head(self._plan, chunk=True)
        if self._plan.kind == "chat":
            delta: dict[str, Any] = dict(extra or {})
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice["logprobs"] = None
        state = self._choices[index]
        if state.logprobs:
            choice["logprobs"] = _logprobs(self._plan, state.logprobs, state.offsets)
            state.logprobs = []
        choice["finish_reason"] = finish
        body["choices"] = [choice]
        if self._plan.include_usage:
            body["usage"] = None
        return _event(body)

    def _feed(self, index: int, text: str) -> str:
        """Add new text to choice ``index``; return the part that can be sent as content now."""
        state = self._choices[index]
        state.text += text
        parser = self._plan.parser
        safe = len(state.text) if parser is None else parser.safe_prefix_len(state.text)
        out = state.text[state.sent : max(safe, state.sent)]
        state.sent += len(out)
        return out

    def _finish(self, index: int, completion: Completion) -> list[str]:
        """Events after a choice's last delta: held text, tool calls and its finish chunk."""
        events: list[str] = []
        state = self._choices[index]
        state.logprobs += state.held.finish(state.text)
        rest = state.text[state.sent :]
        finish: Outcome = completion.finish_reason
        if self._plan.parser is not None and rest:
            rest, calls = self._plan.parser.parse(rest)
            if calls:
                finish = _call_finish(completion)
                if rest:
                    events.append(self._chunk(index, text=rest, finish=None))
                rest = ""
                extra = {"tool_calls": tool_call_dicts(calls, f"{self._plan.id}_{index}")}
                events.append(self._chunk(index, extra=extra, finish=None))
        if rest:
            events.append(self._chunk(index, text=rest, finish=None))
        end_text = None if self._plan.kind == "chat" else ""
        events.append(self._chunk(index, text=end_text, finish=finish))
        self._finishes.append(finish)
        return events

    def _usage_event(self) -> str:
        usage = _head(self._plan, chunk=True)
        usage["choices"] = []
        done = [c for c in self._call.completions if c is not None]
        usage["usage"] = _usage(self._plan, done)
        return _event(usage)

    async def events(self) -> AsyncIterator[str]:
        """Yield ``data: ...`` events, ending with ``data: [DONE]``."""
        if self._plan.kind == "chat":
            for index in range(len(self._choices)):
                yield self._chunk(index, text="", extra={"role": "assistant"}, finish=None)
        try:
            item = self._first
            while item is not None:
                index, delta = item
                state = self._choices[index]
                if not state.is_started:
                    state.is_started = True
                    if self._plan.echo_texts is not None:
                        state.logprobs = _echoed(self._plan, index, delta.prompt_logprobs)
                        yield self._chunk(index, text=_echo_text(self._plan, index), finish=None)
                if not self._plan.is_output_dropped:
                    state.held.add(_generated(self._plan, delta.logprobs, delta.token_ids))
                out = "" if self._plan.is_output_dropped else self._feed(index, delta.text)
                state.logprobs += state.held.release(state.text)
                if out:
                    yield self._chunk(index, text=out, finish=None)
                if delta.completion is not None:
                    for event in self._finish(index, delta.completion):
                        yield event
                item = await self._call.next()
            if any(c is None for c in self._call.completions):
                raise RuntimeError("engine stream ended without a completion")
            if self._plan.include_usage:
                yield self._usage_event()
            self.outcome = _outcome(self._finishes)
        except Exception as exc:  # the engine failed mid-stream: tell the client, keep serving
            _log.exception("stream %s failed", self._plan.id)
            self.outcome = "error"
            yield _event(error_body(f"generation failed: {exc}", type="server_error"))
        yield DONE


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens``; with chunk reuse also
    ``chunk_reuse: {mode, reused_tokens, recomputed_tokens, missed_tokens}`` (our extension)."""
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    chunk = usage.chunk_reuse
    if chunk is not None:
        out["chunk_reuse"] = {
            "mode": chunk.mode,
            "reused_tokens": chunk.reused_tokens,
            "recomputed_tokens": chunk.recomputed_tokens,
            "missed_tokens": chunk.missed_tokens,
        }
    return out


def tool_call_dicts(calls: list[ParsedToolCall], id_prefix: str) -> list[dict[str, Any]]:
    """Calls in the OpenAI message shape, with ids ``call_<request>_<i>`` unique per response."""
    return [
        {
            "index": i,
            "id": f"call_{id_prefix}_{i}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for i, call in enumerate(calls)
    ]
