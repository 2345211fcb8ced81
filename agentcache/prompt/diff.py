"""``diff``: where and why two prompts (or request bodies) stop sharing a prefix.

Compares the parts of two views in request order and reports the first divergent part, its kind,
the byte and token offset into the whole request, and a reason in words ("tool 'search' schema:
key order differs"). Prompt text is never included unless ``show_content=True``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from agentcache.canonical import canonical_json
from agentcache.exceptions import CanonicalizationError
from agentcache.prompt._patterns import describe_at
from agentcache.prompt._view import Part, View, view_of
from agentcache.prompt.builder import Prompt
from agentcache.tokens import token_count, token_ids

__all__ = ["DiffResult", "diff", "diff_views"]

Change = Literal[
    "identical", "extension", "key_order", "changed", "added", "removed", "reordered", "provider"
]
_MESSAGE_KINDS = frozenset({"history", "user"})  # NOTE: the last user turn becomes history later.
_SEP = "\n"  # NOTE: parts are joined with one newline when offsets are counted.


@dataclass(frozen=True, slots=True)
class DiffResult:
    """The first divergence between two prompts.

    Attributes:
        change: ``identical``, ``extension`` (B appends to A: the prefix holds) or the kind of
            divergence: ``key_order``, ``changed``, ``added``, ``removed``, ``reordered``, or
            ``provider`` (one body is OpenAI-shaped, the other Anthropic-shaped: they share no
            cached prefix and are not compared part by part).
        segment: Segment kind of the first divergent part, or ``None``.
        part: Label of that part (``"tool 'search'"``), or ``None``.
        byte_offset: UTF-8 byte offset of the first differing byte in the joined parts of A.
        token_offset: Tokens A and B share before the divergence: the common token-id prefix
            with a tokenizer (or tiktoken for an OpenAI model), else an estimate of the tokens
            before ``byte_offset`` (``token_offset_is_estimate`` says which).
        reason: One sentence, no prompt content.
        excerpt_a: Text around the divergence in A, only with ``show_content``; ``excerpt_b``
            likewise.
    """

    change: Change
    segment: str | None
    part: str | None
    byte_offset: int | None
    token_offset: int | None
    token_offset_is_estimate: bool
    reason: str
    excerpt_a: str | None = None
    excerpt_b: str | None = None

    @property
    def is_divergent(self) -> bool:
        """True when B does not keep A's prefix."""
        return self.change not in ("identical", "extension")

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        return {**asdict(self), "is_divergent": self.is_divergent}


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def diff(
    a: Prompt | dict[str, Any],
    b: Prompt | dict[str, Any],
    *,
    show_content: bool = False,
    model: str = "",
    tokenizer: Any = None,
) -> DiffResult:
    """Explain where ``b`` stops sharing ``a``'s prefix.

    Args:
        a: Earlier prompt or request body.
        b: Later prompt or request body.
        show_content: Include short excerpts of both sides around the divergence.
        model: Model for token counting (a body's own ``model`` wins).
        tokenizer: Optional tokenizer; ``token_offset`` is then exact: the number of leading
            token ids A and B share (a token straddling a mid-word change is not shared).

    Raises:
        PromptError: a body is not a chat request body.
    """
    view_a = view_of(a, model=model)
    view_b = view_of(b, model=model)
    return diff_views(view_a, view_b, show_content=show_content, tokenizer=tokenizer)


def diff_views(
    view_a: View, view_b: View, *, show_content: bool = False, tokenizer: Any = None
) -> DiffResult:
    """``diff`` of two views built already (``view_of``; building one is most of the cost).

    For callers that compare each body with the next one (the proxy's session log): each
    body's view is built once instead of twice. Arguments and result as ``diff``.
    """
    if {view_a.provider, view_b.provider} == {"openai", "anthropic"}:
        reason = (
            f"different provider shapes ({view_a.provider} vs {view_b.provider}): requests to "
            "different APIs never share a cached prefix; diff two bodies of the same provider"
        )
        return DiffResult("provider", None, None, None, None, False, reason)
    parts_a, parts_b = view_a.parts, view_b.parts
    counter = _SharedTokens(parts_a, parts_b, view_b.model, tokenizer)
    prefix: list[str] = []
    for i, pa in enumerate(parts_a):
        if i >= len(parts_b):
            reason = f"B ends before {pa.label}: earlier content was dropped"
            return _result("removed", pa, "", prefix, 0, reason, counter)
        pb = parts_b[i]
        if pa.kind != pb.kind and not {pa.kind, pb.kind} <= _MESSAGE_KINDS:
            change, part, reason = _segment_change(pa, pb, parts_a, parts_b)
            return _result(change, part, "", prefix, 0, reason, counter)
        if pa.text != pb.text:
            at = _common_prefix(pa.text, pb.text)
            change, reason = _explain(pa, pb, parts_a, parts_b, at)
            result = _result(change, pa, pa.text[:at], prefix, at, reason, counter)
            if show_content:
                result = _with_excerpts(result, pa.text, pb.text, at)
            return result
        prefix.append(pa.text)
    if len(parts_b) == len(parts_a):
        return DiffResult("identical", None, None, None, None, False, "the prompts are identical")
    added = len(parts_b) - len(parts_a)
    reason = f"B extends A by {added} part(s); the whole of A is a shared prefix"
    return DiffResult("extension", None, None, None, None, False, reason)


class _SharedTokens:
    """Counts the tokens A and B share before a divergence.

    With a tokenizer (or a tiktoken encoding for ``model``) the count is the common prefix of the
    token ids of the two whole joined texts: the token that straddles a mid-word seam differs
    between A and B, so it is not shared (encoding only A's text up to the seam would count it).
    Without one, the labelled estimate of the text before the divergence.
    """

    def __init__(
        self, parts_a: tuple[Part, ...], parts_b: tuple[Part, ...], model: str, tokenizer: Any
    ) -> None:
        self._texts = (
            "".join(p.text + _SEP for p in parts_a),
            "".join(p.text + _SEP for p in parts_b),
        )
        self._model = model
        self._tokenizer = tokenizer

    def before(self, text: str) -> tuple[int, bool]:
        """Tokens shared before the divergence that ends ``text`` (A's joined text up to it)."""
        ids_a = token_ids(self._texts[0], model=self._model, tokenizer=self._tokenizer)
        if ids_a is None:
            return token_count(text, model=self._model).value, True
        ids_b = token_ids(self._texts[1], model=self._model, tokenizer=self._tokenizer) or []
        limit = min(len(ids_a), len(ids_b))
        return next((i for i in range(limit) if ids_a[i] != ids_b[i]), limit), False


def _result(
    change: Change,
    part: Part,
    partial: str,
    prefix: list[str],
    at: int,
    reason: str,
    counter: _SharedTokens,
) -> DiffResult:
    text = "".join(p + _SEP for p in prefix) + partial
    count, is_estimate = counter.before(text)
    offset = len(text.encode("utf-8"))
    return DiffResult(change, part.kind, part.label, offset, count, is_estimate, reason)


def _explain(
    pa: Part, pb: Part, parts_a: tuple[Part, ...], parts_b: tuple[Part, ...], at: int
) -> tuple[Change, str]:
    if pa.label != pb.label and pa.kind == pb.kind and pa.kind in ("tools", "documents"):
        return _membership(pa, pb, parts_a, parts_b)
    if pa.value is not None and pb.value is not None:
        try:
            same = canonical_json(pa.value) == canonical_json(pb.value)
        except CanonicalizationError:
            same = False
        if same:
            return "key_order", f"{_what(pa)}: key order differs (same values)"
        path = _first_json_difference(pa.value, pb.value, "$")
        return "changed", f"{_what(pa)}: value changed at {path}{_looks_like(pa, pb, at)}"
    return "changed", f"{_what(pa)}: value changed at offset {at}{_looks_like(pa, pb, at)}"


def _segment_change(
    pa: Part, pb: Part, parts_a: tuple[Part, ...], parts_b: tuple[Part, ...]
) -> tuple[Change, Part, str]:
    """A and B have different kinds of part at the same position: what was added or removed."""
    kinds_a = {p.kind for p in parts_a}
    kinds_b = {p.kind for p in parts_b}
    labels_a = {p.label for p in parts_a if p.kind == pb.kind}
    if pb.kind not in kinds_a:
        return "added", pb, f"{pb.kind} added: B has {pb.label} where A has {pa.label}"
    if pa.kind not in kinds_b:
        return "removed", pa, f"{pa.kind} removed: B has no {pa.kind}; {pa.label} is gone"
    if pb.label not in labels_a:
        return "added", pb, f"{pb.label} added before {pa.label}"
    return "removed", pa, f"{pa.label} removed (B continues with {pb.label})"


def _what(part: Part) -> str:
    return f"{part.label} schema" if part.kind == "tools" else part.label


def _looks_like(pa: Part, pb: Part, at: int) -> str:
    kind = describe_at(pa.text, at) or describe_at(pb.text, at)
    return f" (looks like a {kind})" if kind else ""


def _membership(
    pa: Part, pb: Part, parts_a: tuple[Part, ...], parts_b: tuple[Part, ...]
) -> tuple[Change, str]:
    names_a = {p.label for p in parts_a if p.kind == pa.kind}
    names_b = {p.label for p in parts_b if p.kind == pa.kind}
    if names_a == names_b:
        return "reordered", f"{pa.kind} reordered: {pb.label} now comes where {pa.label} was"
    if pa.label not in names_b:
        return "removed", f"{pa.label} removed"
    return "added", f"{pb.label} added before {pa.label}"


def _first_json_difference(a: Any, b: Any, path: str) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            if key not in a or key not in b:
                return f"{path}.{key}"
            try:
                if canonical_json(a[key]) != canonical_json(b[key]):
                    return _first_json_difference(a[key], b[key], f"{path}.{key}")
            except CanonicalizationError:
                return f"{path}.{key}"
        return path
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return _first_json_difference(x, y, f"{path}[{i}]")
        return f"{path}[{min(len(a), len(b))}]"
    return path


def _with_excerpts(result: DiffResult, a: str, b: str, at: int, width: int = 40) -> DiffResult:
    start = max(0, at - width)
    return DiffResult(
        **{**asdict(result), "excerpt_a": a[start : at + width], "excerpt_b": b[start : at + width]}
    )
