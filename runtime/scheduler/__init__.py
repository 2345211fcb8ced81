"""The scheduler: one loop thread that admits, prefills and decodes the running batch.

It knows requests, the model runner, the batch's KV rows and the prefix cache; it never imports
the server, the engine facade or the benches.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.scheduler.admission import AdmissionQueue
    from runtime.scheduler.config import SchedulerConfig, SchedulerStats
    from runtime.scheduler.loop import Scheduler

# NOTE: lazy, so importing the package loads none of its heavy submodules (torch).
_LAZY = {
    "AdmissionQueue": "runtime.scheduler.admission",
    "Scheduler": "runtime.scheduler.loop",
    "SchedulerConfig": "runtime.scheduler.config",
    "SchedulerStats": "runtime.scheduler.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime.scheduler' has no attribute {name!r}")


__all__ = [
    "AdmissionQueue",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
]
