"""Per-request state: prompt ids, its KV cache, the pinned prefix node, output and timings.

A scheduler drives a Request step by step (admit -> prefill -> decode* -> release); this module
only holds the state and knows nothing about the model or the tree's internals.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from runtime._detokenizer import Detokenizer
from runtime.kv_cache import RequestKVCache
from runtime.outputs import FinishReason
from runtime.radix_cache import Namespace, TreeNode
from runtime.sampling import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    RELEASED = "released"


@dataclass(slots=True, eq=False)
class Request:
    """Mutable state of one generation."""

    prompt_ids: list[int]
    params: SamplingParams
    namespace: Namespace
    max_total_len: int
    """Prompt + output may not exceed this many positions (the model's context)."""
    stop_ids: frozenset[int]
    detokenizer: Detokenizer
    generator: torch.Generator
    use_prefix_cache: bool = True
    status: RequestStatus = RequestStatus.WAITING
    kv: RequestKVCache | None = None
    node: TreeNode | None = None
    """The prefix-cache node pinned for this request (released exactly once)."""
    cached_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    logits_log: list[torch.Tensor] | None = None
    """When set (debug/tests), the ``[vocab]`` logits of every sampling step are appended."""

    @property
    def all_ids(self) -> list[int]:
        """Prompt followed by generated ids."""
        return self.prompt_ids + self.output_ids
