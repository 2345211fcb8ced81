"""One request's life inside the engine: the builder (the one validator), the per-request state, the
incremental detokenizer and the hold-back rule. Knows sampling params and the prefix cache's
namespace; never imports the scheduler, the server or the model runner's internals."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.request.builder import RequestBuilder, choice_seed
    from runtime.request.detokenizer import Detokenizer
    from runtime.request.holdback import held_back_len
    from runtime.request.state import Request, RequestStatus

# NOTE: lazy, so importing the package loads none of its heavy submodules (torch).
_LAZY = {
    "Detokenizer": "runtime.request.detokenizer",
    "Request": "runtime.request.state",
    "RequestBuilder": "runtime.request.builder",
    "RequestStatus": "runtime.request.state",
    "choice_seed": "runtime.request.builder",
    "held_back_len": "runtime.request.holdback",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime.request' has no attribute {name!r}")


__all__ = [
    "Detokenizer",
    "Request",
    "RequestBuilder",
    "RequestStatus",
    "choice_seed",
    "held_back_len",
]
