"""Token-stable prompts: ids of turn N must be a strict prefix of the ids of turn N+1.

Tokenizing a whole rendered conversation lets text at a boundary merge into one token with what
follows (``"Assistant: "`` + ``"Hi"`` -> ``" Hi"``), so the ids of an earlier turn stop being a
prefix. ``stable_token_ids`` renders the chat template one message at a time and tokenizes each
piece on its own, splitting assistant turns after the generation prompt, which is where the
engine appends generated ids. Templates that rewrite earlier messages (e.g. strip old reasoning)
are detected and reported. The tokenizer is duck-typed (HF ``apply_chat_template`` + ``encode``);
this module never imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from agentcache.exceptions import PromptError
from agentcache.prompt.builder import Prompt

__all__ = [
    "ChatTokenizer",
    "TemplateRewritesHistoryError",
    "TokenPrefixReport",
    "check_token_prefix",
    "naive_token_ids",
    "stable_token_ids",
]


class ChatTokenizer(Protocol):
    """The part of an HF tokenizer used here."""

    def apply_chat_template(self, conversation: Any, /, **kwargs: Any) -> Any: ...

    def encode(self, text: str, /, *args: Any, **kwargs: Any) -> Any: ...


class TemplateRewritesHistoryError(PromptError):
    """The chat template renders an earlier message differently once later messages follow.

    Attributes:
        message_index: Index (in ``Prompt.to_messages()``) of the first message rendered anew.
    """

    def __init__(self, message: str, *, message_index: int) -> None:
        super().__init__(message)
        self.message_index = message_index


@dataclass(frozen=True, slots=True)
class TokenPrefixReport:
    """Whether the ids of prompt A are a strict prefix of the ids of prompt B, and if not why.

    Attributes:
        is_prefix: A's ids are a prefix of B's ids and B is longer.
        common_len: Number of leading ids the two share.
        len_a: Number of ids of A; ``len_b`` likewise.
        reason: ``ok``, ``boundary_merge`` (text is a prefix, ids are not), ``history_rewritten``
            (the chat template re-renders earlier messages; the ids counted are then whole-text
            ids) or ``content_changed`` (a message or the tools differ).
        message_index: Index in ``to_messages()``: the first message that differs
            (``content_changed``) or the message the template rendered anew
            (``history_rewritten``); ``None`` when no message is to blame (e.g. tools changed).
    """

    is_prefix: bool
    common_len: int
    len_a: int
    len_b: int
    reason: Literal["ok", "boundary_merge", "history_rewritten", "content_changed"]
    message_index: int | None = None


def _render(tok: ChatTokenizer, messages: list[Any], tools: Any, gen: bool) -> str:
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    if not isinstance(text, str):
        raise PromptError("apply_chat_template(tokenize=False) did not return text")
    return text


def _encode(tok: ChatTokenizer, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    return [int(i) for i in ids]


def render_pieces(
    tokenizer: ChatTokenizer, prompt: Prompt, *, add_generation_prompt: bool = True
) -> list[str]:
    """The chat-template text of ``prompt`` cut at message and generation-prompt boundaries.

    Raises:
        TemplateRewritesHistoryError: rendering ``messages[:k+1]`` does not start with the
            rendering of ``messages[:k]``.
    """
    messages = prompt.to_messages()
    tools = prompt.tool_schemas() or None
    pieces: list[str] = []
    ends: list[int] = []  # NOTE: ends[j] = length of the rendering of messages[: j + 1]
    previous = ""
    for k in range(1, len(messages) + 1):
        text = _render(tokenizer, messages[:k], tools, False)
        _require_extends(previous, text, ends, k - 1)
        delta = text[len(previous) :]
        if messages[k - 1]["role"] == "assistant" and k > 1:
            gen = _render(tokenizer, messages[: k - 1], tools, True)[len(previous) :]
            if gen and delta.startswith(gen):
                pieces.append(gen)
                delta = delta[len(gen) :]
        pieces.append(delta)
        previous = text
        ends.append(len(text))
    if add_generation_prompt:
        full = _render(tokenizer, messages, tools, True)
        _require_extends(previous, full, ends, len(messages))
        pieces.append(full[len(previous) :])
    return [piece for piece in pieces if piece]


def _require_extends(previous: str, text: str, ends: list[int], index: int) -> None:
    """Raise unless ``text`` (``previous`` plus message ``index``) starts with ``previous``."""
    if text.startswith(previous):
        return
    limit = min(len(previous), len(text))
    at = next((i for i in range(limit) if previous[i] != text[i]), limit)
    anew = next((j for j, end in enumerate(ends) if end > at), index)
    raise TemplateRewritesHistoryError(
        f"the chat template renders message {anew} anew once message {index} follows (text "
        f"differs at offset {at}); such templates cannot keep a token prefix",
        message_index=anew,
    )


def stable_token_ids(
    tokenizer: ChatTokenizer, prompt: Prompt, *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of ``prompt`` with boundaries that later turns cannot re-tokenize.

    Raises:
        TemplateRewritesHistoryError: see ``render_pieces``.
    """
    pieces = render_pieces(tokenizer, prompt, add_generation_prompt=add_generation_prompt)
    return [i for piece in pieces for i in _encode(tokenizer, piece)]


def naive_token_ids(
    tokenizer: ChatTokenizer, prompt: Prompt, *, add_generation_prompt: bool = True
) -> list[int]:
    """Ids from tokenizing the whole rendered conversation at once (may merge at boundaries)."""
    text = _render(tokenizer, prompt.to_messages(), prompt.tool_schemas() or None, True)
    if not add_generation_prompt:
        text = _render(tokenizer, prompt.to_messages(), prompt.tool_schemas() or None, False)
    return _encode(tokenizer, text)


def check_token_prefix(
    tokenizer: ChatTokenizer, prompt_a: Prompt, prompt_b: Prompt, *, stable: bool = True
) -> TokenPrefixReport:
    """Check that A's ids (with generation prompt) are a strict prefix of B's ids.

    When the chat template renders an earlier message anew (so ``stable_token_ids`` cannot cut
    either prompt), the report says ``history_rewritten`` with ``is_prefix=False``, counts
    whole-text ids (``naive_token_ids``) for ``common_len`` and the lengths, and names the message
    rendered anew.

    Args:
        tokenizer: HF tokenizer with a chat template.
        prompt_a: The earlier turn.
        prompt_b: The later turn (same system/tools/documents, history extended).
        stable: Use ``stable_token_ids`` (default) or ``naive_token_ids``.
    """
    ids_for = stable_token_ids if stable else naive_token_ids
    try:
        ids_a = ids_for(tokenizer, prompt_a)
        ids_b = ids_for(tokenizer, prompt_b)
    except TemplateRewritesHistoryError as exc:
        ids_a = naive_token_ids(tokenizer, prompt_a)
        ids_b = naive_token_ids(tokenizer, prompt_b)
        common = _common_len(ids_a, ids_b)
        return TokenPrefixReport(
            False, common, len(ids_a), len(ids_b), "history_rewritten", exc.message_index
        )
    common = _common_len(ids_a, ids_b)
    if common == len(ids_a) < len(ids_b):
        return TokenPrefixReport(True, common, len(ids_a), len(ids_b), "ok")
    text_a = _render(tokenizer, prompt_a.to_messages(), prompt_a.tool_schemas() or None, True)
    text_b = _render(tokenizer, prompt_b.to_messages(), prompt_b.tool_schemas() or None, True)
    reason: Literal["boundary_merge", "history_rewritten", "content_changed"]
    msgs_a, msgs_b = prompt_a.to_messages(), prompt_b.to_messages()
    index = next((i for i, (x, y) in enumerate(zip(msgs_a, msgs_b, strict=False)) if x != y), None)
    if text_b.startswith(text_a):
        reason = "boundary_merge"
    elif index is None and prompt_a.tool_schemas() == prompt_b.tool_schemas():
        reason = "history_rewritten"
    else:
        reason = "content_changed"  # NOTE: a message, or the tools (no message index), changed
    return TokenPrefixReport(False, common, len(ids_a), len(ids_b), reason, index)


def _common_len(ids_a: list[int], ids_b: list[int]) -> int:
    limit = min(len(ids_a), len(ids_b))
    return next((i for i in range(limit) if ids_a[i] != ids_b[i]), limit)
