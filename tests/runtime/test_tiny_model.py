"""The bundled toy model: offline loading, word-like output, its recorded loss, its chat template.

These tests load ``runtime/models/tiny`` through the same ``from_pretrained`` path as any real
model, with the hub switched off, and re-run the training script's evaluation on a small subset.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from jinja2.exceptions import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from runtime.models import BUNDLED_MODELS, resolve_model
from tests.script_module import load_module

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "train_tiny.py"
TINY = Path(resolve_model("tiny"))
STATS: dict[str, Any] = json.loads((TINY / "training_stats.json").read_text())
SPECIAL_IDS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<tool_call>": 3,
    "</tool_call>": 4,
    "<tool_response>": 5,
    "</tool_response>": 6,
}
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_doc",
        "description": "Return the documentation of a Python standard library object.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
    },
}
TOOL_CALL_TEXT = (
    '<tool_call>\n{"name": "lookup_doc", "arguments": {"name": "json.dumps"}}\n</tool_call>'
)


def make_conversation() -> list[dict[str, Any]]:
    """Four assistant turns: plain answer, tool call, answer from the tool result, plain answer."""
    call = {
        "type": "function",
        "function": {"name": "lookup_doc", "arguments": {"name": "json.dumps"}},
    }
    return [
        {"role": "system", "content": "You answer questions about Python modules."},
        {"role": "user", "content": "What does os.path.join do?"},
        {"role": "assistant", "content": "It joins path components."},
        {"role": "user", "content": "And json.dumps?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Serialize obj to a JSON formatted str."},
        {"role": "assistant", "content": "It serializes an object to a JSON string."},
        {"role": "user", "content": "Thanks! Anything else?"},
        {"role": "assistant", "content": "No, that is all."},
    ]


def load_script() -> ModuleType:
    """Import scripts/train_tiny.py (not a package) under a private module name."""
    return load_module(SCRIPT, "_train_tiny")


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    """Switch the hub off for every load in this module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model("tiny"), local_files_only=True)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    loaded = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), local_files_only=True)
    assert isinstance(loaded, LlamaForCausalLM)
    return loaded


def render(tokenizer: Any, messages: list[dict[str, Any]], *, generation: bool = False) -> str:
    text = tokenizer.apply_chat_template(
        messages, tools=[LOOKUP_TOOL], tokenize=False, add_generation_prompt=generation
    )
    assert isinstance(text, str)
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------- files and names


def test_resolve_model_maps_short_names_and_passes_the_rest_through() -> None:
    assert BUNDLED_MODELS == ("tiny",)
    assert TINY.is_absolute() and (TINY / "config.json").is_file()
    for other in ("./tiny", "/models/llama", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2"):
        assert resolve_model(other) == other


def test_shipped_files_fit_the_budget() -> None:
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    ):
        assert (TINY / name).is_file(), name
    assert (TINY / "model.safetensors").stat().st_size <= 10_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["max_position_embeddings"] >= 4096
    generation = json.loads((TINY / "generation_config.json").read_text())
    eos = [SPECIAL_IDS[t] for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")]
    assert generation["eos_token_id"] == eos


def test_special_tokens_are_single_tokens_with_fixed_ids(tokenizer: Any) -> None:
    for token, token_id in SPECIAL_IDS.items():
        assert encode(tokenizer, token) == [token_id], token
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == SPECIAL_IDS["<|endoftext|>"]
    # Tool tags survive skip_special_tokens so a tool-call parser still sees them.
    ids = encode(tokenizer, "<|im_start|>" + TOOL_CALL_TEXT + "<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == TOOL_CALL_TEXT


# ----------------------------------------------------------------------------- the model


def test_loads_offline_in_float32_with_the_recorded_size(model: LlamaForCausalLM) -> None:
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == STATS["num_parameters"]
    eos = [SPECIAL_IDS[t] for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")]
    assert model.generation_config.eos_token_id == eos


def test_greedy_generation_is_word_like(model: LlamaForCausalLM, tokenizer: Any) -> None:
    prompt = "collections.OrderedDict.move_to_end(self, key, last=True)\n\n"
    input_ids = torch.tensor([encode(tokenizer, prompt)])
    output = model.generate(input_ids, max_new_tokens=48, do_sample=False)
    text = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    letters = sum(ch.isascii() and (ch.isalpha() or ch.isspace()) for ch in text)
    words = set(re.findall(r"[A-Za-z]{3,}", text))
    assert len(text) >= 60, text
    assert letters / len(text) >= 0.75, text
    assert len(words) >= 5, text


def test_long_prompt_fits_the_context(model: LlamaForCausalLM) -> None:
    input_ids = (torch.arange(7, 3007) % 4000).unsqueeze(0)  # [1, 3000]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits  # [1, 3000, vocab]
    assert torch.isfinite(logits).all()


def test_validation_loss_reproduces_the_model_card() -> None:
    script = load_script()
    result = script.evaluate_shipped(TINY, max_windows=STATS["val_subset_windows"])
    assert f"{STATS['val_loss']:.4f}" in (TINY / "README.md").read_text()
    if result["val_sha256"] == STATS["val_subset_sha256"]:
        # Same held-out tokens as at training time: only float noise may differ.
        assert result["val_loss"] == pytest.approx(STATS["val_subset_loss"], abs=2e-3)
    else:
        # Another Python version ships other docstrings; the loss must still be in range.
        assert result["val_loss"] == pytest.approx(STATS["val_subset_loss"], abs=0.3)


# ----------------------------------------------------------------------------- chat template


def test_chat_template_renders_every_role(tokenizer: Any) -> None:
    text = render(tokenizer, make_conversation()[:6], generation=True)
    assert text.startswith("<|im_start|>system\nYou answer questions about Python modules.\n\n")
    assert '<tools>\n{"type": "function", "function": {"name": "lookup_doc"' in text
    assert "<|im_start|>user\nWhat does os.path.join do?<|im_end|>\n" in text
    assert "<|im_start|>assistant\nIt joins path components.<|im_end|>\n" in text
    assert f"<|im_start|>assistant\n{TOOL_CALL_TEXT}<|im_end|>\n" in text
    tool_turn = "<|im_start|>user\n<tool_response>\nSerialize obj to a JSON formatted str.\n"
    assert tool_turn + "</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_without_tools_or_system(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(TemplateError):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_tool_call_arguments_render_the_same_as_dict_or_json_string(tokenizer: Any) -> None:
    as_string = make_conversation()[:5]
    as_string[4] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "lookup_doc", "arguments": '{"name": "json.dumps"}'}}],
    }
    assert render(tokenizer, as_string) == render(tokenizer, make_conversation()[:5])


def test_chat_template_is_token_prefix_stable_across_turns(tokenizer: Any) -> None:
    messages = make_conversation()
    replies = {2: "It joins path components.", 4: TOOL_CALL_TEXT}
    replies |= {6: messages[6]["content"], 8: messages[8]["content"]}
    im_end = SPECIAL_IDS["<|im_end|>"]
    for index, reply in replies.items():
        prompt = render(tokenizer, messages[:index], generation=True)
        # What the engine holds after decoding: prompt ids, generated ids, then <|im_end|>.
        held = encode(tokenizer, prompt) + encode(tokenizer, reply) + [im_end]
        for later in (messages[: index + 1], messages[: index + 2]):
            rendered = encode(tokenizer, render(tokenizer, later, generation=True))
            assert len(rendered) > len(held)
            assert rendered[: len(held)] == held, f"turn {index}: prefix broke"
        assert render(tokenizer, messages[: index + 1]).startswith(prompt + reply + "<|im_end|>")
