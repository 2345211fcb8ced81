"""LocalBackend on a random-weight Llama: chat rendering, token carry-over, prefix-cache hits.

The multi-turn test is the contract of issue 7: on call n+1 of an append-only conversation with
tool calls, cached tokens >= 99% of the tokens shared with call n (prompt + generated ids).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from agentcache.agent import Agent, AgentConfig  # noqa: E402
from agentcache.backends import GenerationOptions, StreamEvent  # noqa: E402
from agentcache.backends.base import PromptInput  # noqa: E402
from agentcache.backends.local import LocalBackend  # noqa: E402
from agentcache.prompt import Document, PromptBuilder  # noqa: E402
from agentcache.rag import stdlib_sources  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(bpe_llama_dir: Path) -> Path:
    return bpe_llama_dir


class RecordingBackend(LocalBackend):
    """Keeps (prompt ids, prompt + generated ids, usage) of every call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], list[int], Any]] = []

    def stream(
        self, prompt: PromptInput, options: GenerationOptions | None = None
    ) -> Iterator[StreamEvent]:
        for event in super().stream(prompt, options):
            if event.response is not None:
                full = list(self._prev_ids)
                prompt_ids = full[: len(full) - len(self._prev_generated)]
                self.calls.append((prompt_ids, full, event.response.usage))
            yield event


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def lookup(name: str) -> str:
    """Return the documentation of a standard-library name.

    Args:
        name: Dotted name such as ``json.loads``.
    """
    docs = {s.source: s.text for s in stdlib_sources(max_files=20)}
    return next((text for source, text in docs.items() if name in source), "not found")[:600]


def test_carry_over_reuses_prompt_and_generated_ids(model_dir: Path) -> None:
    backend = LocalBackend(str(model_dir))
    history: list[dict[str, Any]] = [{"role": "user", "content": "What is json?"}]
    first = backend.complete(PromptBuilder().system("Be brief.").history(history).build())
    first_ids = list(backend._prev_ids)
    history += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And csv?"},
    ]
    prompt = PromptBuilder().system("Be brief.").history(history).build()
    ids = backend.prompt_ids(backend.render(prompt))
    fresh = backend._encode(backend.render(prompt))
    shared = common_prefix_len(first_ids, ids)
    # The carried ids are exactly the earlier sequence up to where the texts diverge ...
    assert (
        backend.last_carry.carried_tokens == shared >= len(first_ids) - len(backend._prev_generated)
    )
    # ... and the new ids decode to the same text as a fresh tokenization.
    assert backend._decode(ids) == backend._decode(fresh)


def test_multi_turn_agent_cached_tokens_cover_the_shared_prefix(model_dir: Path) -> None:
    backend = RecordingBackend(str(model_dir))
    docs = [Document(s.source, s.text) for s in stdlib_sources(max_files=12)[:6]]
    agent = Agent(
        backend,
        system="You answer questions about the Python standard library.",
        tools=[lookup],
        documents=docs,
        planner=lambda q: [("lookup", {"name": q.split()[-1].rstrip("?")})],
        config=AgentConfig(generation=GenerationOptions(max_tokens=12)),
    )
    for question in ["What does abc do?", "Explain argparse?", "And ast?"]:
        agent.run(question)
    ratios = []
    for (_, prev_full, _), (prompt_ids, _, usage) in zip(
        backend.calls, backend.calls[1:], strict=False
    ):
        shared = common_prefix_len(prev_full, prompt_ids)
        assert usage.cached_tokens >= 0.99 * shared, (usage.cached_tokens, shared)
        ratios.append(usage.cached_tokens / shared)
        print(f"prompt={len(prompt_ids)} shared={shared} cached={usage.cached_tokens}")
    assert len(ratios) == 2 and min(ratios) >= 0.99
    print(f"cached/shared per call: {[round(r, 4) for r in ratios]}")
    assert backend.calls[0][2].cached_tokens == 0
    assert all(u.cached_tokens > 0 for _, _, u in backend.calls[1:])


def test_local_backend_reports_usage_and_hermes_format(model_dir: Path) -> None:
    backend = LocalBackend(str(model_dir))
    assert backend.capabilities.tool_call_format == "hermes"
    events = list(
        backend.stream(PromptBuilder().user("hi").build(), GenerationOptions(max_tokens=5))
    )
    final = events[-1].response
    assert final is not None and final.usage.completion_tokens is not None
    assert 1 <= final.usage.completion_tokens <= 5
    assert "".join(e.text for e in events) == final.text
    assert final.usage.ttft_s is not None and final.usage.ttft_s > 0 and final.cost_usd == 0.0


def test_complete_accepts_plain_text_and_message_lists(model_dir: Path) -> None:
    backend = LocalBackend(str(model_dir))
    options = GenerationOptions(max_tokens=2)
    by_text = backend.complete("What is json?", options)
    backend.reset()
    by_messages = backend.complete([{"role": "user", "content": "What is json?"}], options)
    assert by_messages.usage.prompt_tokens is not None
    assert by_text.usage.prompt_tokens == by_messages.usage.prompt_tokens > 0


def test_mistyped_model_path_is_backend_unavailable(tmp_path: Path) -> None:
    from agentcache.exceptions import BackendUnavailableError

    missing = str(tmp_path / "no" / "such-model")
    with pytest.raises(BackendUnavailableError, match="such-model"):
        LocalBackend(missing)


def test_requests_the_engine_refuses_are_backend_errors(model_dir: Path) -> None:
    from agentcache.exceptions import BackendError

    backend = LocalBackend(str(model_dir))
    too_long = [5] * (backend.engine.max_context_len + 1)
    with pytest.raises(BackendError, match="context"):
        backend.measure_cold_ttft(too_long)
    with pytest.raises(BackendError, match="vocabulary"):
        backend.measure_cold_ttft([backend.engine.vocab_size + 7])
    huge = GenerationOptions(max_tokens=1)
    with pytest.raises(BackendError, match="context"):
        backend.complete("word " * (backend.engine.max_context_len + 10), huge)


def test_chatml_models_stop_at_a_new_turn_or_tool_response(model_dir: Path) -> None:
    from agentcache.backends.local import CHATML_STOPS, MARKUP_STOPS
    from runtime.engine import Prompt
    from runtime.request.state import Request
    from runtime.sampling.params import SamplingParams

    backend = LocalBackend(str(model_dir))
    seen: list[Any] = []
    real_make_request = backend.engine.make_request

    def recording_make_request(
        prompt: Prompt, params: SamplingParams | None = None, **kw: Any
    ) -> Request:
        seen.append(params)
        return real_make_request(prompt, params, **kw)

    backend.engine.make_request = recording_make_request  # type: ignore[method-assign]
    backend.complete("hi", GenerationOptions(max_tokens=2, stop=("END",)))
    (params,) = seen
    assert params.stop == ["END", *CHATML_STOPS, *MARKUP_STOPS]
    im_start = backend.engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert params.stop_token_ids == [im_start]


def test_measure_cold_ttft_recomputes_the_last_prompt_and_keeps_the_carry(model_dir: Path) -> None:
    backend = LocalBackend(str(model_dir))
    options = GenerationOptions(max_tokens=3)
    history: list[dict[str, Any]] = [{"role": "user", "content": "What is json? " * 8}]
    first = backend.complete(PromptBuilder().system("Be brief.").history(history).build(), options)
    ids = backend.last_prompt_ids
    assert len(ids) == first.usage.prompt_tokens
    cold = backend.measure_cold_ttft()
    assert (cold.prompt_tokens, cold.prefill_tokens_computed) == (len(ids), len(ids))
    assert cold.ttft_s > 0
    assert backend.last_prompt_ids == ids  # the carried conversation is untouched
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "csv?"}]
    second = backend.complete(PromptBuilder().system("Be brief.").history(history).build(), options)
    assert second.usage.cached_tokens and second.usage.cached_tokens >= 16


def test_warm_up_leaves_the_prefix_cache_and_the_carry_alone(model_dir: Path) -> None:
    backend = LocalBackend(str(model_dir))
    options = GenerationOptions(max_tokens=3)
    prompt = PromptBuilder().system("Be brief.").user("What is json? " * 8).build()
    backend.complete(prompt, options)
    ids, before = backend.last_prompt_ids, backend.engine.cache_stats()
    backend.warm_up()
    after = backend.engine.cache_stats()
    assert backend.last_prompt_ids == ids
    assert (after.num_blocks_used, after.hit_tokens) == (before.num_blocks_used, before.hit_tokens)
    assert after.queried_tokens > before.queried_tokens  # it did run through the engine
    backend.engine.check_integrity()


def test_loading_a_model_hides_the_weight_progress_bar_and_restores_it(
    model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    LocalBackend(str(model_dir))
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


def test_an_empty_cache_salt_is_refused_like_the_server_does(model_dir: Path) -> None:
    from agentcache.exceptions import ConfigError

    with pytest.raises(ConfigError, match="cache_salt"):
        LocalBackend(str(model_dir), cache_salt="")


def test_chunk_reuse_finds_documents_and_reuses_them_in_another_set(model_dir: Path) -> None:
    """Opt-in: each Document's KV is reused when the retrieved set changes (prefix breaks)."""
    docs = [Document(s.source, s.text[:400]) for s in stdlib_sources(max_files=12)[:4]]
    backend = LocalBackend(str(model_dir), chunk_reuse="exact")
    options = GenerationOptions(max_tokens=2)
    first = backend.complete(PromptBuilder().documents(docs[1:]).user("Which?").build(), options)
    backend.reset()
    # docs[0] sorts first: the prefix breaks at once, but docs 1..3 come from the chunk store.
    second = backend.complete(PromptBuilder().documents(docs).user("Which?").build(), options)
    assert first.usage.chunk_reuse_mode == "exact" and first.usage.chunk_reused_tokens == 0
    assert second.usage.chunk_reused_tokens is not None
    doc_tokens = [len(backend._encode(d.text)) for d in docs[1:]]
    assert second.usage.chunk_reused_tokens >= sum(doc_tokens) - 2 * len(doc_tokens)
    plain = LocalBackend(engine=backend.engine)
    assert plain.complete("hi", options).usage.chunk_reused_tokens is None


def test_document_spans_are_ordered_disjoint_and_tolerate_merged_edges() -> None:
    from agentcache.backends.local import document_spans

    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert document_spans(ids, [[2, 3], [6, 7]]) == ((1, 3), (5, 7))
    assert document_spans(ids, [[99, 4, 5, 98]]) == ((3, 5),)  # edges merged: the interior
    assert document_spans(ids, [[6, 7], [2, 3]]) == ((5, 7),)  # in order only
    assert document_spans(ids, [[8, 9]]) == ()  # would cover the last prompt token
    assert document_spans(ids, [[42]]) == ()


def test_every_weights_choice_is_the_runtimes() -> None:
    """``serve``'s ``--weights`` (derived from ``EngineConfig``) and the benches' (written out;
    checked before torch loads) must equal ``WeightsDtype``'s values; the SDK's ``LocalBackend``
    has ``EngineConfig`` check them."""
    from typing import get_args

    from agentcache.cli import build_parser
    from runtime.bench.load import _parser as load_parser
    from runtime.model.runner import WeightsDtype

    def choices(parser: Any) -> tuple[str, ...]:
        (action,) = [a for a in parser._actions if a.dest == "weights"]
        return tuple(action.choices)

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert isinstance(commands, dict)  # a subparsers action: command name -> parser
    serve = commands["serve"]
    assert choices(serve) == choices(load_parser()) == get_args(WeightsDtype)


def test_weights_reach_the_engine_and_bad_ones_are_refused(model_dir: Path) -> None:
    """``weights`` is the engine's (``serve --weights``); a value the engine does not know, or a
    16-bit ``dtype`` with anything but float32 weights, is a ConfigError before any load."""
    from agentcache.exceptions import ConfigError

    options = GenerationOptions(max_tokens=8, temperature=0.0)
    packed = LocalBackend(str(model_dir), weights="float32-packed")
    plain = LocalBackend(str(model_dir))
    assert packed.engine.runner.weights == "float32-packed"
    assert plain.engine.runner.weights == "float32"
    compact = packed.engine.runner.compact
    assert compact is not None
    native = compact.native
    assert compact.packed_products == (native is not None and native.is_vectorized)
    got, want = packed.complete("What is json?", options), plain.complete("What is json?", options)
    assert got.text == want.text and got.usage.completion_tokens == want.usage.completion_tokens
    packed.close()
    plain.close()
    for bad in ({"weights": "float16"}, {"weights": "bfloat16", "dtype": "bfloat16"}):
        with pytest.raises(ConfigError, match="weights (must be one of|bfloat16 needs dtype)"):
            LocalBackend(str(model_dir), **bad)  # type: ignore[arg-type]


def test_kv_dtype_reaches_the_engine_and_bad_ones_are_refused(model_dir: Path) -> None:
    """``kv_dtype`` is the engine's (``serve --kv-dtype``): ``float16`` holds the KV cache in fp16
    and still answers, cached and uncached alike on this model; ``auto`` keeps the model's dtype;
    a value the engine does not know, or a non-auto KV dtype beside a 16-bit ``dtype``, is a
    ConfigError."""
    from agentcache.exceptions import ConfigError

    options = GenerationOptions(max_tokens=8, temperature=0.0)
    half = LocalBackend(str(model_dir), kv_dtype="float16")
    plain = LocalBackend(str(model_dir))
    assert half.engine.kv_dtype == "float16" and plain.engine.kv_dtype == "float32"
    first, again = half.complete("What is json?", options), half.complete("What is json?", options)
    assert again.usage.cached_tokens is not None
    assert again.usage.cached_tokens > 0 and first.text == again.text
    half.close()
    plain.close()
    for bad in ({"kv_dtype": "int8"}, {"kv_dtype": "float16", "dtype": "bfloat16"}):
        with pytest.raises(ConfigError, match="kv_dtype"):
            LocalBackend(str(model_dir), **bad)  # type: ignore[arg-type]


def test_chunk_reuse_options_are_checked(model_dir: Path) -> None:
    from agentcache.exceptions import ConfigError

    with pytest.raises(ConfigError, match="chunk_reuse"):
        LocalBackend(str(model_dir), chunk_reuse="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="recompute_fraction"):
        LocalBackend(str(model_dir), chunk_reuse="blend", recompute_fraction=2.0)


@pytest.mark.parametrize(("arch", "why"), [("gpt2", "no rotary position embedding"),
                                           ("mistral_sliding", "sliding_window")])  # fmt: skip
def test_chunk_reuse_on_a_model_that_cannot_is_refused_at_construction(
    arch: str, why: str, tmp_path: Path
) -> None:
    from agentcache.exceptions import ConfigError
    from runtime import Engine
    from tests.conftest import save_tiny_model

    engine = Engine.from_pretrained(str(save_tiny_model(arch, tmp_path)))
    for mode in ("exact", "blend"):
        with pytest.raises(ConfigError, match=f"chunk_reuse='{mode}' is not available.*{why}"):
            LocalBackend(arch, engine=engine, chunk_reuse=mode)
    assert LocalBackend(arch, engine=engine).chunk_reuse is None  # off: nothing to refuse
    engine.close()


def test_a_disk_tier_keeps_the_cache_warm_across_backends(model_dir: Path, tmp_path: Path) -> None:
    """``kv_disk_dir`` with the default write-through: the next backend on the same directory
    serves the same prompt's blocks from disk, with the same answer."""
    prompt = PromptBuilder().system("Be brief. " * 20).user("What is json?").build()
    first = LocalBackend(str(model_dir), kv_disk_dir=str(tmp_path))
    cold = first.complete(prompt)
    first.close()
    second = LocalBackend(str(model_dir), kv_disk_dir=str(tmp_path))
    warm = second.complete(prompt)
    stats = second.engine.cache_stats()
    assert warm.text == cold.text and warm.usage.cached_tokens
    assert stats.disk_hit_tokens == warm.usage.cached_tokens >= 16
    second.close()
    from agentcache.exceptions import ConfigError

    with pytest.raises(ConfigError, match="kv_disk_bytes needs"):
        LocalBackend(str(model_dir), kv_disk_bytes=1 << 20)


def test_an_engine_config_reaches_the_engine_and_excludes_the_keywords(model_dir: Path) -> None:
    from agentcache.exceptions import ConfigError
    from runtime.config import EngineConfig
    from runtime.scheduler.config import SchedulerConfig

    config = EngineConfig(eviction="lru", scheduler=SchedulerConfig(max_batch_size=2))
    backend = LocalBackend(str(model_dir), config=config)
    assert backend.engine.config == config and backend.engine.prefix_cache.radix.policy == "lru"
    backend.close()
    with pytest.raises(ConfigError, match=r"not both: \['kv_cache_bytes'\]"):
        LocalBackend(str(model_dir), config=config, kv_cache_bytes=1 << 20)
