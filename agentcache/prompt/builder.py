"""``PromptBuilder`` and ``Prompt``: canonical segments in stability order, chained fingerprints.

Segments come out as system, tools, documents, history, user, volatile — whatever order the
builder methods were called in. Each fingerprint hashes the namespace, the previous fingerprint and
the segment's canonical bytes, so a change moves exactly that fingerprint and every later one.
Rendering for providers lives in ``render.py``; this module knows no provider and no tokenizer.
"""

from __future__ import annotations

import collections
import copy
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentcache.canonical import JSONValue, canonical_json, normalize_text, stable_hash
from agentcache.exceptions import PromptError, PromptTypeError
from agentcache.prompt._templates import render_template
from agentcache.prompt.render import anthropic_body, openai_body
from agentcache.prompt.segments import (
    Document,
    Message,
    Segment,
    SegmentKind,
    normalize_documents,
    normalize_message,
)
from agentcache.prompt.tools import ToolLike, ToolSpec, tool_spec

__all__ = ["FINGERPRINT_VERSION", "Prompt", "PromptBuilder"]

FINGERPRINT_VERSION = "agentcache.prompt/v1"
"""First part of every segment hash; bump it when canonical rendering changes."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A built prompt: canonical parts, its segments and their chained fingerprints.

    Attributes:
        namespace: Cache namespace (tenant/app); part of every fingerprint.
        system: Canonical system text ("" when unset).
        tools: Canonical tools, sorted by name unless the caller pinned the order.
        documents: Canonical documents, de-duplicated, sorted by id unless pinned.
        history: Canonical OpenAI chat messages of earlier turns.
        user: The current user turn, or ``None``.
        volatile: Volatile tail (e.g. the current date), or ``None``; always rendered last.
        segments: Non-empty segments in stability order.
        fingerprints: Segment kind -> chained SHA-256 hex digest, in the order of ``segments``.
    """

    namespace: str
    system: str
    tools: tuple[ToolSpec, ...]
    documents: tuple[Document, ...]
    history: tuple[Message, ...]
    user: str | None
    volatile: str | None
    segments: tuple[Segment, ...]
    fingerprints: Mapping[SegmentKind, str]

    @property
    def prefix_hash(self) -> str:
        """Fingerprint of the last segment: one hash for the whole prompt."""
        values = list(self.fingerprints.values())
        return values[-1] if values else stable_hash(FINGERPRINT_VERSION, self.namespace)

    def documents_block(self) -> str:
        """The documents segment text (``templates/documents.jinja``), or "" without documents."""
        return _segment_text(self, "documents")

    def system_text(self) -> str:
        """System message content: the system text, then the documents block."""
        return render_template("system.jinja", system=self.system, documents=self.documents_block())

    def tail_text(self) -> str | None:
        """Content of the final user message: the user turn, then the volatile tail."""
        parts = [p for p in (self.user, self.volatile) if p is not None]
        return "\n\n".join(parts) if parts else None

    def tool_schemas(self) -> list[dict[str, JSONValue]]:
        """Tools in the OpenAI ``tools`` format, canonical order (fresh copies)."""
        return [json.loads(tool.json) for tool in self.tools]  # NOTE: specs are shared (cached).

    def to_messages(self) -> list[dict[str, JSONValue]]:
        """OpenAI chat messages: system (with documents), history, then user + volatile tail.

        This is also what the local backend feeds to the model's chat template.
        """
        messages: list[dict[str, JSONValue]] = []
        system = self.system_text()
        if system:
            messages.append({"role": "system", "content": system})
        messages.extend(copy.deepcopy(list(self.history)))
        tail = self.tail_text()
        if tail is not None:
            messages.append({"role": "user", "content": tail})
        return messages

    def to_openai(self, *, model: str, **params: Any) -> dict[str, Any]:
        """OpenAI Chat Completions request body; see ``render.openai_body``.

        Raises:
            PromptError: ``params`` would replace ``messages`` or ``tools``.
        """
        return openai_body(self, model=model, **params)

    def to_anthropic(self, *, model: str, **params: Any) -> dict[str, Any]:
        """Anthropic Messages body with planned breakpoints; see ``render.anthropic_body``.

        Raises:
            PromptError: ``params`` would replace ``messages``, ``tools`` or ``system``, or names
                a field outside ``render.ANTHROPIC_PARAMS`` (use ``extra_body=``).
        """
        return anthropic_body(self, model=model, **params)


def _segment_text(prompt: Prompt, kind: SegmentKind) -> str:
    return next((s.text for s in prompt.segments if s.kind == kind), "")


class PromptBuilder:
    """Collect the parts of a prompt, then ``build()`` a canonical ``Prompt``.

    Every method returns the builder; calling one twice replaces the earlier value.

    Example:
        >>> prompt = PromptBuilder(namespace="acme").system("Be brief.").user("Hi").build()
    """

    def __init__(self, *, namespace: str = "default") -> None:
        if not isinstance(namespace, str) or not namespace:
            raise PromptError(f"namespace must be a non-empty string, got {namespace!r}")
        self._namespace = namespace
        self._system = ""
        self._tools: tuple[ToolSpec, ...] = ()
        self._documents: tuple[Document, ...] = ()
        self._history: tuple[Message, ...] = ()
        self._user: str | None = None
        self._volatile: str | None = None

    def copy(self) -> PromptBuilder:
        """A new builder with the same parts (keep a base builder, copy it per turn)."""
        other = PromptBuilder(namespace=self._namespace)
        other.__dict__.update(self.__dict__)
        return other

    def system(self, text: str) -> PromptBuilder:
        """Set the system prompt (NFC, trailing whitespace removed)."""
        self._system = normalize_text(_require_str(text, "system"))
        return self

    def tools(self, tools: Iterable[ToolLike], *, pinned_order: bool = False) -> PromptBuilder:
        """Set the tools: callables, pydantic model classes or OpenAI/Anthropic-style dicts.

        Tools are sorted by name unless ``pinned_order`` keeps the given order.

        Raises:
            PromptTypeError: ``tools`` is one tool (a function, class, dict or str), not a list.
            PromptError: a tool has no schema, or two tools share a name.
        """
        if callable(tools) or isinstance(tools, (str, bytes, Mapping)):
            raise PromptTypeError(
                f"tools must be a list of tools, got one {type(tools).__name__}; "
                "pass a list, e.g. .tools([get_weather])"
            )
        specs = [tool_spec(tool) for tool in tools]
        counts = collections.Counter(spec.name for spec in specs)
        duplicates = sorted(name for name, n in counts.items() if n > 1)
        if duplicates:
            raise PromptError(f"duplicate tool names: {duplicates}; tool names must be unique")
        if not pinned_order:
            specs.sort(key=lambda spec: spec.name)
        self._tools = tuple(specs)
        return self

    def documents(self, docs: Iterable[Document], *, pinned_order: bool = False) -> PromptBuilder:
        """Set the documents: de-duplicated by id and sorted by id unless ``pinned_order``.

        Raises:
            PromptError: two documents share an id but differ in content.
        """
        self._documents = normalize_documents(docs, pinned_order=pinned_order)
        return self

    def history(self, messages: Sequence[Mapping[str, Any]]) -> PromptBuilder:
        """Set earlier turns: OpenAI chat messages (incl. assistant ``tool_calls``, ``tool`` role).

        Raises:
            PromptTypeError: ``messages`` or one message is not a mapping (the index is named).
            PromptError: a message has no valid role.
            CanonicalizationError: a message holds a value with no JSON form.
        """
        if isinstance(messages, (str, bytes, Mapping)):
            raise PromptTypeError(
                f"history must be a list of chat messages, got one {type(messages).__name__}; "
                "wrap it in a list"
            )
        self._history = tuple(normalize_message(m, i) for i, m in enumerate(messages))
        return self

    def user(self, text: str) -> PromptBuilder:
        """Set the current user turn."""
        self._user = normalize_text(_require_str(text, "user"))
        return self

    def volatile(self, text: str) -> PromptBuilder:
        """Set the volatile tail (current date, request ids); always rendered last."""
        self._volatile = normalize_text(_require_str(text, "volatile"))
        return self

    def build(self) -> Prompt:
        """Render every segment canonically and chain the fingerprints."""
        parts: list[tuple[SegmentKind, str]] = [
            ("system", self._system),
            ("tools", render_template("tools.jinja", tools=[t.json for t in self._tools])),
            ("documents", _documents_text(self._documents)),
            ("history", "\n".join(canonical_json(m) for m in self._history)),
            ("user", self._user or ""),
            ("volatile", self._volatile or ""),
        ]
        segments = tuple(Segment(kind, text) for kind, text in parts if text)
        return Prompt(
            namespace=self._namespace,
            system=self._system,
            tools=self._tools,
            documents=self._documents,
            history=self._history,
            user=self._user,
            volatile=self._volatile,
            segments=segments,
            fingerprints=chain_fingerprints(self._namespace, segments),
        )


def chain_fingerprints(namespace: str, segments: Iterable[Segment]) -> dict[SegmentKind, str]:
    """Chained SHA-256 per segment: ``H(version, namespace, parent, kind, bytes)``."""
    out: dict[SegmentKind, str] = {}
    parent = ""
    for segment in segments:
        parent = stable_hash(FINGERPRINT_VERSION, namespace, parent, segment.kind, segment.data)
        out[segment.kind] = parent
    return out


def _documents_text(documents: tuple[Document, ...]) -> str:
    if not documents:
        return ""
    rows = [_document_row(d.id, d.source) | {"text": d.text} for d in documents]
    return render_template("documents.jinja", documents=rows)


@functools.lru_cache(maxsize=4096)
def _document_row(doc_id: str, source: str | None) -> dict[str, str]:
    return {
        "id_json": canonical_json(doc_id),
        "source_json": canonical_json(source) if source else "",
    }


def _require_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise PromptError(f"{what} text must be a str, got {type(value).__name__}")
    return value
