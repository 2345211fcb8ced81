"""The one home of the test models: tiny random-weight models and in-memory tokenizers.

Three families, all offline and built in seconds: word-level models of several architectures
(``save_tiny_model``), a BPE Llama trained on stdlib docstrings (``build_tiny_llama``, the SDK's
tests) and a byte-level Llama where any text is a valid prompt (``save_byte_llama``, the server's
end-to-end tests). torch and transformers are imported inside the builders, so the SDK's tests
still collect without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict

import pytest

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

CHATML_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>' }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \''
    " + call.function.arguments + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML with a tools block and Hermes ``<tool_call>`` turns (the BPE Llama's template)."""

CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
"""ChatML that lists tools (the byte Llama's template)."""

_BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# NOTE: transformers leaves PreTrainedTokenizerFast.__init__ and the Auto classes' from_config
# unannotated, hence the ``ignore[no-untyped-call]`` on those calls below.


class ModelShape(TypedDict, total=False):
    """The size keywords the tests give transformers' Llama-like configs, typed for ``**``."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool


# --- word-level models of several architectures ---------------------------------------------


def make_tokenizer() -> Any:
    """Word-level tokenizer over ``SPECIALS + WORDS`` with a ChatML chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    return tok


def make_config(arch: str) -> Any:
    """A tiny config of one of ``ARCHS`` (2 layers, hidden 32, GQA where the arch has it)."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

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
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch))  # type: ignore[no-untyped-call]
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def save_small_llama(path: Path, *, seed: int, **config: Any) -> None:
    """Save random weights (``seed``) of a 2-layer Llama, hidden 64, 4 query / 2 KV heads, tied
    embeddings; ``config`` gives the rest (vocab size, context, special ids) to ``LlamaConfig``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape: ModelShape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2,
                         "tie_word_embeddings": True}  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**shape, **config)).save_pretrained(path)


# --- a BPE Llama trained on stdlib docstrings (SDK tests) -----------------------------------


def build_tiny_llama(folder: Path, *, vocab_size: int = 1024, seed: int = 0) -> Path:
    """Write config, random weights and a BPE tokenizer of a 2-layer Llama into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from agentcache.rag.stdlib import stdlib_sources

    corpus = [s.text for s in stdlib_sources(max_files=15)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_BPE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )
    tokenizer.save_pretrained(folder)
    save_small_llama(
        folder,
        seed=seed,
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    return folder


# --- a byte-level Llama: any text is a prompt (server end-to-end tests) ---------------------


def make_byte_tokenizer() -> Any:
    """Byte-level BPE without merges: 256 byte tokens + ChatML specials, tools template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TOOLS,
        clean_up_tokenization_spaces=False,
    )


def save_byte_llama(path: Path, *, seed: int = 0) -> Path:
    """A random-weight 2-layer Llama (context 1024) with ``make_byte_tokenizer``, saved."""
    tokenizer = make_byte_tokenizer()
    save_small_llama(
        path,
        seed=seed,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(path)
    return path


# --- fixtures (one model folder per test session) --------------------------------------------


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The word-level tiny Llama (``save_tiny_model("llama")``)."""
    pytest.importorskip("torch")
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def bpe_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The BPE tiny Llama with the tools ChatML template (seed 3)."""
    pytest.importorskip("torch")
    return build_tiny_llama(tmp_path_factory.mktemp("bpe-llama"), seed=3)


@pytest.fixture(scope="session")
def byte_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The byte-level tiny Llama."""
    pytest.importorskip("torch")
    return save_byte_llama(tmp_path_factory.mktemp("byte-llama"))


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built() -> None:
    """Build the native kernels (``runtime.model.kernels``) once, in this process, before any test
    starts a server subprocess: on a cold machine each child would otherwise build its own copy
    (about 35 s) inside its start-up timeout."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    from runtime.model.kernels import native_kernels

    native_kernels()
