"""The proxy's per-session break log: what each kind of break records, and its cost.

Each body's view is built once (the client body's on arrival; the forwarded body's only when a
break needs it); the records are the ones ``diff`` on the bodies gives.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from agentcache.prompt import _view
from agentcache.prompt.diff import diff
from agentcache.proxy import sessions
from agentcache.proxy.cli import show_proxy_log
from agentcache.proxy.rewrite import RewriteOptions, rewrite
from agentcache.proxy.sessions import SessionLog


def tool(name: str) -> dict[str, Any]:
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "parameters": params}}


def body(system: str, *turns: str, tools: tuple[str, ...] = ("alpha", "beta")) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages, "tools": [tool(n) for n in tools]}


SYSTEM = "You help with the standard library. Today is 2026-12-01T10:00:00Z."
LATER = SYSTEM.replace("10:00:00", "10:05:00")
REQUESTS: list[dict[str, Any]] = [
    body(SYSTEM, "q1"),
    body(SYSTEM, "q1", "a1", "q2"),  # extension: no break
    body(SYSTEM, "q1", "a1", "q2", tools=("beta", "alpha")),  # reordered; the rewrite sorts
    body(SYSTEM, "q1", "a1", "q2", "a2", "q3", tools=("beta", "alpha")),  # extension
    body(LATER, "q1", "a1", "q2", "a2", "q3", tools=("beta", "alpha")),  # timestamp
    body(LATER, "Q1", "a1", "q2", "a2", "q3", tools=("beta", "alpha")),  # history edited
    {"model": "m", "prompt": "not a chat body"},  # never compared
    body(LATER, "q1"),  # after a non-chat body: nothing to compare with
]


def forwarded(request: dict[str, Any]) -> dict[str, Any]:
    if "messages" not in request:
        return copy.deepcopy(request)
    return rewrite(request, "openai", session_id="s", options=RewriteOptions()).body


def test_each_break_is_recorded_as_diff_on_the_bodies_says() -> None:
    log = SessionLog()
    found = [log.observe("s", request, forwarded(request)) for request in REQUESTS]
    kinds = [(b.segment, b.reason, b.fixed) if b else None for b in found]
    assert kinds == [
        None,
        None,
        ("tools", "tools reordered", True),
        None,
        ("system", "timestamp in system", False),
        ("history", "history edited", False),
        None,
        None,
    ]
    for i in (2, 4, 5):
        reference = diff(REQUESTS[i - 1], REQUESTS[i])
        record = found[i]
        assert record is not None
        assert (record.part, record.byte_offset, record.token_offset, record.detail) == (
            reference.part, reference.byte_offset, reference.token_offset, reference.reason
        )  # fmt: skip
        after = diff(forwarded(REQUESTS[i - 1]), forwarded(REQUESTS[i]))
        assert record.fixed == (not after.is_divergent)
    report = log.report()
    assert report["requests"] == len(REQUESTS) and report["sessions"] == 1
    assert report["breaks_by_reason"] == {
        "tools reordered": 1, "timestamp in system": 1, "history edited": 1
    }  # fmt: skip
    assert [b["reason"] for b in report["recent_breaks"]] == [
        "tools reordered", "timestamp in system", "history edited"
    ]  # fmt: skip


def test_each_body_is_viewed_once_and_forwarded_bodies_only_on_a_break(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    viewed: list[int] = []
    real = _view.view_of

    def counting(source: Any, **kwargs: Any) -> _view.View:
        viewed.append(id(source))
        return real(source, **kwargs)

    monkeypatch.setattr(sessions, "view_of", counting)
    log = SessionLog()
    for request in REQUESTS[:2]:
        log.observe("s", request, forwarded(request))
    assert len(viewed) == 2  # no break: one view per request (diff on the bodies builds two)
    log.observe("s", REQUESTS[2], forwarded(REQUESTS[2]))
    assert len(viewed) == 5  # the break: the new body, and both forwarded bodies
    log.observe("s", REQUESTS[3], forwarded(REQUESTS[3]))
    assert len(viewed) == 6


def test_the_proxy_cli_prints_each_break_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("agentcache.proxy")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        show_proxy_log()
        show_proxy_log()  # a second call adds no second handler (one line per break)
        log = SessionLog()
        for request in REQUESTS[1:3]:  # an extension, then the tools reordered
            log.observe("s", request, forwarded(request))
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])
    lines = [line for line in capsys.readouterr().err.splitlines() if "prefix break" in line]
    assert len(lines) == 1 and "reason=tools reordered" in lines[0] and "fixed=True" in lines[0]
