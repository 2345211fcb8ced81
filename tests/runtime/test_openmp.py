"""Releasing a thread's OpenMP workers (``runtime.model.openmp``): the right runtime is found, the
calling thread's workers go, results do not change, and the scheduler releases the submitting
thread's and, once idle, its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime import engine as engine_module
from runtime.engine import Engine
from runtime.model import openmp
from runtime.sampling.params import SamplingParams
from runtime.scheduler import loop as scheduler
from tests.conftest import save_tiny_model


def _required_runtime() -> str:
    path = openmp.openmp_library()
    if path is None:
        pytest.skip("no OpenMP runtime with omp_pause_resource_all is loaded")
    return path


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> torch.Tensor:
    """A product torch runs as a parallel region (on 2+ threads)."""
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    return a @ a


def test_finds_torchs_runtime_before_other_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other wheels map their own copy (sentencepiece's ``libgomp-<hash>.so``, listed first
    here): the one in torch's package directory is the one released."""
    path = _required_runtime()
    torch_dir = Path(torch.__file__).resolve().parent
    if not Path(path).resolve().is_relative_to(torch_dir):
        pytest.skip("this torch does not bundle its OpenMP runtime")
    other = "/opt/elsewhere/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0"
    monkeypatch.setattr(openmp, "_mapped_openmp", lambda: [other, path])
    openmp.openmp_library.cache_clear()
    try:
        assert openmp.openmp_library() == path
    finally:
        openmp.openmp_library.cache_clear()


def test_torchs_runtime_beside_sentencepieces_copy() -> None:
    """With sentencepiece imported (its wheel maps its own ``libgomp-<hash>``, which exports
    the same functions), the runtime found is still the one in torch's directory."""
    pytest.importorskip("sentencepiece")
    path = _required_runtime()
    torch_dir = Path(torch.__file__).resolve().parent
    if not Path(path).resolve().is_relative_to(torch_dir):
        pytest.skip("this torch does not bundle its OpenMP runtime")
    openmp.openmp_library.cache_clear()
    try:
        assert openmp.openmp_library() == path
        assert len(openmp._mapped_openmp()) >= 1
    finally:
        openmp.openmp_library.cache_clear()


_RELEASE_SCRIPT = """
import json, os, threading, time, torch
from runtime.model import openmp
count = lambda: len(os.listdir("/proc/self/task"))
work = lambda: torch.mm(a, a)
def settle(target):  # a joined thread's /proc entry may outlive the join a moment
    deadline = time.monotonic() + 5
    while count() > target and time.monotonic() < deadline:
        time.sleep(0.01)
torch.set_num_threads(2)
a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
work()  # this thread's pool, which the other thread's release must leave
seen = {}
def body():
    before = count()
    want = work()
    seen["with_pool"] = count() - before
    seen["released"] = openmp.release_thread_workers()
    settle(before)
    seen["after"] = count() - before
    seen["same"] = torch.equal(work(), want)
    seen["again"] = openmp.release_thread_workers() and openmp.release_thread_workers()
mine = count()
worker = threading.Thread(target=body)
worker.start()
worker.join()
settle(mine)
seen["kept"] = count() - mine
seen["mine_released"] = openmp.release_thread_workers()
seen["mine_after"] = count() - mine
print(json.dumps(seen))
"""


def test_release_frees_only_the_calling_threads_workers() -> None:
    """In a fresh process (no other test's threads coming and going), 2 torch threads: a
    parallel region on a new thread adds its worker thread, a release removes it (joined before
    it returns) and leaves the main thread's own pool alone, the next region works and gives the
    same result, and releasing where there is no pool is a no-op that succeeds."""
    _required_runtime()
    if not Path("/proc/self/task").exists():
        pytest.skip("needs Linux's /proc")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    want = {"with_pool": 1, "released": True, "after": 0, "same": True, "again": True,
            "kept": 0, "mine_released": True, "mine_after": -1}  # fmt: skip
    assert seen == want, seen


def test_scheduler_releases_the_submitter_and_itself_when_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every submission releases the submitting thread's workers; the loop thread releases its
    own once nothing waits or runs (not while a request is in flight)."""
    calls: list[tuple[str, bool]] = []
    release = openmp.release_thread_workers
    engine = Engine.from_pretrained(str(save_tiny_model("llama", tmp_path)))
    sched = engine.scheduler

    def recorded() -> bool:
        calls.append((threading.current_thread().name, bool(sched.waiting or sched.running)))
        return release()

    monkeypatch.setattr(scheduler, "release_thread_workers", recorded)
    me = threading.current_thread().name
    for _ in range(2):
        assert engine.generate("hello there", SamplingParams(max_tokens=3)).usage.completion_tokens
        deadline = time.monotonic() + 10
        while ("runtime-scheduler", False) not in calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls[0] == (me, False)  # the submitter's, before its request was queued
        assert ("runtime-scheduler", False) in calls  # the loop's own, once idle
        assert ("runtime-scheduler", True) not in calls  # never with work in flight
        calls.clear()
    engine.close()


def test_engine_releases_the_loading_threads_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading an engine runs parallel regions on the loading thread (a server's main thread);
    the constructor releases that thread's workers before returning."""
    calls: list[str] = []
    release = openmp.release_thread_workers

    def recorded() -> bool:
        calls.append(threading.current_thread().name)
        return release()

    monkeypatch.setattr(engine_module, "release_thread_workers", recorded)
    path = str(save_tiny_model("llama", tmp_path))
    loader = threading.Thread(target=lambda: Engine.from_pretrained(path).close(), name="loader")
    loader.start()
    loader.join()
    assert calls == ["loader"]


def test_a_forked_child_does_not_wait_for_its_parents_workers() -> None:
    """A child forked while the parent held a pool inherits it without its threads; libgomp's
    pause would wait for them forever, so in the child the release does nothing."""
    _required_runtime()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _parallel_work()
        pid = os.fork()
        if pid == 0:  # NOTE: the child: exit 0 only if the release returned False at once
            os._exit(0 if openmp.release_thread_workers() is False else 1)
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's release hung")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        torch.set_num_threads(threads)
