"""The real default model, SmolLM2-135M-Instruct (``smollm2-135m``): caching never changes its
answer. It is pulled into the user cache folder (``AGENTCACHE_HOME``, default
``~/.cache/agentcache/models``) on the first run, so later runs (and CI runs on the same
machine) load it in seconds; where it cannot be pulled (offline, no wheel) the test is skipped
with the pull's own one-line reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime.engine import Engine
from runtime.exceptions import ModelLoadError
from runtime.models.pull import PullError, pull
from runtime.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

CONTEXT = (
    'Answer from the document only.\n<document id="kb-7">The Vorlan river runs 312 km from '
    "Mount Teshi to the Grey Sea. Its only port, Ambrel, was founded in 1642 by salt traders."
    "</document>"
)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    try:
        pull("smollm2-135m", quiet=True)
    except PullError as exc:
        pytest.skip(f"smollm2-135m cannot be pulled here: {exc}")
    try:
        eng = Engine.from_pretrained("smollm2-135m")
    except ModelLoadError as exc:  # pragma: no cover - a damaged pull is a failure, not a skip
        pytest.fail(str(exc))
    yield eng
    eng.close()


def _greedy(eng: Engine, ids: list[int], *, use_cache: bool) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    request = eng.make_request(ids, params, use_prefix_cache=use_cache)
    completion = list(eng.run(request))[-1].completion
    assert completion is not None
    return list(completion.token_ids), completion.usage.cached_tokens


def test_greedy_answers_equal_with_the_prefix_cache_on_and_off(engine: Engine) -> None:
    turn1 = [{"role": "system", "content": CONTEXT},
             {"role": "user", "content": "How long is the Vorlan river?"}]  # fmt: skip
    ids1 = engine.render_chat(turn1)
    off1, _ = _greedy(engine, ids1, use_cache=False)
    miss1, _ = _greedy(engine, ids1, use_cache=True)  # stores the prompt
    hit1, cached = _greedy(engine, ids1, use_cache=True)
    assert off1 == miss1 == hit1 and cached > len(ids1) // 2
    # A follow-up turn: the whole first turn (system, question, answer) comes from the cache.
    answer = engine.tokenizer.decode(hit1, skip_special_tokens=True)
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "Who founded Ambrel, and when?"}]  # fmt: skip
    ids2 = engine.render_chat(turn2)
    off2, _ = _greedy(engine, ids2, use_cache=False)
    hit2, cached2 = _greedy(engine, ids2, use_cache=True)
    assert off2 == hit2 and cached2 > len(ids1) // 2
