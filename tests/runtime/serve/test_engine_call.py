"""The loop waker: rings from the scheduler thread reach the event loop as one callback a burst."""

from __future__ import annotations

import asyncio
import threading

from runtime.serve.engine_call import _LoopWaker


def test_rings_before_the_loop_runs_share_one_callback_and_wake_every_reader() -> None:
    loop = asyncio.new_event_loop()
    try:
        waker = _LoopWaker(loop)
        readers = [asyncio.Event() for _ in range(3)]
        # One decode step: the scheduler thread rings every running stream's reader.
        ringer = threading.Thread(target=lambda: [waker.ring(r) for r in readers])
        ringer.start()
        ringer.join()
        assert waker.num_callbacks == 1 and not any(r.is_set() for r in readers)
        loop.run_until_complete(asyncio.sleep(0))  # the loop runs the pending callback
        assert all(r.is_set() for r in readers)
        # The next step's ring finds nothing pending: a new callback.
        readers[0].clear()
        waker.ring(readers[0])
        loop.run_until_complete(asyncio.sleep(0))
        assert waker.num_callbacks == 2 and readers[0].is_set()
    finally:
        loop.close()
