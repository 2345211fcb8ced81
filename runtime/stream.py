"""RequestStream: the consumer's end of one request, read blocking (``next``) or polled.

The scheduler loop posts deltas (or one exception) to the request's outbox and rings its waker;
this object reads them. ``next`` blocks for one delta per token; ``poll`` never blocks and merges
every delta posted so far into one, so an event loop woken by ``set_waker`` reads a burst in one
go. It knows the request and the scheduler's submit/cancel, nothing about HTTP or the model.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from runtime.outputs import StreamDelta
from runtime.request.state import Request

if TYPE_CHECKING:
    from runtime.scheduler.loop import Scheduler

__all__ = ["RequestStream", "merge_deltas"]


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """One delta with the token ids, text and logprobs of ``deltas`` in order; the last one's
    ending."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return StreamDelta(
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        finish_reason=last.finish_reason,
        completion=last.completion,
        logprobs=[lp for d in deltas for lp in d.logprobs],
        prompt_logprobs=deltas[0].prompt_logprobs,
    )


class RequestStream(Iterator[StreamDelta]):
    """What ``Engine.stream`` returns: the request is submitted on the first ``next``/``poll``.

    Not thread-safe: one consumer thread (or one event loop) reads it. ``close`` (or garbage
    collection) before the last delta cancels the request and releases what it pinned.
    """

    def __init__(self, req: Request, scheduler: Scheduler, *, is_submitted: bool = False) -> None:
        """``is_submitted``: the caller already submitted ``req`` (or its group's head)."""
        self._req = req
        self._scheduler = scheduler
        self._backlog: deque[StreamDelta | BaseException] = deque()
        self._is_submitted = is_submitted
        self.is_done = False
        """True after the last delta (or the error) was handed out, or after ``close``."""

    @property
    def request(self) -> Request:
        """The request this stream reads."""
        return self._req

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """Call ``waker()`` from the scheduler thread each time a delta or error is posted.

        The waker must be quick and thread-safe (e.g. ``loop.call_soon_threadsafe(...)``); an
        exception it raises is ignored. Set it before the first ``poll``.
        """
        self._req.waker = waker

    def __next__(self) -> StreamDelta:
        """The next delta (one per token), blocking until the scheduler posts it.

        Raises:
            StopIteration: after the last delta.
            EngineBusyError, PromptTooLongError, RuntimeEngineError: as ``Engine.stream``.
        """
        if self.is_done:
            raise StopIteration
        self._submit()
        item = self._backlog.popleft() if self._backlog else self._req.outbox.get()
        return self._hand_out(item)

    def poll(self) -> StreamDelta | None:
        """Every delta posted so far, merged into one; None when none is ready (never blocks).

        Raises:
            EngineBusyError, PromptTooLongError, RuntimeEngineError: as ``Engine.stream``; an
            error posted after some deltas is raised by the poll after the one returning them.
        """
        if self.is_done:
            return None
        self._submit()
        outbox = self._req.outbox
        while True:
            try:
                self._backlog.append(outbox.get_nowait())
            except queue.Empty:
                break
        if self._backlog and isinstance(self._backlog[0], BaseException):
            return self._hand_out(self._backlog.popleft())
        ready: list[StreamDelta] = []
        while self._backlog and isinstance(self._backlog[0], StreamDelta):
            item = self._backlog.popleft()
            assert isinstance(item, StreamDelta)
            ready.append(item)
        return self._hand_out(merge_deltas(ready)) if ready else None

    def cancel(self) -> None:
        """Cancel the request if it is unfinished, without waiting (``close`` then waits).

        Cancel every choice of a group before closing any: closing a queued head first waits
        until the loop admits it for its forks, still live then.
        """
        if not self.is_done and self._is_submitted:
            self._scheduler.cancel(self._req, wait=False)

    def close(self) -> None:
        """Cancel the request if it is unfinished and wait until its pins are released."""
        if self.is_done:
            return
        self.is_done = True
        if self._is_submitted:
            self._scheduler.cancel(self._req)

    def __del__(self) -> None:
        # NOTE: never wait here (this may run on the scheduler thread): flag it, the loop releases.
        if not self.is_done and self._is_submitted:
            self.is_done = True
            self._scheduler.cancel(self._req, wait=False)

    def _submit(self) -> None:
        if self._is_submitted:
            return
        try:
            self._scheduler.submit(self._req)
        except BaseException:
            self.is_done = True  # NOTE: never queued, so nothing to cancel or release
            raise
        self._is_submitted = True

    def _hand_out(self, item: StreamDelta | BaseException) -> StreamDelta:
        if isinstance(item, BaseException):
            self.is_done = True
            raise item
        self.is_done = item.completion is not None
        return item
