"""Release a thread's OpenMP worker threads, so the engine's compute thread keeps spinning ones.

torch's CPU kernels (its own ``at::parallel_for``, MKL, oneDNN and ``runtime.model.kernels``) run
their parallel regions on OpenMP (GNU libgomp in torch's Linux wheels). Each thread that starts a
parallel region gets its own pool of worker threads, kept after the region for the next one. Between
regions libgomp's workers spin for a while before sleeping, so the next region starts at once; but
once the process holds more OpenMP threads than CPUs, libgomp "throttles" that spin to almost
nothing (its ``gomp_throttled_spin_count``), and every region then wakes its workers through the
kernel. A decode step runs about 150 regions. A process that loaded a model on its main thread (a
pool there) and computes on the engine's scheduler thread (a second pool) is over that count on a
2-CPU machine (libgomp counts the main thread and both pools' workers: 3), and every forward paid
for it.

``release_thread_workers`` frees the calling thread's pool (OpenMP 5.0's
``omp_pause_resource_all(omp_pause_soft)``, which libgomp implements for the calling thread's
pool alone: ``gomp_pause_host`` in its ``team.c``); the next parallel region on that thread
builds a new one (well under a millisecond). Only GNU libgomp is used: LLVM's libomp (and
Intel's) pauses the whole runtime, which is not safe while another thread runs a region, so
with those it does nothing. The engine calls it on the thread that built it (after loading),
the scheduler on each submitting thread and on its own once its loop goes idle, so that while
requests run, the scheduler thread's pool is the only one (unless other code starts regions on
other threads meanwhile).

NOTE: measured on W1's 30 layers of one-row products (``linear_rows``, 2 threads, AMD EPYC host,
one process): 13.8-16.3 ms on the main thread alone; 22.0-40.4 ms on a second thread after the
main thread had run regions; 16.2-17.2 ms on that second thread after the main thread released
its pool (oneDNN's products likewise: 33.5-34.3 against 40.8-58.6 ms).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

__all__ = ["openmp_library", "release_thread_workers"]

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2
_NAMES = ("libgomp",)
_SONAMES = ("libgomp.so.1",)


@functools.cache
def openmp_library() -> str | None:
    """The GNU OpenMP runtime (libgomp) torch's kernels run on, as loaded in this process, or
    None: none is found (another runtime, or not Linux) or it lacks ``omp_pause_resource_all``.

    Other wheels bundle their own copy (sentencepiece's ``libgomp-<hash>.so``), so the ones in
    torch's package directory (or an auditwheel-repaired wheel's ``torch.libs``) come first
    (read from ``/proc/self/maps``), then libgomp's soname, which resolves to an already loaded
    library of that name. A library exporting ``__kmpc_fork_call`` is LLVM's or Intel's runtime
    (conda can link ``libgomp.so.1`` to LLVM's ``libomp``) and is never used.
    """
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:  # NOTE: not a Unix dlopen (Windows)
        return None
    torch_dir = Path(torch.__file__).resolve().parent
    homes = (torch_dir, torch_dir.parent / "torch.libs")
    candidates = [path for path in _mapped_openmp()
                  if any(Path(path).resolve().is_relative_to(home) for home in homes)]  # fmt: skip
    for path in (*candidates, *_SONAMES):
        try:
            lib = ctypes.CDLL(path, mode=no_load)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all") and not hasattr(lib, "__kmpc_fork_call"):
            return path
    return None


def _mapped_openmp() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; elsewhere none)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    paths = []
    for line in maps.read_text(errors="replace").splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, [path]
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(_NAMES):
            paths.append(fields[5])
    return list(dict.fromkeys(paths))


_FORKED = False
"""Whether this process is a fork's child: its copy of the parent's pools has no threads, and
pausing would wait for them forever."""


def _after_fork_in_child() -> None:
    global _FORKED
    _FORKED = True


if hasattr(os, "register_at_fork"):  # NOTE: Unix only, as is fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.cache
def _pause() -> Callable[[int], int] | None:
    path = openmp_library()
    if path is None:
        return None
    func = ctypes.CDLL(path, mode=os.RTLD_NOLOAD).omp_pause_resource_all
    func.argtypes, func.restype = [ctypes.c_int], ctypes.c_int
    return cast("Callable[[int], int]", func)


def release_thread_workers() -> bool:
    """Free the calling thread's OpenMP worker threads (see the module docstring).

    Safe at any time on any thread: it touches only the caller's own pool, does nothing inside a
    parallel region or where the thread has none, and changes no result. Returns whether the
    runtime accepted it (False where no libgomp with ``omp_pause_resource_all`` is loaded, and
    in a forked child: a pool copied from the parent has no threads to join, and libgomp would
    wait for them forever). Never raises.
    """
    if _FORKED:
        return False
    func = _pause()
    return func is not None and func(_OMP_PAUSE_SOFT) == 0
