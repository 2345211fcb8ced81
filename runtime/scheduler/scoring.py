"""Prompt scoring: the prefill that keeps every prompt position's logits (prompt logprobs).

A request asking for ``prompt_logprobs`` is prefilled whole and uncached, its logits held
``_SCORED_CHUNK`` positions at a time to bound their memory, each position scored against the
prompt token that follows it (``sampler.prompt_logprobs``: the raw model distribution). It knows
the model runner and one request's KV row, never the scheduler, the prefix cache or sampling.
"""

from __future__ import annotations

import torch

from runtime.model.runner import ModelRunner
from runtime.outputs import TokenLogprob
from runtime.request.state import Request
from runtime.sampling.sampler import prompt_logprobs

__all__ = ["prefill_scored"]

_SCORED_CHUNK = 512
"""Prompt positions whose logits are held at once when prompt logprobs are asked for."""


def prefill_scored(runner: ModelRunner, req: Request) -> torch.Tensor:
    """Prefill ``req``'s whole prompt into its KV row computing every position's logits (in
    chunks, to bound their memory), recording ``req.prompt_logprobs`` (None for the first
    token, which nothing predicts).

    Returns:
        The last prompt position's ``[vocab]`` logits.
    """
    assert req.cached_len == 0 and req.kv is not None, "prompt logprobs skip the cache"
    ids, num_top = req.prompt_ids, req.params.prompt_logprobs or 0
    entries: list[TokenLogprob | None] = [None]  # NOTE: nothing predicts the first token
    for start in range(0, len(ids), _SCORED_CHUNK):
        logits = runner.forward(ids[start : start + _SCORED_CHUNK], req.kv, all_logits=True)
        nexts = ids[start + 1 : start + 1 + len(logits)]
        entries += prompt_logprobs(logits[: len(nexts)], nexts, num_top)
    req.prompt_logprobs = entries
    return logits[-1]
