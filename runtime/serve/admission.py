"""Server-side admission: a bounded number of running requests plus a bounded wait queue.

A request either gets a running slot, waits in a queue of fixed length, or is refused at once
(the server answers 429) so memory never grows with the offered load. It knows nothing about
the engine or HTTP; a future continuous-batching scheduler sits behind it, not in it.
"""

from __future__ import annotations

import anyio

__all__ = ["Admission", "AdmissionFullError"]


class AdmissionFullError(Exception):
    """Every running slot is taken and the wait queue is full."""


class Admission:
    """Counts running and waiting requests; one instance per app (one event loop).

    Args:
        max_running: requests allowed inside the engine at once (>= 1).
        max_waiting: requests allowed to wait for a slot (>= 0); more are refused.

    Raises:
        ValueError: for out-of-range limits.
    """

    def __init__(self, *, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError(
                f"need max_running >= 1 and max_waiting >= 0, got {max_running!r}, {max_waiting!r}"
            )
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.num_running = 0
        self.num_waiting = 0
        self._slots = anyio.Semaphore(max_running)

    async def acquire(self) -> None:
        """Take a running slot, waiting in FIFO order if needed.

        Raises:
            AdmissionFullError: immediately, when the wait queue is full.
        """
        if self.num_running + self.num_waiting >= self.max_running + self.max_waiting:
            raise AdmissionFullError(
                f"server busy: {self.num_running} running, {self.num_waiting} waiting"
            )
        self.num_waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.num_waiting -= 1
        self.num_running += 1

    def release(self) -> None:
        """Give back a slot taken by ``acquire``."""
        assert self.num_running > 0, "release without acquire"
        self.num_running -= 1
        self._slots.release()

    def snapshot(self) -> tuple[int, int]:
        """``(num_running, num_waiting)`` now."""
        return self.num_running, self.num_waiting
