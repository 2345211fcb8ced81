"""Contracts 1 and 11 with the disk tier: blocks loaded from disk give the cache-off answer.

Damaged files are misses, never wrong output; a restart reuses the files of the same model and
dtype only; a process killed (SIGKILL) while writing leaves a directory the next start accepts.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from runtime.bench._common import NullTokenizer
from runtime.cache.radix_cache import block_hash, root_hash
from runtime.engine import Engine
from tests.conftest import VOCAB_SIZE, save_tiny_model
from tests.runtime.test_engine_exactness import assert_same_answer, run

BS = 4


def disk_engine(model_dir: Path, disk_dir: Path, **kw: Any) -> Engine:
    return Engine.from_pretrained(str(model_dir), kv_cache_bytes=1 << 20, block_size=BS,
                                  kv_disk_dir=disk_dir, kv_disk_bytes=1 << 22, **kw)  # fmt: skip


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(length)] for _ in range(n)]


def block_file(engine: Engine, ids: list[int], index: int) -> Path:
    """The disk file of block ``index`` of ``ids`` (chained hash from the request's namespace)."""
    disk = engine.prefix_cache.disk
    assert disk is not None
    h = root_hash(engine.make_request(ids).namespace)
    for i in range(index + 1):
        h = block_hash(h, ids[i * BS : (i + 1) * BS])
    path = disk.file_of(disk.key(h))
    assert path is not None, f"block {index} is not on disk"
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "llama-kv16"])
def test_blocks_loaded_from_disk_give_the_cache_off_answer(tmp_path: Path, arch: str) -> None:
    """``llama-kv16``: an fp16 KV cache's blocks round-trip through disk as they are."""
    arch, _, kv = arch.partition("-")
    model_dir = save_tiny_model(arch, tmp_path / arch)
    engine = disk_engine(model_dir, tmp_path / "kv", kv_dtype="float16" if kv else "auto")
    assert engine.prefix_cache.pool.data.dtype == (torch.float16 if kv else torch.float32)
    for ids in prompts(1, 3, 22):
        ref = run(engine, ids, 6, use_cache=False)
        run(engine, ids, 6, use_cache=True)
        engine.flush_cache()  # every block spills to disk
        engine.drain_disk()
        got = run(engine, ids + [5], 6, use_cache=True)
        assert got[2] == 20  # 5 whole blocks, all loaded back from disk
        assert_same_answer(run(engine, ids + [5], 6, use_cache=False)[:2], got[:2])
        assert ref[0] == run(engine, ids, 6, use_cache=True)[0]
    stats = engine.cache_stats()
    assert stats.disk is not None and stats.disk_hit_tokens >= 60 and stats.disk.num_loads >= 15
    engine.check_integrity()
    engine.close()


def test_warm_restart_hits_from_disk_and_other_weights_or_dtypes_never_do(tmp_path: Path) -> None:
    model_dir = save_tiny_model("llama", tmp_path / "m")
    (ids,) = prompts(2, 1, 30)
    first = disk_engine(model_dir, tmp_path / "kv")
    ref = run(first, ids, 5, use_cache=False)
    run(first, ids, 5, use_cache=True)
    first.flush_cache()
    first.close()  # finishes queued writes
    restarted = disk_engine(model_dir, tmp_path / "kv")
    got = run(restarted, ids, 5, use_cache=True)
    assert got[2] == 28 and restarted.cache_stats().disk_hit_tokens == 28
    assert_same_answer(ref[:2], got[:2])
    restarted.close()
    # NOTE: one live engine per directory (write-through writes at once), so one after the other
    other_weights = disk_engine(save_tiny_model("llama", tmp_path / "m1", seed=1), tmp_path / "kv")
    assert run(other_weights, ids, 2, use_cache=True)[2] == 0
    other_weights.check_integrity()
    other_weights.close()
    other_dtype = disk_engine(model_dir, tmp_path / "kv", dtype="bfloat16")
    assert run(other_dtype, ids, 2, use_cache=True)[2] == 0
    other_dtype.check_integrity()
    other_dtype.close()
    other_kv = disk_engine(model_dir, tmp_path / "kv", kv_dtype="float16")  # fp16 KV blocks
    assert run(other_kv, ids, 2, use_cache=True)[2] == 0
    other_kv.check_integrity()
    other_kv.close()


def test_corrupted_and_truncated_block_files_are_misses_never_wrong(tmp_path: Path) -> None:
    model_dir = save_tiny_model("llama", tmp_path / "m")
    engine = disk_engine(model_dir, tmp_path / "kv")
    a, b = prompts(3, 2, 21)
    refs = [run(engine, ids, 5, use_cache=False) for ids in (a, b)]
    for ids in (a, b):
        run(engine, ids, 5, use_cache=True)
    engine.flush_cache()
    engine.drain_disk()
    damaged = block_file(engine, a, 0)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x55
    damaged.write_bytes(bytes(data))
    truncated = block_file(engine, b, 2)
    bad = {damaged: bytes(data), truncated: truncated.read_bytes()[:-7]}
    truncated.write_bytes(bad[truncated])
    got_a, got_b = run(engine, a, 5, use_cache=True), run(engine, b, 5, use_cache=True)
    assert got_a[2] == 0  # its first block is bad: nothing after it is trusted
    assert got_b[2] == 8  # two good blocks, then the truncated one stops the match
    assert_same_answer(refs[0][:2], got_a[:2])
    assert_same_answer(refs[1][:2], got_b[:2])
    stats = engine.cache_stats().disk
    assert stats is not None and stats.num_corrupt == 2
    engine.drain_disk()  # NOTE: write-through rewrote both blocks from the recomputed KV
    assert all(not p.exists() or p.read_bytes() != data for p, data in bad.items())
    engine.flush_cache()
    assert run(engine, a, 5, use_cache=True)[2] == 20 and run(engine, b, 5, use_cache=True)[2] == 20
    engine.check_integrity()
    engine.close()


# --- SIGKILL during a disk write ---------------------------------------------------------------

KILL_PROMPT_LEN, KILL_BLOCK = 2100, 1024


def kill_test_engine(disk_dir: Path) -> Engine:
    """2-layer Llama with 8 KV heads: 1 MiB blocks, so each disk write takes a while."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=8, intermediate_size=64, vocab_size=VOCAB_SIZE,
                         max_position_embeddings=4096)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()  # type: ignore[no-untyped-call]
    return Engine(model, NullTokenizer(), model_id="kill-test", kv_cache_bytes=8 << 20,
                  block_size=KILL_BLOCK, kv_disk_dir=disk_dir, kv_disk_bytes=64 << 20)  # fmt: skip


def kill_prompt(seed: int) -> list[int]:
    return prompts(seed, 1, KILL_PROMPT_LEN)[0]


CHILD = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
from runtime.sampling.params import SamplingParams
from tests.runtime.test_disk_tier_engine import kill_prompt, kill_test_engine
eng = kill_test_engine(Path({disk!r}))
one = SamplingParams(max_tokens=1, ignore_eos=True)
eng.generate(kill_prompt(0), one); eng.flush_cache(); eng.drain_disk()
print("ready", flush=True)
seed = 1
while True:  # keep the writer busy: every round spills two fresh 1 MiB blocks
    eng.generate(kill_prompt(0), one); eng.generate(kill_prompt(seed), one); eng.flush_cache()
    seed += 1
"""


@pytest.mark.slow  # a second interpreter imports torch + transformers: ~10 s on 2 busy cores
def test_sigkill_during_a_disk_write_restarts_cleanly(tmp_path: Path) -> None:
    disk_dir, root = tmp_path / "kv", str(Path(__file__).resolve().parents[2])
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(root=root, disk=str(disk_dir))],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        deadline, saw_temp = time.monotonic() + 30, False
        while not saw_temp and time.monotonic() < deadline and child.poll() is None:
            saw_temp = any(name.endswith(".tmp") for name in os.listdir(disk_dir))
            time.sleep(0.0002)  # NOTE: poll, but leave the CPU to the writer being watched
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    assert saw_temp, "the writer never had a file open (nothing was killed mid-write)"
    restarted = kill_test_engine(disk_dir)
    assert not [p for p in disk_dir.iterdir() if p.suffix == ".tmp"]
    restarted.check_integrity()
    ids = kill_prompt(0)
    got = run(restarted, ids, 2, use_cache=True)
    assert got[2] == 2 * KILL_BLOCK and restarted.cache_stats().disk_hit_tokens == 2 * KILL_BLOCK
    assert_same_answer(run(restarted, ids, 2, use_cache=False)[:2], got[:2])
    restarted.check_integrity()
    restarted.close()
