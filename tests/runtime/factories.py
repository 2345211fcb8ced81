"""Factories for runtime tests: tiny random-weight models from configs and an in-process tokenizer.

Nothing here touches the network: the tokenizer is a word-level vocabulary built in memory, and
models are saved next to it with ``save_pretrained`` so ``Engine.from_pretrained`` runs for real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "tool"] + [f"w{i}" for i in range(89)]
VOCAB_SIZE = len(SPECIALS) + len(WORDS)  # 96
EOS_ID = SPECIALS.index("<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
ARCHS = ("llama", "qwen2", "gpt2", "mistral_sliding")
SLIDING_WINDOW = 8


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over ``SPECIALS + WORDS`` with a ChatML chat template."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    return tok


def make_config(arch: str) -> Any:
    """A tiny config of one of ``ARCHS`` (2 layers, hidden 32, GQA where the arch has it)."""
    common: dict[str, Any] = {"vocab_size": VOCAB_SIZE, "eos_token_id": EOS_ID, "bos_token_id": 1}
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, **common)
    llama_like: dict[str, Any] = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 256,
        **common,
    }
    if arch == "llama":
        return LlamaConfig(**llama_like)
    if arch == "qwen2":
        return Qwen2Config(**llama_like)
    if arch == "mistral_sliding":
        return MistralConfig(sliding_window=SLIDING_WINDOW, **llama_like)
    raise ValueError(f"unknown arch {arch!r}; valid: {ARCHS}")


def save_tiny_model(arch: str, path: Path, *, seed: int = 0) -> Path:
    """Build a random-weight model of ``arch``, save it and the tokenizer to ``path``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch))
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path
