"""One engine stream, read from the event loop.

Opening and closing the engine stream run in worker threads. Admission is the engine's alone:
the first poll submits the request to the scheduler's bounded queue, which raises
``EngineBusyError`` when full (the app answers 429). Deltas of a ``RequestStream``
(``runtime.Engine``) are read on the event loop itself: the scheduler thread rings a waker, the
loop polls every delta ready (merged), so no thread hop is paid per token. Any other iterator (a
test fake) is read through a worker thread per delta. ``aclose`` is idempotent and shielded: it
closes the engine stream (which cancels the request and unpins its blocks). It knows no HTTP and
no JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import anyio
from anyio.to_thread import run_sync

from runtime.outputs import Completion, StreamDelta
from runtime.request_stream import RequestStream

__all__ = ["EngineCall"]


class EngineCall:
    """The engine stream of one request.

    Args:
        open_stream: opens the engine stream (blocking; called in a worker thread).
    """

    def __init__(self, open_stream: Callable[[], Iterator[StreamDelta]]) -> None:
        self._open_stream = open_stream
        self._it: Iterator[StreamDelta] | None = None
        self._ready = asyncio.Event()
        self._is_wake_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_closed = False
        self.completion: Completion | None = None

    async def start(self) -> StreamDelta | None:
        """Open the stream (which submits the request) and return its first delta.

        Raises:
            EngineBusyError: the scheduler's queue is full.
            InvalidRequestError: (and subclasses) raised by the engine for this prompt.
        """
        self._it = await run_sync(self._open_stream)
        if isinstance(self._it, RequestStream):
            self._loop = asyncio.get_running_loop()
            self._it.set_waker(self._wake)
        return await self.next()

    async def next(self) -> StreamDelta | None:
        """The next delta, or None after the last one (which carries the Completion).

        From a ``RequestStream`` the delta merges every token ready now (one or more).
        """
        it = self._it
        if it is None:
            return None
        if isinstance(it, RequestStream):
            delta = await self._poll(it)
        else:
            delta = await run_sync(next, it, None)
        if delta is not None and delta.completion is not None:
            self.completion = delta.completion
        return delta

    async def _poll(self, it: RequestStream) -> StreamDelta | None:
        while True:
            # NOTE: clear the flag before polling: a delta posted after the poll rings again.
            self._is_wake_pending = False
            delta = it.poll()
            if delta is not None or it.is_done:
                return delta
            await self._ready.wait()
            self._ready.clear()

    def _wake(self) -> None:
        """Scheduler thread: schedule one wake-up of the reader (skipped while one is pending)."""
        if self._is_wake_pending or self._loop is None:
            return
        self._is_wake_pending = True
        self._loop.call_soon_threadsafe(self._ready.set)

    async def drain(self, first: StreamDelta | None) -> Completion:
        """Consume the stream to its end and return the Completion."""
        delta = first
        while delta is not None and delta.completion is None:
            delta = await self.next()
        assert self.completion is not None, "engine stream ended without a Completion"
        return self.completion

    async def aclose(self) -> None:
        """Close the engine stream (cancelling it if unfinished), once."""
        if self._is_closed:
            return
        self._is_closed = True
        with anyio.CancelScope(shield=True):
            it, self._it = self._it, None
            if isinstance(it, RequestStream):
                it.set_waker(None)
            close = getattr(it, "close", None)
            if close is not None:
                await run_sync(close)
