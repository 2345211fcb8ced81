"""Grammar-constrained decoding on the bundled ``tiny`` model (xgrammar masks, per row).

Constrained output follows its JSON schema; greedy constrained output is the same with the prefix
cache on and off; rows without a grammar decode exactly as they would alone; a grammar that
fails ends its own row only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from typing import TypedDict, Unpack

import pytest
import torch

from runtime.engine import Engine
from runtime.exceptions import InvalidRequestError, SamplingError
from runtime.outputs import Completion
from runtime.sampling.grammar import Grammar, GrammarError, GrammarMatcher, JsonSchemaSpec
from runtime.sampling.params import SamplingParams

TOL = 1e-4
SCHEMA = {
    "type": "object",
    "properties": {
        "module": {"type": "string", "enum": ["json", "re", "os"]},
        "stable": {"type": "boolean"},
    },
    "required": ["module", "stable"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Which module parses JSON? Answer in JSON."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.from_pretrained("tiny", kv_cache_bytes=8 << 20, block_size=4)
    eng.debug_integrity = True
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def grammar(engine: Engine) -> Grammar:
    return engine.compile_grammar(JsonSchemaSpec(json.dumps(SCHEMA)))


class Sampling(TypedDict, total=False):
    """The ``SamplingParams`` fields these tests vary."""

    temperature: float
    seed: int


def complete(engine: Engine, req_grammar: Grammar | None, **kwargs: Unpack[Sampling]) -> Completion:
    ids = engine.render_chat(CHAT)
    (stream,) = engine.stream_choices(
        ids, SamplingParams(max_tokens=40, **kwargs), grammar=req_grammar
    )
    completion = list(stream)[-1].completion
    assert completion is not None
    return completion


def test_constrained_output_follows_the_schema(engine: Engine, grammar: Grammar) -> None:
    cases: tuple[Sampling, ...] = ({}, {"temperature": 1.0, "seed": 5})
    for kwargs in cases:
        done = complete(engine, grammar, **kwargs)
        assert done.finish_reason == "stop"
        value = json.loads(done.text)
        assert set(value) == {"module", "stable"} and value["module"] in {"json", "re", "os"}
        assert isinstance(value["stable"], bool)
    assert engine.scheduler_stats().num_blocks_pinned == 0


def test_invalid_schema_is_an_invalid_request(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="^json_schema: properties must be an object$"):
        engine.compile_grammar(JsonSchemaSpec('{"type": "object", "properties": 5}'))
    # xgrammar's log prefix ("[11:36:30] /project/cpp/json_schema_converter.cc:5082: ") is cut.
    with pytest.raises(InvalidRequestError, match='^json_schema: unsupported type "wat"$'):
        engine.compile_grammar(JsonSchemaSpec('{"type": "wat"}'))


def run_logged(
    engine: Engine, grammar: Grammar, *, use_cache: bool, n: int = 1
) -> list[tuple[list[int], list[torch.Tensor]]]:
    head = engine.make_request(
        engine.render_chat(CHAT),
        SamplingParams(max_tokens=30),
        use_prefix_cache=use_cache,
        record_logits=True,
        grammar=grammar,
        n=n,
    )
    out = []
    for req, stream in zip((head, *head.forks), engine.run_choices(head), strict=True):
        completion = list(stream)[-1].completion
        assert completion is not None and req.logits_log is not None
        out.append((completion.token_ids, req.logits_log))
    return out


def assert_same_answer(
    ref: tuple[list[int], list[torch.Tensor]], got: tuple[list[int], list[torch.Tensor]]
) -> None:
    """Raw logits within TOL while tokens agree; tokens may differ only at a near-tie of the two
    (both were allowed by the grammar, whose state is the same up to that step)."""
    for step, (tok_a, tok_b, la, lb) in enumerate(zip(ref[0], got[0], ref[1], got[1], strict=True)):
        diff = (la - lb).abs().max().item()
        assert diff <= TOL, f"step {step}: logits differ by {diff:.2e}"
        if tok_a != tok_b:
            assert abs(la[tok_a].item() - la[tok_b].item()) < 2 * TOL, f"step {step}: no tie"
            return
    assert len(ref[0]) == len(got[0])


def test_constrained_greedy_is_the_same_with_the_prefix_cache_on_and_off(
    engine: Engine, grammar: Grammar
) -> None:
    engine.flush_cache()
    (miss,) = run_logged(engine, grammar, use_cache=False)
    complete(engine, None)  # stores the chat prompt's blocks
    hits = run_logged(engine, grammar, use_cache=True, n=2)
    assert engine.cache_stats().hit_tokens > 0
    for hit in hits:
        assert_same_answer(miss, hit)
    engine.check_integrity()


class _FailingMatcher(GrammarMatcher):
    """A real matcher that raises on its ``fail_at``-th call (a stand-in for a grammar bug)."""

    def __init__(self, inner: GrammarMatcher, fail_at: int) -> None:
        self.__dict__.update(inner.__dict__)
        self._calls = 0
        self._fail_at = fail_at

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> None:
        self._calls += 1
        if self._calls == self._fail_at:
            raise GrammarError("grammar state corrupted (test)")
        super().__call__(output_ids, logits)


def test_a_failing_grammar_ends_its_row_alone(engine: Engine, grammar: Grammar) -> None:
    ids, params = engine.render_chat(CHAT), SamplingParams(max_tokens=24)
    alone = engine.make_request(ids, params, record_logits=True)
    alone_done = list(engine.run(alone))[-1].completion
    healthy = engine.make_request(ids, params, record_logits=True)
    constrained = engine.make_request(
        engine.render_chat(CHAT), SamplingParams(max_tokens=24), grammar=grammar
    )
    (matcher,) = constrained.logits_processors
    assert isinstance(matcher, GrammarMatcher)
    constrained.logits_processors = [_FailingMatcher(matcher, fail_at=4)]
    results: dict[str, object] = {}

    def read(name: str, req: object) -> None:
        try:
            results[name] = list(engine.run(req))[-1].completion  # type: ignore[arg-type]
        except SamplingError as exc:
            results[name] = exc

    threads = [
        threading.Thread(target=read, args=("healthy", healthy)),
        threading.Thread(target=read, args=("constrained", constrained)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    failed = results["constrained"]
    assert isinstance(failed, SamplingError) and "grammar state corrupted" in str(failed)
    done = results["healthy"]
    assert isinstance(done, Completion) and alone_done is not None
    assert alone.logits_log is not None and healthy.logits_log is not None
    # Rows without a grammar are untouched by another row's mask (or its failure).
    assert_same_answer(
        (alone_done.token_ids, alone.logits_log), (done.token_ids, healthy.logits_log)
    )
    engine.check_integrity()
    assert engine.scheduler_stats().num_blocks_pinned == 0
