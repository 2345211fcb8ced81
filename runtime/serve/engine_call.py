"""One engine call: the streams of every choice of one HTTP request, read from the event loop.

A request opens one engine stream per choice (``n`` choices of each prompt) in a worker thread.
Admission is the engine's alone: opening submits to the scheduler's bounded queue, which raises
``EngineBusyError`` when full (the app answers 429). Deltas of ``RequestStream``s
(``runtime.Engine``) are read on the event loop itself: the scheduler thread rings a shared
waker, the loop polls every stream (merged deltas), so no thread hop is paid per token; the
rings of one decode step (one per running stream) reach the loop as one callback. Any
other iterator (a test fake) is read through a worker thread per delta, one stream after the
other. ``aclose`` is idempotent and shielded: it closes every engine stream (which cancels
unfinished choices and unpins their blocks). It knows no HTTP and no JSON.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import anyio
from anyio.to_thread import run_sync

from runtime.outputs import Completion, StreamDelta, Usage
from runtime.stream import RequestStream

__all__ = ["ChoiceDelta", "EngineCall"]


class ChoiceDelta(NamedTuple):
    """A delta of one choice: ``index`` is its position in the response's ``choices``."""

    choice: int
    """Position in the response's ``choices`` (prompt * n + choice)."""
    delta: StreamDelta


class _LoopWaker:
    """Wakes readers on one event loop from the scheduler thread, one loop callback per burst.

    A decode step posts a delta to every running stream; waking each reader with its own
    ``call_soon_threadsafe`` paid one self-pipe write per stream per token. Rings that arrive
    before the loop ran the pending callback join it instead. Thread-safe.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[asyncio.Event] = []
        self.num_callbacks = 0
        """Loop callbacks scheduled so far (one per burst of rings)."""

    def ring(self, ready: asyncio.Event) -> None:
        """Scheduler thread: have the loop set ``ready`` soon."""
        with self._lock:
            is_first = not self._pending
            self._pending.append(ready)
            self.num_callbacks += is_first
        if is_first:
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for ready in pending:
            ready.set()


_WAKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = (
    weakref.WeakKeyDictionary()
)
"""One waker per event loop; only that loop's thread adds to it."""


def _loop_waker(loop: asyncio.AbstractEventLoop) -> _LoopWaker:
    """The waker of ``loop`` (made on first use; call from the loop's own thread)."""
    waker = _WAKERS.get(loop)
    if waker is None:
        waker = _WAKERS[loop] = _LoopWaker(loop)
    return waker


class EngineCall:
    """The engine streams (one per choice) of one request.

    Args:
        open_streams: opens the engine streams, in choice order (blocking; worker thread).
    """

    def __init__(self, open_streams: Callable[[], Sequence[Iterator[StreamDelta]]]) -> None:
        self._open_streams = open_streams
        self._its: list[Iterator[StreamDelta]] = []
        self._is_done: list[bool] = []
        self._next_index = 0
        self._ready = asyncio.Event()
        self._is_wake_pending = False
        self._waker: _LoopWaker | None = None
        self._is_closed = False
        self.completions: list[Completion | None] = []
        """Each choice's Completion once its last delta was read."""
        self.prefilled_usages: list[Usage | None] = []
        """Set by ``aclose``: each choice's Usage once its prefill ran (so the engine counted its
        prefix-cache query and hits), else None; a cancelled choice's output count is partial."""

    @property
    def num_choices(self) -> int:
        """Choices opened (0 before ``start``)."""
        return len(self._its)

    async def start(self) -> ChoiceDelta | None:
        """Open the streams (which submits the request) and return the first delta of any choice.

        Raises:
            EngineBusyError: the scheduler's queue is full.
            InvalidRequestError: (and subclasses) raised by the engine for this prompt.
        """
        self._its = list(await run_sync(self._open_streams))
        self._is_done = [False] * len(self._its)
        self.completions = [None] * len(self._its)
        self._waker = _loop_waker(asyncio.get_running_loop())
        for it in self._its:
            if isinstance(it, RequestStream):
                it.set_waker(self._wake)
        return await self.next()

    async def next(self) -> ChoiceDelta | None:
        """The next delta of some choice, or None once every choice delivered its last one.

        From ``RequestStream``s a delta merges every token of that choice ready now; choices
        are polled round-robin so none starves.

        Raises:
            Exception: whatever a choice's engine stream raised (it failed; see ``aclose``).
        """
        while self._its and not all(self._is_done):
            found = await self._read()
            if found is None:
                continue
            index, delta = found
            if delta is None:
                self._is_done[index] = True
                continue
            if delta.completion is not None:
                self.completions[index] = delta.completion
                self._is_done[index] = True
            return ChoiceDelta(index, delta)
        return None

    async def _read(self) -> tuple[int, StreamDelta | None] | None:
        """One read: ``(index, delta or None at its end)``, or None after a wake-up wait."""
        if not all(isinstance(it, RequestStream) for it in self._its):
            index = self._is_done.index(False)
            delta = await run_sync(next, self._its[index], None)
            return index, delta
        # NOTE: clear the flag before polling: a delta posted after the poll rings again.
        self._is_wake_pending = False
        count = len(self._its)
        for step in range(count):
            index = (self._next_index + step) % count
            it = self._its[index]
            assert isinstance(it, RequestStream)
            if self._is_done[index]:
                continue
            delta = it.poll()
            if delta is not None or it.is_done:
                self._next_index = index + 1
                return index, delta
        await self._ready.wait()
        self._ready.clear()
        return None

    def _wake(self) -> None:
        """Scheduler thread: schedule one wake-up of the reader (skipped while one is pending)."""
        if self._is_wake_pending or self._waker is None:
            return
        self._is_wake_pending = True
        self._waker.ring(self._ready)

    async def drain(self, first: ChoiceDelta | None) -> list[Completion]:
        """Consume every stream to its end and return the Completions in choice order."""
        item = first
        while item is not None:
            item = await self.next()
        done = [c for c in self.completions if c is not None]
        assert len(done) == len(self._its), "an engine stream ended without a Completion"
        return done

    async def aclose(self) -> None:
        """Close the engine streams (cancelling unfinished ones), once."""
        if self._is_closed:
            return
        self._is_closed = True
        with anyio.CancelScope(shield=True):
            its, self._its = self._its, []
            for it in its:
                if isinstance(it, RequestStream):
                    # NOTE: all choices first: a queued group then leaves the queue whole,
                    # instead of its head waiting to be admitted for forks about to close.
                    it.set_waker(None)
                    it.cancel()
            for it in its:
                close = getattr(it, "close", None)
                if close is not None:
                    await run_sync(close)
            self.prefilled_usages = [
                _prefilled_usage(it, done) for it, done in zip(its, self.completions, strict=True)
            ]


def _prefilled_usage(it: Iterator[StreamDelta], completion: Completion | None) -> Usage | None:
    """A closed choice's Usage: its Completion's, or read from its prefilled engine request."""
    if completion is not None:
        return completion.usage
    # NOTE: read only after ``close``, which waits until the scheduler released the request.
    if isinstance(it, RequestStream) and it.request.t_first > 0:
        return it.request.usage
    return None
