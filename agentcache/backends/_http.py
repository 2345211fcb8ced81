"""HTTP plumbing shared by the remote backends: bounded retries and Server-Sent Events parsing.

Retries cover 429 and 5xx answers and connection failures, with exponential backoff that honours
``Retry-After``; other 4xx answers raise ``BackendHTTPError`` at once. Knows nothing about any
provider's payloads.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx

from agentcache.exceptions import BackendError, BackendHTTPError, BackendUnavailableError

__all__ = ["RetryPolicy", "SSEEvent", "error_message", "iter_sse", "open_stream"]

_RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504, 529})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries with exponential backoff.

    Delay before retry ``n`` (1-based) is ``min(max_delay_s, base_delay_s * 2**(n-1))``, or the
    server's ``Retry-After`` (seconds or HTTP date) when given, capped at ``max_delay_s``.
    """

    max_attempts: int = 4
    """Total attempts including the first."""
    base_delay_s: float = 0.5
    """First backoff delay, seconds."""
    max_delay_s: float = 30.0
    """Cap on any single delay, seconds."""
    sleep: Callable[[float], None] = time.sleep
    """Sleep function (tests inject a recorder)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")

    def delay_s(self, attempt: int, retry_after: str | None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        parsed = _parse_retry_after(retry_after)
        if parsed is not None:
            return min(self.max_delay_s, parsed)
        return min(self.max_delay_s, self.base_delay_s * 2.0 ** (attempt - 1))


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    with contextlib.suppress(TypeError, ValueError):
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    return None


def error_message(body: str) -> str:
    """The message of an error body: OpenAI's ``error.message``, a bare ``error`` or
    ``message`` string, else the body's first 300 characters."""
    with contextlib.suppress(ValueError):
        data: Any = json.loads(body)
        error = data.get("error") if isinstance(data, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(data, dict) and data.get("message"):
            return str(data["message"])
    return body.strip()[:300] or "(empty body)"


@contextlib.contextmanager
def open_stream(
    client: httpx.Client,
    url: str,
    *,
    body: dict[str, Any],
    headers: dict[str, str],
    retry: RetryPolicy,
) -> Iterator[httpx.Response]:
    """POST ``body`` as JSON and yield the streaming response once it has a 2xx status.

    Raises:
        BackendHTTPError: A non-retryable 4xx, or a retryable status after ``max_attempts``.
        BackendUnavailableError: The endpoint could not be reached after ``max_attempts``.
    """
    response = _send_with_retries(client, url, body=body, headers=headers, retry=retry)
    try:
        yield response
    except httpx.TransportError as exc:
        # NOTE: no retry once streaming started: deltas were already handed to the caller.
        raise BackendUnavailableError(f"stream from {url} broke: {exc}") from exc
    finally:
        response.close()


def _send_with_retries(
    client: httpx.Client,
    url: str,
    *,
    body: dict[str, Any],
    headers: dict[str, str],
    retry: RetryPolicy,
) -> httpx.Response:
    for attempt in range(1, retry.max_attempts + 1):
        is_last = attempt == retry.max_attempts
        request = client.build_request("POST", url, json=body, headers=headers)
        try:
            response = client.send(request, stream=True)
        except httpx.TransportError as exc:
            if is_last:
                raise BackendUnavailableError(f"cannot reach {url}: {exc}") from exc
            retry.sleep(retry.delay_s(attempt, None))
            continue
        if response.is_success:
            return response
        text = response.read().decode("utf-8", errors="replace")
        response.close()
        status = response.status_code
        if status not in _RETRY_STATUS or is_last:
            message = f"{url} answered HTTP {status}: {error_message(text)}"
            raise BackendHTTPError(message, status_code=status, body=text)
        retry.sleep(retry.delay_s(attempt, response.headers.get("retry-after")))
    raise AssertionError("unreachable: the last attempt returns or raises")


class SSEEvent(NamedTuple):
    """One Server-Sent Event: its ``event`` name (``message`` by default) and ``data`` text."""

    event: str
    data: str


def iter_sse(lines: Iterator[str]) -> Iterator[SSEEvent]:
    """Parse Server-Sent Events from text lines (WHATWG HTML spec, section 9.2.6).

    Multi-line ``data`` fields are joined with newlines; comments (``:``) and ``id``/``retry``
    fields are ignored; an event is dispatched on a blank line or at the end of the stream.
    """
    event, data = "", list[str]()
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield SSEEvent(event or "message", "\n".join(data))
            event, data = "", list[str]()
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
    if data:
        yield SSEEvent(event or "message", "\n".join(data))


def decode_json_event(data: str, *, source: str) -> dict[str, Any]:
    """Parse one SSE ``data`` payload as a JSON object.

    Args:
        data: The event's data text.
        source: Who sent it, for the error message (e.g. ``"endpoint"``, ``"Anthropic"``).

    Raises:
        BackendError: ``data`` is not JSON, or not a JSON object.
    """
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise BackendError(f"{source} sent a non-JSON stream event: {data[:200]!r}") from exc
    if not isinstance(value, dict):
        raise BackendError(f"{source} sent a non-object stream event: {data[:200]!r}")
    return value
