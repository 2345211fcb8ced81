"""Engine behaviour around the model: inputs, errors, streaming, cancel, threads, salts, stats.

One tiny random Llama saved with its tokenizer and loaded through ``Engine.from_pretrained``.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from runtime import (
    Engine,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    SamplingParams,
)
from runtime.model.names import is_local_path
from runtime.model.runner import reuse_blocker
from runtime.sampling.params import SEED_MAX, SEED_MIN
from tests.conftest import EOS_ID, VOCAB_SIZE, make_config, save_tiny_model

PROMPT = [(3 * i + 5) % (VOCAB_SIZE - 3) + 3 for i in range(30)]


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Engine:
    return Engine.from_pretrained(str(llama_path), kv_cache_bytes=1 << 20, block_size=4)


def test_from_pretrained_loads_tokenizer_and_template(engine: Engine) -> None:
    ids = engine.render_chat([{"role": "user", "content": "w1 w2"}])
    assert (
        engine.tokenizer.decode(ids) == "<|im_start|> user w1 w2 <|im_end|> <|im_start|> assistant"
    )
    assert engine.max_context_len == 256 and "llama" in engine.model_id
    completion = engine.generate(
        [{"role": "user", "content": "w1 w2"}], SamplingParams(ignore_eos=True, max_tokens=3)
    )
    assert completion.usage.prompt_tokens == len(ids)


def _no_hub(*args: object, **kwargs: object) -> None:
    raise AssertionError("a filesystem path must not reach from_pretrained / the hub")


@pytest.mark.parametrize(
    "name", ["/nope/agentcache-model", "./nope", "../nope", "~/nope-agentcache", "a/b/c"]
)
def test_missing_local_path_is_a_load_error_without_the_hub(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", _no_hub)
    with pytest.raises(ModelLoadError, match="no such model directory .*bundled name: tiny"):
        Engine.from_pretrained(name)


def _raise_os_error(*args: object, **kwargs: object) -> None:
    raise OSError("not a model folder")


@pytest.mark.parametrize("name", ["org/name", "gpt2"])
def test_hub_ids_still_go_to_from_pretrained(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not is_local_path(name)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", _raise_os_error)
    with pytest.raises(ModelLoadError, match="cannot load model .*not a model folder"):
        Engine.from_pretrained(name)


def test_missing_model_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such model directory"):
        Engine.from_pretrained(str(tmp_path / "nope"))


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ([], None, InvalidRequestError, "empty"),
        ("", None, InvalidRequestError, "empty"),
        ([1] * 300, None, PromptTooLongError, "context is 256"),
        ([VOCAB_SIZE + 5], None, InvalidRequestError, "outside the vocabulary"),
        ([5, 6], SamplingParams(stop_token_ids=[10_000]), InvalidRequestError, "not in the vocab"),
        ("a\ud800", None, InvalidRequestError, "surrogate"),  # was the tokenizer's TypeError
        ([{"role": "user", "content": "\udc00"}], None, InvalidRequestError, "surrogate"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(
    engine: Engine,
    prompt: list[int] | str | list[dict[str, str]],
    params: SamplingParams | None,
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        engine.generate(prompt, params)
    assert isinstance(error(), ValueError)
    assert (
        engine.generate(
            PROMPT, SamplingParams(ignore_eos=True, max_tokens=2)
        ).usage.completion_tokens
        >= 1
    )
    engine.check_integrity()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": -1},
        {"max_tokens": 0},
        {"max_tokens": True},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"seed": 1 << 64},
        {"seed": 1 << 80},
        {"seed": 1 << 63},
        {"seed": -(1 << 63) - 1},
        {"seed": True},
    ],
)
def test_bad_sampling_params(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_usage_metrics_and_stats(engine: Engine) -> None:
    engine.flush_cache()
    before = engine.cache_stats()
    first = engine.generate(
        PROMPT, SamplingParams(ignore_eos=True, max_tokens=5, stop_token_ids=[EOS_ID])
    )
    second = engine.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=5))
    assert first.usage.cached_tokens == 0 and first.metrics.prefill_tokens_computed == 30
    assert second.usage.cached_tokens == 28 and second.metrics.prefill_tokens_computed == 2
    assert second.metrics.ttft_s > 0 and second.token_ids[: len(first.token_ids)] == first.token_ids
    stats = engine.cache_stats()
    assert stats.queried_tokens - before.queried_tokens == 60
    assert stats.hit_tokens - before.hit_tokens == 28 and stats.num_blocks_used > 0
    assert stats.bytes_used == stats.num_blocks_used * engine.prefix_cache.pool.block_bytes
    assert engine.flush_cache() == stats.num_blocks_used and engine.cache_stats().bytes_used == 0
    engine.check_integrity()


def test_salts_isolate_tenants(engine: Engine) -> None:
    engine.flush_cache()
    engine.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=1), cache_salt="tenant-a")
    other = engine.generate(
        PROMPT, SamplingParams(ignore_eos=True, max_tokens=1), cache_salt="tenant-b"
    )
    unsalted = engine.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=1))
    same = engine.generate(
        PROMPT, SamplingParams(ignore_eos=True, max_tokens=1), cache_salt="tenant-a"
    )
    assert other.usage.cached_tokens == 0 and unsalted.usage.cached_tokens == 0
    assert same.usage.cached_tokens == 28


def test_an_empty_salt_is_refused_not_shared_with_unsalted(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        engine.generate(PROMPT, SamplingParams(max_tokens=1), cache_salt="")


def test_flush_removes_every_namespace_unique_salts_created(engine: Engine) -> None:
    engine.flush_cache()
    radix = engine.prefix_cache.radix
    for n in range(5):
        engine.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=1), cache_salt=f"k{n}")
    assert radix.num_namespaces == 5
    engine.flush_cache()
    assert radix.num_namespaces == 0
    engine.check_integrity()


def test_stream_deltas_add_up_to_the_completion(engine: Engine) -> None:
    deltas = list(engine.stream(PROMPT, SamplingParams(ignore_eos=True, max_tokens=6)))
    last = deltas[-1].completion
    assert last is not None and deltas[-1].finish_reason == last.finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == last.token_ids
    assert "".join(d.text for d in deltas) == last.text
    assert all(d.completion is None for d in deltas[:-1])


def test_stop_string_cuts_text(engine: Engine) -> None:
    full = engine.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=8))
    words = full.text.split(" ")
    stop = " ".join(words[2:4])
    cut = engine.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=8, stop=[stop]))
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text) and len(cut.token_ids) <= 4
    stop_id = engine.generate(
        PROMPT, SamplingParams(ignore_eos=True, max_tokens=8, stop_token_ids=[full.token_ids[1]])
    )
    assert stop_id.token_ids == full.token_ids[:2] and stop_id.finish_reason == "stop"


def test_cancelled_stream_releases_its_pins(engine: Engine) -> None:
    engine.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=1))
    stream = engine.stream(
        PROMPT + [7, 8, 9, 10, 11], SamplingParams(ignore_eos=True, max_tokens=50)
    )
    next(stream)
    next(stream)
    assert engine.prefix_cache.radix.num_in_use_blocks > 0
    stream.close()
    assert engine.prefix_cache.radix.num_in_use_blocks == 0
    engine.check_integrity()
    unstarted = engine.stream(PROMPT, SamplingParams(ignore_eos=True, max_tokens=5))
    del unstarted  # never started: nothing was pinned
    assert engine.prefix_cache.radix.num_in_use_blocks == 0


def test_sampling_is_seeded(engine: Engine) -> None:
    params = SamplingParams(
        ignore_eos=True, max_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=3
    )
    assert engine.generate(PROMPT, params).token_ids == engine.generate(PROMPT, params).token_ids


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, SEED_MAX])
def test_seeds_at_the_ends_of_the_signed_64_bit_range_run(engine: Engine, seed: int) -> None:
    params = SamplingParams(ignore_eos=True, max_tokens=3, temperature=1.0, seed=seed)
    assert engine.generate(PROMPT, params).token_ids == engine.generate(PROMPT, params).token_ids


def test_a_negative_seed_is_its_twos_complement(engine: Engine) -> None:
    negative = engine.make_request(PROMPT, SamplingParams(seed=-1))
    assert negative.generator.initial_seed() == (1 << 64) - 1
    positive = engine.make_request(PROMPT, SamplingParams(seed=SEED_MAX))
    assert positive.generator.initial_seed() == SEED_MAX


def test_concurrent_requests_match_sequential(engine: Engine) -> None:
    prompts = [PROMPT[:10] + [i + 3] * 6 for i in range(4)]
    expected = [
        engine.generate(p, SamplingParams(ignore_eos=True, max_tokens=6)).token_ids for p in prompts
    ]
    got: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        got[i] = engine.generate(
            prompts[i], SamplingParams(ignore_eos=True, max_tokens=6)
        ).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [got[i] for i in range(4)] == expected
    engine.check_integrity()
    assert engine.prefix_cache.radix.num_in_use_blocks == 0


def test_decode_does_not_reallocate_per_token(engine: Engine) -> None:
    req = engine.make_request(PROMPT, SamplingParams(ignore_eos=True, max_tokens=40))
    it = engine.run(req)
    next(it)
    kv = req.kv
    assert kv is not None and kv.capacity >= 70
    buffer = kv.buffer
    for _ in range(20):
        next(it)
    assert kv.buffer is buffer and kv.num_grows == 0
    it.close()


def test_kv_buffer_grows_geometrically() -> None:
    import torch

    from runtime.model.kv_cache import RequestKVCache

    kv = RequestKVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        capacity=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for n in range(1, 100):
        kv.reserve(n)
        kv.length = n
    assert kv.num_grows == 5 and kv.capacity == 128


def test_unresumable_models_disable_reuse(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config("llama")
    config.layer_types = ["full_attention", "linear_attention"]
    assert "linear_attention" in (reuse_blocker(config) or "")
    assert reuse_blocker(make_config("mistral_sliding")) is None  # full KV kept + sliding mask
    path = save_tiny_model("llama", tmp_path / "m")
    with caplog.at_level(logging.WARNING, logger="runtime.kv_stores"), monkeypatch.context() as mp:
        import runtime.kv_stores as kv_stores_mod

        mp.setattr(kv_stores_mod, "reuse_blocker", lambda cfg: "recurrent state")
        eng = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 20, block_size=4)
    assert "recurrent state" in caplog.text
    stats = eng.cache_stats()
    assert not stats.is_enabled and stats.disabled_reason == "recurrent state"
    eng.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=1))
    assert (
        eng.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=1)).usage.cached_tokens == 0
    )


def test_prefix_cache_off_is_force_miss(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "m")
    eng = Engine.from_pretrained(str(path), prefix_cache=False, block_size=4)
    eng.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=1))
    assert (
        eng.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=1)).usage.cached_tokens == 0
    )
    assert eng.cache_stats().disabled_reason == "prefix_cache=False (force-miss)"
    eng.check_integrity()
