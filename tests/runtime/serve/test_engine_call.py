"""The loop waker: rings from the scheduler thread reach the event loop as one callback a burst."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import anyio

from runtime.engine import Engine
from runtime.sampling.params import SamplingParams
from runtime.serve.engine_call import EngineCall, _LoopWaker


def test_rings_before_the_loop_runs_share_one_callback_and_wake_every_reader() -> None:
    loop = asyncio.new_event_loop()
    try:
        waker = _LoopWaker(loop)
        readers = [asyncio.Event() for _ in range(3)]

        # One decode step: the scheduler thread rings every running stream's reader.
        def ring_all() -> None:
            for reader in readers:
                waker.ring(reader)

        ringer = threading.Thread(target=ring_all)
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


def test_closing_a_call_whose_n_choices_are_still_queued_returns(llama_path: Path) -> None:
    # NOTE: the server closes a request whose client hung up while it was queued. Closing the
    # head first waited for the loop to admit it (forever: the forks were orphaned), losing a
    # worker thread per such request; now every choice is cancelled first.
    engine = Engine.from_pretrained(str(llama_path), kv_cache_bytes=1 << 22, block_size=4)
    engine.scheduler.pause()
    try:
        params = SamplingParams(max_tokens=4)
        call = EngineCall(lambda: engine.stream_choices([5, 6, 7, 8, 9], params, n=3))

        async def hang_up() -> None:
            with anyio.move_on_after(0.2):  # the paused loop never sends a first delta
                await call.start()
            await call.aclose()  # NOTE: shielded: a hang shows as the thread still alive

        closer = threading.Thread(target=anyio.run, args=(hang_up,), daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "closing the queued choices blocked"
        assert engine.scheduler_stats().num_waiting == 0
    finally:
        engine.scheduler.resume()
        engine.close()
