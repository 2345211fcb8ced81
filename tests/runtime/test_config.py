"""EngineConfig: one frozen record of every engine option, validated in one place, and the serve
flags derived from it (help from the field docstrings, defaults from the dataclass)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from runtime.config import EngineConfig, field_docs, validate
from runtime.scheduler.config import SchedulerConfig
from runtime.serve.flags import add_engine_flags, engine_config, flag_of


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_frozen_and_valid() -> None:
    config = EngineConfig()
    assert (config.disk_bytes, config.disk_policy, config.disk_flush_s) == (
        8 << 30,
        "write-through",
        5.0,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8  # type: ignore[misc]
    assert config.replace(scheduler=None).scheduler == SchedulerConfig()


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"weights": "float16"}, "weights must be one of"),
        (
            {"weights": "q4_1", "dtype": "bfloat16"},
            "weights q4_1 needs dtype float32, not bfloat16",
        ),
        ({"eviction": "fifo"}, "eviction must be one of"),
        ({"kv_disk_bytes": 1}, "kv_disk_bytes needs kv_disk_dir"),
        ({"kv_disk_policy": "evict"}, "kv_disk_policy needs kv_disk_dir"),
        ({"kv_disk_dir": "d", "kv_disk_policy": "later"}, "kv_disk_policy must be one of"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"kv_cache_bytes": -1}, "kv_cache_bytes must be >= 0"),
        ({"forward": "fast"}, "forward must be one of"),
    ],
)
def test_one_validator_names_the_field(values: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError) as raised:
        EngineConfig(**values)  # type: ignore[arg-type]
    assert says in str(raised.value)
    with pytest.raises(ValueError) as spelled:
        validate(values, spell=flag_of)
    assert flag_of(says.split()[0]) in str(spelled.value)  # the serve flag, as typed


def test_every_field_is_a_documented_serve_flag() -> None:
    for cls in (EngineConfig, SchedulerConfig):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name != "scheduler":
                assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
    args = _parse()
    for f in dataclasses.fields(EngineConfig):
        if f.name != "scheduler":
            assert hasattr(args, f.name), f.name
    assert engine_config(args) == EngineConfig()  # nothing given: the dataclass's defaults


def test_flags_reach_the_config_and_scheduler_limits() -> None:
    args = _parse("--eviction", "lru", "--no-prefix-cache", "--max-batch-size", "2",
                  "--prefill-chunk-tokens", "32", "--kv-disk-dir", "x",
                  "--kv-disk-flush-seconds", "1")  # fmt: skip
    config = engine_config(args)
    assert (config.eviction, config.prefix_cache, config.kv_disk_flush_s) == ("lru", False, 1.0)
    assert (config.scheduler.max_batch_size, config.scheduler.prefill_chunk_tokens) == (2, 32)
    with pytest.raises(ValueError, match="--kv-disk-bytes needs --kv-disk-dir"):
        engine_config(_parse("--kv-disk-bytes", "5"))


def test_the_eviction_policy_reaches_both_caches(tmp_path: Path) -> None:
    from runtime.engine import Engine
    from tests.conftest import save_tiny_model

    engine = Engine.from_pretrained(str(save_tiny_model("llama", tmp_path)), eviction="lru")
    assert engine.config.eviction == "lru" and engine.prefix_cache.radix.policy == "lru"
    assert engine.chunk_store._heap.policy == "lru"  # NOTE: the store's heap has no public getter
    engine.close()
    with pytest.raises(TypeError, match="kv_cache_size"):
        Engine.from_pretrained(str(tmp_path), kv_cache_size=1)
