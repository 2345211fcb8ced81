"""The llama.cpp peer's plumbing without llama.cpp: a stand-in ``llama_cpp`` module in a child
interpreter answers the bench's requests; bad ``--llama-cpp`` options fail before slow work."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from runtime.bench.llama_cpp_peer import LlamaCppPeer, _byte_tokenizer, peer_python
from runtime.bench.prefix import agreement_warnings, prefix_main

FAKE_LLAMA_CPP = """
class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, verbose):
        assert open(model_path).read() == "gguf" and n_ctx == 64 and n_threads == 1
        self.n_batch = 512

    def generate(self, tokens, **greedy):
        assert greedy["temp"] == 0.0 and greedy["top_k"] == 1
        token = tokens[-1]
        while True:
            token = (token * 7 + 1) % 100
            yield token
"""


def fake_python(tmp_path: Path) -> Path:
    """A venv-shaped folder whose ``bin/python`` sees the stand-in ``llama_cpp``."""
    (tmp_path / "lib" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "lib" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "lib"}" exec "{sys.executable}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def test_peer_answers_each_request_with_its_greedy_tokens(tmp_path: Path) -> None:
    venv = fake_python(tmp_path / "venv")
    (tmp_path / "w1.gguf").write_text("gguf")
    peer = LlamaCppPeer(peer_python(str(venv)), tmp_path / "w1.gguf", n_ctx=64, threads=1)
    try:
        assert peer.info == {"n_batch": 512}
        first = peer.run([5, 3], 3)
        assert first.tokens == [22, 55, 86] and first.ttft_s >= 0 and first.decode_s >= 0
        assert peer.run([5, 4], 1).tokens == [29]
    finally:
        peer.close()


def test_a_dead_peer_says_why(tmp_path: Path) -> None:
    venv = fake_python(tmp_path / "venv")
    with pytest.raises(RuntimeError, match="(?s)llama.cpp peer exited: .*No such file"):
        LlamaCppPeer(peer_python(str(venv)), tmp_path / "missing.gguf", n_ctx=64, threads=1)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--llama-cpp", "/nonexistent"], "no Python executable there"),
        (["--llama-cpp", sys.executable], "needs --llama-cpp-convert"),
        (["--llama-cpp", sys.executable, "--gguf", "/no/such.gguf"], "no such file"),
        # NOTE: the peer's own options without the peer were ignored; now refused
        (["--gguf", "/no/such.gguf"], "--gguf gives llama.cpp its weights: it needs --llama-cpp"),
        (["--llama-cpp-convert", "c.py"], "--llama-cpp-convert gives llama.cpp its weights"),
        (["--compare-weights", "q8_0", "--llama-cpp", sys.executable], "runs alone, not with"),
    ],
)
def test_bad_peer_options_exit_2_before_any_work(
    extra: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert os.path.exists(sys.executable)
    with pytest.raises(SystemExit) as exc:
        prefix_main(extra)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


def test_help_says_how_to_build_the_peer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        prefix_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "pip install --no-binary llama-cpp-python" in out and "convert_hf_to_gguf.py" in out


def test_a_peer_that_disagrees_from_the_first_token_is_named_as_other_weights() -> None:
    # counts per path: compact (itself), transformers, llama.cpp
    assert agreement_warnings([32.0, 32.0, 32.0], 32) == []
    (other,) = agreement_warnings([32.0, 32.0, 0.0], 32)
    assert other.startswith("llama.cpp's first greedy token differs") and "other weights" in other
    (late,) = agreement_warnings([32.0, 20.0, 32.0], 32)
    assert late.startswith("transformers's greedy tokens leave compact's after 20 of 32")


def test_every_id_of_the_byte_tokenizer_decodes_to_text_and_encoding_uses_bytes_only() -> None:
    tokenizer = _byte_tokenizer(600)
    assert len(tokenizer) == 600
    assert tokenizer.decode([300, 599]) == " w300 w599"  # a random model's output has text
    ids = tokenizer.encode("the cat w300", add_special_tokens=False)
    assert max(ids) < 257 and tokenizer.decode(ids) == "the cat w300"


def test_a_model_an_engine_wraps_still_saves_and_reloads_to_the_same_logits(
    tmp_path: Path,
) -> None:
    """bench prefix saves W1 for llama.cpp after its engines were built on it: the compact
    forward's input-major weight views must not break ``save_hf``."""
    import argparse

    import torch
    from transformers import AutoModelForCausalLM

    from runtime.bench._common import bench_engine, w1_model
    from runtime.bench.llama_cpp_peer import save_hf

    model = w1_model(argparse.Namespace(layers=1, dtype="float32"))
    engine = bench_engine(model, kv_bytes=1 << 24)
    assert engine.forward_path == "compact"
    path = save_hf(model, tmp_path)
    # NOTE: transformers leaves PreTrainedModel.eval unannotated.
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()  # type: ignore[no-untyped-call]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    engine.close()
