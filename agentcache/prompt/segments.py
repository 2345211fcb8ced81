"""Segment kinds, documents and chat messages in canonical form.

A prompt is a sequence of segments in stability order (system, tools, documents, history, user,
volatile). This module defines those records and the canonical form of documents and OpenAI-style
chat messages; it knows nothing about fingerprints, providers or tokenizers.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from agentcache.canonical import JSONValue, canonical_json, normalize_text, to_canonical
from agentcache.exceptions import CanonicalizationError, PromptError, PromptTypeError

__all__ = [
    "STABLE_KINDS",
    "Document",
    "Message",
    "Segment",
    "SegmentKind",
    "normalize_documents",
    "normalize_message",
]

SegmentKind: TypeAlias = Literal["system", "tools", "documents", "history", "user", "volatile"]
STABLE_KINDS: tuple[SegmentKind, ...] = ("system", "tools", "documents")
"""Segments expected to stay byte-identical across turns and requests."""
Message: TypeAlias = dict[str, JSONValue]
_CACHE_SIZE = 4096
_MESSAGE_CACHE: dict[str, Message] = {}
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_REQUIRED: Any = object()
"""Default of Document's required fields: marks one the caller left out."""


@dataclass(frozen=True)
class Document:
    """A retrieved or pinned document placed in the documents segment.

    Attributes:
        id: Stable identifier (e.g. ``path#chunk-3``); documents are ordered and de-duplicated
            by it.
        text: Document text; rendered NFC with trailing whitespace removed.
        source: Optional origin shown to the model (path, URL).
        metadata: Caller data (scores, timestamps); never rendered into the prompt, only linted.
    """

    # NOTE: the _REQUIRED defaults only let a missing id/text raise PromptTypeError (like a
    # wrong one) instead of dataclass's bare TypeError; both are still required.
    id: str = _REQUIRED
    text: str = _REQUIRED
    source: str | None = None
    metadata: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        """Check field types now, not when the prompt is built.

        Raises:
            PromptTypeError: ``id`` or ``text`` is missing, ``id`` is not a non-empty str,
                ``text`` is not a str, or ``source`` is neither None nor a str.
        """
        for name in ("id", "text"):
            if getattr(self, name) is _REQUIRED:
                raise PromptTypeError(
                    f"Document needs an {name}, e.g. Document(id='notes.md#chunk-3', text='...')"
                )
        if not isinstance(self.id, str) or not self.id:
            raise PromptTypeError(f"Document id must be a non-empty str, got {self.id!r}")
        if not isinstance(self.text, str):
            kind = type(self.text).__name__
            raise PromptTypeError(f"Document {self.id!r}: text must be a str, got {kind}")
        if self.source is not None and not isinstance(self.source, str):
            kind = type(self.source).__name__
            raise PromptTypeError(f"Document {self.id!r}: source must be a str or None, got {kind}")


@dataclass(frozen=True, slots=True)
class Segment:
    """One rendered segment of a prompt.

    Attributes:
        kind: Which stability tier this is.
        text: The canonical text of the segment; its UTF-8 bytes are what is fingerprinted.
    """

    kind: SegmentKind
    text: str

    @property
    def data(self) -> bytes:
        """UTF-8 bytes of ``text``."""
        return self.text.encode("utf-8")


def normalize_documents(docs: Iterable[Document], *, pinned_order: bool) -> tuple[Document, ...]:
    """Normalize text, drop exact duplicates and sort by id (unless ``pinned_order``).

    Raises:
        PromptError: two documents share an id but differ in text or source.
    """
    seen: dict[str, Document] = {}
    for doc in docs:
        if not isinstance(doc, Document):
            raise PromptError(f"documents must be Document instances, got {type(doc).__name__}")
        doc_id, text, source = _normalized_fields(doc.id, doc.text, doc.source)
        norm = Document(id=doc_id, text=text, source=source, metadata=doc.metadata)
        previous = seen.get(norm.id)
        if previous is not None and previous != norm:
            raise PromptError(f"two documents share id {norm.id!r} with different content")
        seen.setdefault(norm.id, norm)
    ordered = list(seen.values())
    if not pinned_order:
        ordered.sort(key=lambda d: d.id)
    return tuple(ordered)


@functools.lru_cache(maxsize=4096)
def _normalized_fields(doc_id: str, text: str, source: str | None) -> tuple[str, str, str | None]:
    # NOTE: RAG re-sends the same documents every turn; normalization is pure, so cache it.
    return (
        normalize_text(doc_id),
        normalize_text(text),
        None if source is None else normalize_text(source),
    )


def normalize_message(message: Mapping[str, Any], index: int) -> Message:
    """Return one OpenAI chat message in canonical form.

    Text is NFC with trailing whitespace removed; tool-call ``arguments`` JSON and tool results
    given as JSON object/array text are both re-rendered canonically (scalars are kept as
    written: ``"1.0"`` stays ``"1.0"``); stale ``cache_control`` markers are stripped at any depth.

    Raises:
        PromptTypeError: the message is not a mapping.
        PromptError: the message has no valid ``role``.
        CanonicalizationError: a value has no JSON form.
    """
    if not isinstance(message, Mapping):
        raise PromptTypeError(
            f"history[{index}]: expected a chat message mapping such as "
            f"{{'role': 'user', 'content': 'hi'}}, got {type(message).__name__} {message!r:.60}"
        )
    try:
        key = json.dumps(message, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return _normalize_message(message, index)
    cached = _MESSAGE_CACHE.get(key)
    if cached is None:
        cached = _normalize_message(message, index)
        if len(_MESSAGE_CACHE) >= _CACHE_SIZE:
            _MESSAGE_CACHE.pop(next(iter(_MESSAGE_CACHE)))  # NOTE: FIFO, bounded memory.
        _MESSAGE_CACHE[key] = cached
    return copy.deepcopy(cached)  # NOTE: callers may mutate; the cache must not change.


def _normalize_message(message: Mapping[str, Any], index: int) -> Message:
    role = message.get("role")
    if role not in _ROLES:
        raise PromptError(f"history[{index}]: role {role!r} is not one of {sorted(_ROLES)}")
    out: dict[str, Any] = {k: v for k, v in message.items() if k != "cache_control"}
    content = out.get("content")
    if isinstance(content, str) and role == "tool":
        out["content"] = _canonical_result_text(normalize_text(content))
    elif isinstance(content, str):
        out["content"] = normalize_text(content)
    elif isinstance(content, list):
        out["content"] = [_normalize_part(part) for part in content]
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_normalize_tool_call(call) for call in out["tool_calls"]]
    result = to_canonical(out, f"history[{index}]")
    assert isinstance(result, dict), "a mapping canonicalizes to a dict"
    sorted_result: Message = json.loads(json.dumps(result, sort_keys=True))  # NOTE: sorted keys.
    return sorted_result


def _canonical_result_text(text: str) -> str:
    """A tool result's text; JSON object/array text re-rendered canonically (like arguments)."""
    if not text.startswith(("{", "[")):
        return text
    try:
        return canonical_json(json.loads(text))
    except (ValueError, TypeError, CanonicalizationError):
        return text  # NOTE: not JSON after all; the tool's text is kept byte for byte.


def _normalize_part(part: Any) -> Any:
    if isinstance(part, list):
        return [_normalize_part(item) for item in part]
    if not isinstance(part, Mapping):
        return part
    out = {k: _normalize_part(v) for k, v in part.items() if k != "cache_control"}
    if isinstance(out.get("text"), str):
        out["text"] = normalize_text(out["text"])
    return out


def _normalize_tool_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = canonical_json(json.loads(arguments))
        except (ValueError, TypeError):
            pass  # NOTE: not JSON; the model's text is kept byte for byte.
    return {**call, "function": function}
