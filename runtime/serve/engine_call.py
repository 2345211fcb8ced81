"""One admitted engine stream, read from the event loop.

Opening and closing the engine stream run in worker threads taken from a per-app limiter sized
to the running slots. Deltas of a ``RequestStream`` (``runtime.Engine``) are read on the event
loop itself: the scheduler thread rings a waker, the loop polls every delta ready (merged), so
no thread hop is paid per token. Any other iterator (a test fake) is read through a worker
thread per delta. ``aclose`` is idempotent and shielded: it closes the engine stream (which
cancels the request and unpins its blocks) and gives the slot back. It knows no HTTP and no JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import anyio
from anyio.to_thread import run_sync

from runtime.outputs import Completion, StreamDelta
from runtime.request_stream import RequestStream
from runtime.serve.admission import Admission

__all__ = ["EngineCall"]


class EngineCall:
    """Slot + engine stream of one request.

    Args:
        open_stream: opens the engine stream (blocking; called in a worker thread).
        admission: where the running slot comes from.
        limiter: worker threads reserved for engine calls (one per running slot).
        on_close: called once from ``aclose`` with the final Completion, or None if cancelled.
    """

    def __init__(
        self,
        open_stream: Callable[[], Iterator[StreamDelta]],
        *,
        admission: Admission,
        limiter: anyio.CapacityLimiter,
        on_close: Callable[[Completion | None], None],
    ) -> None:
        self._open_stream = open_stream
        self._admission = admission
        self._limiter = limiter
        self._on_close = on_close
        self._it: Iterator[StreamDelta] | None = None
        self._ready = asyncio.Event()
        self._is_wake_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._has_slot = False
        self._is_closed = False
        self.completion: Completion | None = None

    async def start(self) -> StreamDelta | None:
        """Wait for a slot, open the stream and return its first delta.

        Raises:
            AdmissionFullError: the wait queue is full.
            InvalidRequestError: (and subclasses) raised by the engine for this prompt.
        """
        await self._admission.acquire()
        self._has_slot = True
        self._it = await run_sync(self._open_stream, limiter=self._limiter)
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
            delta = await run_sync(next, it, None, limiter=self._limiter)
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
        """Close the engine stream (cancelling it if unfinished) and release the slot, once."""
        if self._is_closed:
            return
        self._is_closed = True
        with anyio.CancelScope(shield=True):
            it, self._it = self._it, None
            if isinstance(it, RequestStream):
                it.set_waker(None)
            close = getattr(it, "close", None)
            try:
                if close is not None:
                    await run_sync(close, limiter=self._limiter)
            finally:
                if self._has_slot:
                    self._admission.release()
                self._on_close(self.completion)
