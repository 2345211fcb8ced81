"""``ErrorShield``: an unexpected exception becomes a 500 in the OpenAI error shape, and the
client's keep-alive connection survives it.

Starlette's outermost middleware answers an unhandled exception and then re-raises it, so
uvicorn closes the connection and a client that reuses it sees a reset. This middleware sits
inside it and ends the exception there. It knows ASGI messages and the error body, no routes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.serve.api_error import error_body

__all__ = ["ErrorShield"]

_log = logging.getLogger("runtime.serve")


class ErrorShield:
    """ASGI middleware: answer an unhandled exception with a 500 and keep the connection.

    Once a response has started (an SSE stream mid-way) nothing valid can be sent any more;
    the exception is then re-raised and the server closes that connection, as it must.

    Args:
        app: the wrapped ASGI app.
        on_error: called with each exception answered here (the server counts them).
    """

    def __init__(self, app: ASGIApp, on_error: Callable[[Exception], None]) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_started = False

        async def watch(message: Message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if is_started:
                raise
            _log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            self.on_error(exc)
            message = f"internal error: {type(exc).__name__}: {exc}"
            body = error_body(message, type="server_error", code="internal_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)
