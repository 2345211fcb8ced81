"""Request body size limit shared by ``agentcache serve`` and ``agentcache proxy``.

Reads a Starlette request's body, refusing it before it is read in full once it is over a byte
limit (``Content-Length`` first, then the bytes received). Knows no route, model or error
body: each app turns ``BodyTooLargeError`` into its own 413 answer.
"""

from __future__ import annotations

from starlette.requests import Request

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "BodyTooLargeError", "read_body"]

DEFAULT_MAX_REQUEST_BYTES = 2 << 20
"""2 MiB, the default largest body of both servers (``--max-request-bytes``): a 128k-token chat
is about 0.5-1 MB of JSON."""


class BodyTooLargeError(Exception):
    """A request body is over the limit; the message says the limit and how to fix it."""

    def __init__(self, size: int, limit: int) -> None:
        # NOTE: ``size`` is what was declared or received so far, a lower bound of the body.
        super().__init__(
            f"request body is over this server's limit of {limit} bytes (max_request_bytes; "
            f"got at least {size}); shorten the prompt or raise the limit"
        )
        self.size = size
        self.limit = limit


async def read_body(request: Request, limit: int) -> bytes:
    """The body of ``request``, refused before it is read in full when over ``limit`` bytes.

    Args:
        request: the incoming request (its body not read yet).
        limit: largest accepted body, bytes (>= 1).

    Returns:
        The whole body.

    Raises:
        BodyTooLargeError: ``Content-Length`` or the bytes received so far exceed ``limit``;
            the rest of the body is never read.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)
