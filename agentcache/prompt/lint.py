"""``lint``: find prefix-cache hazards in a prompt or a request body.

Each finding has a code, the segment and part it sits in, a byte offset into that part, a message
and a fix hint. Findings never quote prompt content beyond the kind of value found. Rules:

- AC101 volatile value (timestamp, date, clock time, UUID, request id, counter) in a stable segment;
- AC102 JSON that is not canonical (unsorted keys, extra whitespace) in a stable segment;
- AC103 tools not sorted by name; AC104 tools changed since the previous build;
- AC105 documents in score order; AC106 stable prefix under the provider's cacheable minimum;
- AC107 more than 4 Anthropic ``cache_control`` breakpoints.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from agentcache.canonical import canonical_json
from agentcache.exceptions import CanonicalizationError
from agentcache.prompt._patterns import find_volatile
from agentcache.prompt._view import Part, View, view_of
from agentcache.prompt.anthropic import MAX_BREAKPOINTS, min_cacheable_tokens
from agentcache.prompt.builder import Prompt
from agentcache.tokens import token_count

__all__ = ["OPENAI_MIN_CACHEABLE_TOKENS", "Finding", "lint"]

OPENAI_MIN_CACHEABLE_TOKENS = 1024
"""OpenAI caches prompts of 1024 tokens or more (https://platform.openai.com/docs/guides/prompt-caching,
reviewed 2026-11-29)."""
_STABLE = ("system", "tools", "documents")


@dataclass(frozen=True, slots=True)
class Finding:
    """One lint finding.

    Attributes:
        code: Rule code, e.g. ``"AC101"``.
        segment: Segment kind (``system``, ``tools``, ``documents``, ``history``, ``request``).
        part: Human label of the part (``"tool 'search'"``, ``"system prompt"``).
        offset: Byte offset of the problem inside that part's text (0 when it is the whole part).
        message: What is wrong, without quoting prompt content.
        hint: How to fix it.
        severity: ``"warning"`` breaks caching; ``"info"`` reduces it.
    """

    code: str
    segment: str
    part: str
    offset: int
    message: str
    hint: str
    severity: Literal["warning", "info"] = "warning"

    def to_dict(self) -> dict[str, Any]:
        """The finding as a JSON-ready dict."""
        return asdict(self)


def _byte_offset(text: str, char_offset: int) -> int:
    return len(text[:char_offset].encode("utf-8"))


def lint(
    source: Prompt | dict[str, Any],
    *,
    previous: Prompt | dict[str, Any] | None = None,
    model: str = "",
    tokenizer: Any = None,
) -> list[Finding]:
    """Find prefix-cache hazards in a ``Prompt`` or an OpenAI/Anthropic request body.

    Args:
        source: What to check.
        previous: The previous build or request; enables AC104 (tools changed between builds).
        model: Model name for the minimum-length rule (a body's own ``model`` wins).
        tokenizer: Optional tokenizer for exact counts (else tiktoken or a labelled estimate).

    Raises:
        PromptError: ``source`` is not a chat request body.
    """
    view = view_of(source, model=model)
    findings: list[Finding] = []
    for part in view.parts:
        if part.kind in _STABLE:
            findings += _volatile_values(part) + _non_canonical_json(part)
    findings += _tool_order(view) + _document_order(view) + _prefix_minimum(view, tokenizer)
    if previous is not None:
        findings += _tools_changed(view_of(previous, model=model), view)
    if view.num_breakpoints > MAX_BREAKPOINTS:
        findings.append(
            Finding(
                "AC107",
                "request",
                "cache_control",
                0,
                f"{view.num_breakpoints} cache_control markers; Anthropic allows {MAX_BREAKPOINTS}",
                "let the planner place them (Prompt.to_anthropic) or drop markers from history",
            )
        )
    return findings


def _volatile_values(part: Part) -> list[Finding]:
    return [
        Finding(
            "AC101",
            part.kind,
            part.label,
            _byte_offset(part.text, m.start),
            f"{m.kind} in a stable segment changes the prefix on every request",
            "move it to the volatile tail (PromptBuilder.volatile) or drop it",
        )
        for m in find_volatile(part.text)
    ]


def _non_canonical_json(part: Part) -> list[Finding]:
    decoder = json.JSONDecoder()
    findings: list[Finding] = []
    index = part.text.find("{")
    while index != -1:
        try:
            value, end = decoder.raw_decode(part.text, index)
        except ValueError:
            index = part.text.find("{", index + 1)
            continue
        try:
            canonical = canonical_json(value)
        except CanonicalizationError:
            canonical = part.text[index:end]
        if isinstance(value, dict) and part.text[index:end] != canonical:
            sorted_ok = json.dumps(value, sort_keys=True) == json.dumps(value)
            what = "extra whitespace or number formatting" if sorted_ok else "unsorted keys"
            findings.append(
                Finding(
                    "AC102",
                    part.kind,
                    part.label,
                    _byte_offset(part.text, index),
                    f"JSON with {what}: another serializer will produce other bytes",
                    "render JSON with agentcache.canonical.canonical_json (sorted keys, ',' ':')",
                    # NOTE: a tool list re-sent by the same serializer keeps its bytes; JSON
                    # inside prompt text is usually re-dumped per request, so it is a warning.
                    "info" if part.kind == "tools" else "warning",
                )
            )
        index = part.text.find("{", end)
    return findings


def _tool_order(view: View) -> list[Finding]:
    names = [p.label for p in view.parts if p.kind == "tools"]
    if names == sorted(names):
        return []
    return [
        Finding(
            "AC103",
            "tools",
            "tools",
            0,
            "tools are not sorted by name; any reordering upstream breaks the prefix",
            "sort tools by name (PromptBuilder.tools does unless pinned_order=True)",
            "info",
        )
    ]


def _document_order(view: View) -> list[Finding]:
    scores = [(d.metadata or {}).get("score") for d in view.documents]
    if len(scores) < 2 or not all(isinstance(s, int | float) for s in scores):
        return []
    if scores == sorted(scores, reverse=True) and scores != sorted(scores):  # type: ignore[type-var]
        return [
            Finding(
                "AC105",
                "documents",
                "documents",
                0,
                "documents are in retrieval-score order; scores move between queries",
                "order documents by id (PromptBuilder.documents without pinned_order)",
            )
        ]
    return []


def _tools_changed(before: View, after: View) -> list[Finding]:
    old = {p.label: canonical_json(p.value) for p in before.parts if p.kind == "tools"}
    new = {p.label: canonical_json(p.value) for p in after.parts if p.kind == "tools"}
    changed = sorted(label for label in old.keys() & new.keys() if old[label] != new[label])
    messages = [f"{label} schema changed" for label in changed]
    messages += [f"{label} added" for label in sorted(new.keys() - old.keys())]
    messages += [f"{label} removed" for label in sorted(old.keys() - new.keys())]
    return [
        Finding(
            "AC104",
            "tools",
            "tools",
            0,
            f"tools changed between builds: {m}",
            "keep the tool set fixed for a session; mask tools instead of removing them",
        )
        for m in messages
    ]


def _prefix_minimum(view: View, tokenizer: Any) -> list[Finding]:
    if not view.model:
        return []
    stable = "".join(p.text for p in view.parts if p.kind in _STABLE)
    count = token_count(stable, model=view.model, tokenizer=tokenizer)
    is_claude = view.provider == "anthropic" or view.model.startswith("claude")
    minimum = min_cacheable_tokens(view.model) if is_claude else OPENAI_MIN_CACHEABLE_TOKENS
    if count.value >= minimum:
        return []
    approx = "~" if count.is_estimate else ""
    return [
        Finding(
            "AC106",
            "request",
            "stable prefix",
            0,
            f"stable prefix is {approx}{count.value} tokens, under the {minimum}-token minimum "
            f"that {view.model!r} caches",
            "fine for small prompts; otherwise move shared context into the stable segments",
            "info",
        )
    ]
