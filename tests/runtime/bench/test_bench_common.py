"""Bench engines keep the model's end-of-sequence ids; bench requests still decode a fixed count.

The benches decode a set number of tokens through ``SamplingParams(ignore_eos=True)``, the public
option, rather than by clearing ``Engine.eos_ids`` (a patch of the engine's state).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.bench._common import bench_engine, ttft
from tests.conftest import EOS_ID, make_config

PROMPT = [5, 9, 13, 17, 21]


def _llama(eos_id: int) -> Any:
    torch.manual_seed(0)
    config = make_config("llama")
    config.eos_token_id = eos_id
    # NOTE: transformers leaves from_config and PreTrainedModel.eval unannotated.
    return AutoModelForCausalLM.from_config(config).eval()  # type: ignore[no-untyped-call]


def test_bench_requests_decode_past_the_models_eos() -> None:
    greedy = ttft(bench_engine(_llama(EOS_ID), kv_bytes=1 << 20), PROMPT, max_tokens=4).token_ids
    assert len(greedy) == 4
    # The same weights with their second greedy token as the end-of-sequence id: a request
    # without ignore_eos would stop there; the bench's requests run to max_tokens.
    eng = bench_engine(_llama(greedy[1]), kv_bytes=1 << 20)
    assert eng.eos_ids == {greedy[1]}  # the engine's stop ids are the model's, not cleared
    done = ttft(eng, PROMPT, max_tokens=4)
    assert done.token_ids == greedy and done.finish_reason == "length"


def test_bench_mains_leave_torchs_threads_as_they_found_them() -> None:
    """``--threads`` sets torch's thread count for the bench only: after it returns or raises
    (a bench test's ``--threads 1`` once left every later test of the suite on one thread)."""
    from runtime.bench import choices, prefix, rag, stall, trace
    from runtime.bench._common import restores_torch_threads

    before = torch.get_num_threads()

    @restores_torch_threads
    def fails(argv: list[str]) -> int:
        torch.set_num_threads(1 if before > 1 else 2)
        raise ValueError(argv[0])

    with pytest.raises(ValueError, match="x"):
        fails(["x"])
    assert torch.get_num_threads() == before
    for main in (choices.main, prefix.prefix_main, rag.main, stall.main, trace.trace_main):
        assert getattr(main, "__wrapped__", None) is not None, main
