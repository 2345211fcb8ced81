"""Contract 1: the prefix cache never changes the answer (Llama, Qwen2, GPT-2, sliding-window).

For random prefix/suffix splits and multi-turn sequences, logits with reuse and with force-miss
agree within 1e-4 (fp32) at every step; greedy tokens match except at near-ties. The force-miss
path itself is checked against the model's own full forward without any cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine import Engine
from runtime.sampling.params import SamplingParams
from tests.conftest import ARCHS, VOCAB_SIZE, save_tiny_model

TOL = 1e-4


@pytest.fixture(scope="module", params=[*ARCHS, "llama-kv16"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """``llama-kv16``: Llama with an fp16 KV cache (``kv_dtype``): hit and miss both attend over
    the rounded K/V, so they must agree as closely as fp32's."""
    arch, _, kv = request.param.partition("-")
    path = save_tiny_model(arch, Path(tmp_path_factory.mktemp(request.param)))
    kv_dtype = "float16" if kv else "auto"
    eng = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4, kv_dtype=kv_dtype)
    return eng


def run(
    engine: Engine, ids: list[int], n: int, *, use_cache: bool
) -> tuple[list[int], list[torch.Tensor], int]:
    req = engine.make_request(
        ids,
        SamplingParams(ignore_eos=True, max_tokens=n),
        use_prefix_cache=use_cache,
        record_logits=True,
    )
    deltas = list(engine.run(req))
    completion = deltas[-1].completion
    assert completion is not None and req.logits_log is not None
    return completion.token_ids, req.logits_log, completion.usage.cached_tokens


def assert_same_answer(
    ref: tuple[list[int], list[torch.Tensor]], got: tuple[list[int], list[torch.Tensor]]
) -> None:
    """Logits within TOL while tokens agree; a token may differ only at a near-tie, then stop."""
    for step, (tok_a, tok_b, la, lb) in enumerate(zip(ref[0], got[0], ref[1], got[1], strict=True)):
        diff = (la - lb).abs().max().item()
        assert diff <= TOL, f"step {step}: logits differ by {diff:.2e}"
        if tok_a != tok_b:
            top2 = torch.topk(la, 2).values
            assert (top2[0] - top2[1]).item() < TOL, f"step {step}: tokens differ, no near-tie"
            return


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_prefix_hit_matches_force_miss(engine: Engine, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=2, max_size=48))
    split = data.draw(st.integers(1, len(ids)))
    run(engine, ids[:split], 1, use_cache=True)  # warm the cache with a prefix
    miss = run(engine, ids, 6, use_cache=False)
    hit = run(engine, ids, 6, use_cache=True)
    # Whole blocks of the warmed prefix are served (never the last prompt token).
    assert hit[2] >= min((split // 4) * 4, len(ids) - 1)
    assert_same_answer(miss[:2], hit[:2])
    engine.check_integrity()


def test_force_miss_matches_full_forward_without_cache(engine: Engine) -> None:
    """Our KV cache path equals the model's own cache-free forward (sliding window included);
    with an fp16 KV cache, within that rounding (the model's own forward keeps fp32 K/V)."""
    ids = [(7 * i + 3) % (VOCAB_SIZE - 3) + 3 for i in range(40)]
    tokens, logits, _ = run(engine, ids, 4, use_cache=False)
    full = ids + tokens[:-1]
    with torch.no_grad():
        ref = engine.runner.model(torch.tensor([full])).logits[0, len(ids) - 1 :]
    tol = TOL if engine.kv_dtype == "float32" else 1e-2
    for step, lg in enumerate(logits):
        assert (ref[step] - lg).abs().max().item() <= tol, f"step {step}"


def test_multi_turn_reuses_generated_tokens(engine: Engine) -> None:
    engine.flush_cache()
    turn1 = [(5 * i + 11) % (VOCAB_SIZE - 3) + 3 for i in range(21)]
    out1, _, _ = run(engine, turn1, 8, use_cache=True)
    turn2 = turn1 + out1 + [4, 5, 6, 7, 8]
    miss = run(engine, turn2, 6, use_cache=False)
    hit = run(engine, turn2, 6, use_cache=True)
    # Prompt + 7 generated tokens had KV (the 8th was sampled only): 28 -> 7 whole blocks.
    assert hit[2] == 28
    assert_same_answer(miss[:2], hit[:2])
    turn3 = turn2 + hit[0] + [9, 10]
    assert_same_answer(
        run(engine, turn3, 4, use_cache=False)[:2], run(engine, turn3, 4, use_cache=True)[:2]
    )
    engine.check_integrity()
