"""Per-session memory of the last request, and the explanation of each prefix break.

A session is named by the caller (a header) or derived from the API key, the model and the tool
names. When a request does not keep the previous request's prefix, ``SessionLog.observe`` records
where (segment, part label, byte and token offset) and why (a short reason such as "tools
reordered" or "timestamp in system"), and whether the rewritten body still broke it or the proxy
fixed it. Records never hold prompt content; bodies are kept only in memory, bounded per session
count. Knows request shapes and ``diff``, not HTTP.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Any

from agentcache.exceptions import PromptError
from agentcache.prompt._patterns import describe_at
from agentcache.prompt._view import View, view_of
from agentcache.prompt.diff import DiffResult, diff_views

__all__ = ["PrefixBreak", "SessionLog", "derive_session_id"]

logger = logging.getLogger("agentcache.proxy")

_STABLE_SEGMENTS = frozenset({"tools", "system", "history"})


def derive_session_id(body: dict[str, Any], api_key: str | None) -> str:
    """A session id when the caller gave none: hash of the API key, the model and the tool names.

    Tool names, not schemas, so a reordered or edited tool list stays in the same session and its
    break is seen. The key is hashed first: records never hold it.
    """
    tools: list[Any] = body["tools"] if isinstance(body.get("tools"), list) else []
    names = sorted(str((t.get("function") or t).get("name")) for t in tools if isinstance(t, dict))
    key_hash = hashlib.sha256((api_key or "").encode()).hexdigest()
    parts = [key_hash, str(body.get("model") or ""), *names]
    return "derived-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class PrefixBreak:
    """One request that did not keep the previous request's prefix (no prompt content).

    Attributes:
        session: Session id (a caller's header value, or a derived hash).
        segment: ``tools``, ``system`` or ``history``.
        part: Label of the first divergent part (``"tool 'search'"``, ``"message 2 (user)"``).
        byte_offset: UTF-8 bytes of shared prefix before the break (joined parts, see ``diff``).
        token_offset: Tokens before the break (an estimate without a tokenizer).
        reason: Short cause: ``timestamp in system``, ``tools reordered``, ``tool added``,
            ``tool removed``, ``tool schema changed``, ``tool schema key order``,
            ``system changed``, ``history edited``, ``history removed``.
        detail: ``diff``'s one-sentence reason.
        fixed: True when the rewritten body kept the prefix (the proxy repaired the break).
    """

    session: str
    segment: str
    part: str
    byte_offset: int | None
    token_offset: int | None
    reason: str
    detail: str
    fixed: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def _reason(result: DiffResult, before: View) -> str:
    segment, change = result.segment, result.change
    if segment == "tools":
        return {
            "reordered": "tools reordered",
            "added": "tool added",
            "removed": "tool removed",
            "key_order": "tool schema key order",
        }.get(change, "tool schema changed")
    if segment == "system":
        kind = _volatile_kind(before, result)
        return f"{kind} in system" if kind else "system changed"
    return "history removed" if change == "removed" else "history edited"


def _volatile_kind(view: View, result: DiffResult) -> str | None:
    """What the changed bytes of the system part look like (timestamp, UUID, ...), if anything."""
    part = next((p for p in view.parts if p.label == result.part), None)
    if part is None or result.byte_offset is None:
        return None
    start = sum(len(p.text.encode()) + 1 for p in view.parts[: view.parts.index(part)])
    local = result.byte_offset - start
    text_offset = len(part.text.encode()[: max(0, local)].decode(errors="ignore"))
    return describe_at(part.text, text_offset)


def _view(body: dict[str, Any]) -> View | None:
    try:
        return view_of(body)
    except PromptError:
        return None  # NOTE: not a chat body: never compared, as diff would refuse it.


class _Entry:
    """A session's last request: the view of the client's body, and the forwarded body.

    NOTE: building a view is most of a diff's cost. The client body's view is built once, on
    arrival, and serves as ``b`` now and as ``a`` for the next request; the forwarded body's
    view is built only when a break needs it (then kept for the next comparison).
    """

    __slots__ = ("_sent_view", "original", "sent")

    def __init__(self, original: View | None, sent: dict[str, Any]) -> None:
        self.original = original
        self.sent = sent
        self._sent_view: View | None = None

    def sent_view(self) -> View:
        """The forwarded body's view (built on first use).

        Raises:
            PromptError: the forwarded body is not a chat body.
        """
        if self._sent_view is None:
            self._sent_view = view_of(self.sent)
        return self._sent_view


class SessionLog:
    """Bounded per-session memory of the last body, and the prefix breaks seen (thread-safe).

    Args:
        max_sessions: Sessions remembered (least recently seen dropped first).
        max_breaks: Break records kept (oldest dropped first); the per-reason counts keep growing.
    """

    def __init__(self, *, max_sessions: int = 1024, max_breaks: int = 1000) -> None:
        self._sessions: OrderedDict[str, _Entry] = OrderedDict()
        self._max_sessions = max_sessions
        self.breaks: deque[PrefixBreak] = deque(maxlen=max_breaks)
        self.counts: Counter[str] = Counter()
        self.num_requests = 0
        self._lock = threading.Lock()

    def observe(
        self, session: str, original: dict[str, Any], sent: dict[str, Any]
    ) -> PrefixBreak | None:
        """Compare a request with the session's previous one; record and log a break.

        Args:
            session: Session id.
            original: The body as the client sent it.
            sent: The body as forwarded (after the rewrite).

        Returns:
            The break, or None when the prefix held (or this is the session's first request).
        """
        current = _Entry(_view(original), sent)
        with self._lock:
            self.num_requests += 1
            previous = self._sessions.pop(session, None)
            self._sessions[session] = current
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        if previous is None:
            return None
        found = self._compare(session, previous, current)
        if found is not None:
            with self._lock:
                self.breaks.append(found)
                self.counts[found.reason] += 1
            logger.info(
                "prefix break: session=%s segment=%s part=%s byte=%s token=%s reason=%s fixed=%s",
                found.session, found.segment, found.part, found.byte_offset,
                found.token_offset, found.reason, found.fixed,
            )  # fmt: skip
        return found

    def _compare(self, session: str, previous: _Entry, current: _Entry) -> PrefixBreak | None:
        if previous.original is None or current.original is None:
            return None
        try:
            result = diff_views(previous.original, current.original)
            if not result.is_divergent or result.segment not in _STABLE_SEGMENTS:
                return None  # NOTE: no break: the forwarded bodies are not compared at all.
            after = diff_views(previous.sent_view(), current.sent_view())
            fixed = not after.is_divergent or after.segment not in _STABLE_SEGMENTS
        except PromptError:
            return None
        reason = _reason(result, previous.original)
        return PrefixBreak(
            session=session,
            segment=str(result.segment),
            part=str(result.part),
            byte_offset=result.byte_offset,
            token_offset=result.token_offset,
            reason=reason,
            detail=result.reason,
            fixed=fixed,
        )

    def report(self) -> dict[str, Any]:
        """Requests seen, breaks by reason, and the most recent break records."""
        with self._lock:
            return {
                "requests": self.num_requests,
                "sessions": len(self._sessions),
                "breaks_by_reason": dict(self.counts),
                "recent_breaks": [b.to_dict() for b in self.breaks],
            }
