"""Train the bundled toy model ``runtime/models/tiny`` from text found on this machine.

Corpus: docstrings of the installed Python standard library (walked with ``ast``, deterministic
order) plus ChatML chat samples synthesised from them. Outputs a byte-level BPE tokenizer and a
small Llama model in the standard Hugging Face layout. Never imported at run time; it downloads
nothing. The model is a toy for demos and tests: it produces word-like text, not answers.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import re
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "runtime" / "models" / "tiny"
SEED = 1234
VOCAB_SIZE = 4096
SEQ_LEN = 256
EVAL_MAX_WINDOWS = 256
SUBSET_WINDOWS = 8
VAL_BUCKETS = 20  # NOTE: one source file in VAL_BUCKETS goes to the held-out split.
MAX_DOC_CHARS = 3000
# NOTE: ids 0-6 are fixed by the order of this list; the engine and the model card rely on them.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
Split = Literal["train", "validation"]

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou can call these functions. Their signatures are listed inside "
    "<tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object holding its name and "
    "arguments inside <tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('Only the first message may be system.') }}"
    "{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- raise_exception('Unknown role: ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup_doc",
        "description": "Return the documentation of a Python standard library object.",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string", "description": "Dotted name."}},
            "required": ["name"],
        },
    },
}
SYSTEM_PROMPTS = [
    "You are a concise assistant for questions about the Python standard library.",
    "You answer questions about Python modules in one sentence.",
]
QUESTIONS = [
    "What does {name} do?",
    "Explain {name} in one sentence.",
    "Q: what is {name} for?",
    "Can you tell me what {name} is?",
]


@dataclass(frozen=True, slots=True)
class DocRecord:
    """One docstring: the dotted name of its owner, a short header and the cleaned text."""

    name: str
    header: str
    doc: str


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Hyper-parameters of one run; every value is recorded in training_stats.json."""

    num_steps: int = 260
    batch_size: int = 8
    seq_len: int = SEQ_LEN
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    log_every: int = 25


# ----------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    """Return the directory of the installed Python standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """List the stdlib ``.py`` files in sorted relative-path order, skipping tests and add-ons."""
    files = [
        path
        for path in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def split_of(relative: str) -> Split:
    """Assign a source file to a split by a stable hash of its relative path."""
    bucket = hashlib.sha256(relative.encode()).digest()[0] % VAL_BUCKETS
    return "validation" if bucket == 0 else "train"


def module_name(relative: str) -> str:
    """Turn ``json/decoder.py`` into ``json.decoder`` and ``json/__init__.py`` into ``json``."""
    parts = relative.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def parse_file(path: Path) -> ast.Module | None:
    """Parse one source file, or return None if this interpreter cannot parse it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return None


def iter_records(node: ast.AST, prefix: str) -> Iterator[DocRecord]:
    """Yield the docstrings of ``node``'s classes and functions, depth first in source order."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        name = f"{prefix}.{child.name}"
        doc = ast.get_docstring(child)
        if doc:
            if isinstance(child, ast.ClassDef):
                header = f"class {name}"
            else:
                header = f"{name}({ast.unparse(child.args)})"
            yield DocRecord(name, header, doc[:MAX_DOC_CHARS])
        yield from iter_records(child, name)


def collect_records(split: Split, root: Path | None = None) -> list[DocRecord]:
    """Collect every docstring of one split in a deterministic order."""
    root = root or stdlib_root()
    records: list[DocRecord] = []
    for path in source_files(root):
        relative = path.relative_to(root).as_posix()
        if split_of(relative) != split:
            continue
        tree = parse_file(path)
        if tree is None:
            continue
        name = module_name(relative)
        doc = ast.get_docstring(tree)
        if doc:
            records.append(DocRecord(name, f"module {name}", doc[:MAX_DOC_CHARS]))
        records.extend(iter_records(tree, name))
    return records


def doc_text(record: DocRecord) -> str:
    """Render a docstring record as a short documentation entry."""
    return f"{record.header}\n\n{record.doc}\n"


def first_sentence(doc: str) -> str | None:
    """Return the first sentence of a docstring if it reads like prose, else None."""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    sentence = match.group(1) if match else paragraph
    if not 20 <= len(sentence) <= 240 or not sentence[0].isalpha():
        return None
    return sentence if sentence.endswith((".", "!", "?")) else sentence + "."


# ----------------------------------------------------------------------------- chat samples


def chat_sample(record: DocRecord, rng: random.Random) -> list[dict[str, Any]] | None:
    """Build a ChatML conversation about one record: a plain Q/A, or one through a tool call."""
    answer = first_sentence(record.doc)
    if answer is None or rng.random() > 0.5:
        return None
    question = rng.choice(QUESTIONS).format(name=record.name)
    messages: list[dict[str, Any]] = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    messages.append({"role": "user", "content": question})
    if rng.random() < 0.3:
        arguments = {"name": record.name}
        call = {"type": "function", "function": {"name": "lookup_doc", "arguments": arguments}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "content": record.doc.split("\n\n")[0][:600]})
    messages.append({"role": "assistant", "content": answer})
    return messages


def render_chat(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]]) -> str:
    """Render a conversation with the shipped chat template (tools only if a tool is used)."""
    uses_tools = any(message["role"] == "tool" for message in messages)
    text = tokenizer.apply_chat_template(
        messages, tools=[LOOKUP_TOOL] if uses_tools else None, tokenize=False
    )
    assert isinstance(text, str), "apply_chat_template(tokenize=False) must return a string"
    return text


def split_texts(
    records: list[DocRecord], tokenizer: PreTrainedTokenizerFast, seed: int
) -> list[str]:
    """Interleave documentation entries with chat samples built from them, deterministically."""
    rng = random.Random(seed)
    texts: list[str] = []
    for record in records:
        texts.append(doc_text(record))
        messages = chat_sample(record, rng)
        if messages is not None:
            texts.append(render_chat(tokenizer, messages))
    return texts


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Tokenize texts into one stream of ids, each text followed by ``<|endoftext|>``."""
    eos_id = token_id(tokenizer, "<|endoftext|>")
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)  # [num_tokens]


# ----------------------------------------------------------------------------- tokenizer


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one token of the vocabulary."""
    found = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(found, int), f"{token!r} is not a single token"
    return found


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it with the ChatML template and special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS + TOOL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    # NOTE: tool tags are single tokens but not "special", so decode(skip_special_tokens=True)
    # keeps them and a tool-call parser can still see them (as in Qwen2.5).
    state = json.loads(tokenizer.to_str())
    for added in state["added_tokens"]:
        added["special"] = added["content"] in SPECIAL_TOKENS
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save tokenizer.json and a tokenizer_config.json that carries the chat template."""
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------- model


def model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The tiny Llama shape: 4 layers, d=256, GQA 4/2 heads, tied embeddings, RoPE to 4096."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=token_id(tokenizer, "<|im_end|>"),
        pad_token_id=token_id(tokenizer, "<|endoftext|>"),
    )


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay from ``lr`` to ``min_lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.num_steps - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Cut the held-out stream into non-overlapping windows (the first ``max_windows``)."""
    num_windows = min(max_windows, stream.numel() // seq_len)
    return stream[: num_windows * seq_len].view(num_windows, seq_len)  # [num_windows, seq_len]


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy over all predicted positions of ``windows``."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]  # [b, seq_len]
        logits = model(input_ids=batch).logits.float()  # [b, seq_len, vocab]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += batch[:, 1:].numel()
    return total / count


def train(
    model: LlamaForCausalLM, train_ids: torch.Tensor, config: TrainConfig
) -> tuple[float, float]:
    """Run the fixed step budget; return (final smoothed train loss, wall seconds)."""
    generator = torch.Generator().manual_seed(SEED)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay},
    ]
    optimizer = torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    smoothed, started = float("nan"), time.perf_counter()
    model.train()
    for step in range(config.num_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        starts = torch.randint(
            0, train_ids.numel() - config.seq_len, (config.batch_size,), generator=generator
        )
        batch = torch.stack([train_ids[s : s + config.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smoothed = loss.item() if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * loss.item()
        if step % config.log_every == 0 or step == config.num_steps - 1:
            elapsed = time.perf_counter() - started
            print(
                f"step {step:4d}  train_loss {smoothed:.4f}  lr {lr_at(step, config):.2e}  "
                f"{elapsed:6.0f}s",
                flush=True,
            )
    return smoothed, time.perf_counter() - started


# ----------------------------------------------------------------------------- evaluation


def load_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """Load the shipped tokenizer the same way users do."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert isinstance(tokenizer, PreTrainedTokenizerFast), "unexpected tokenizer class"
    return tokenizer


def validation_windows(
    out: Path, *, max_windows: int = EVAL_MAX_WINDOWS, seq_len: int = SEQ_LEN
) -> torch.Tensor:
    """Rebuild the held-out split from the stdlib and cut it into evaluation windows."""
    tokenizer = load_tokenizer(out)
    texts = split_texts(collect_records("validation"), tokenizer, seed=SEED + 1)
    return eval_windows(encode_stream(tokenizer, texts), seq_len, max_windows)


def fingerprint(windows: torch.Tensor) -> str:
    """Hash of the token ids of a set of windows, to tell whether two corpora are identical."""
    return hashlib.sha256(json.dumps(windows.tolist()).encode()).hexdigest()


def evaluate_shipped(out: Path, *, max_windows: int = EVAL_MAX_WINDOWS) -> dict[str, Any]:
    """Recompute the validation loss of the weights saved in ``out`` (loaded as float32)."""
    windows = validation_windows(out, max_windows=max_windows)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    return {
        "val_loss": evaluate(model, windows),
        "val_windows": int(windows.shape[0]),
        "val_sha256": fingerprint(windows),
    }


# ----------------------------------------------------------------------------- outputs


def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save float16 weights, but declare float32 as the default compute dtype in config.json."""
    torch.nn.Module.to(model, torch.float16)  # NOTE: in place
    model.save_pretrained(str(out))
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"  # NOTE: stored in float16 to stay under 10 MB; computed in fp32.
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(  # type: ignore[no-untyped-call]
        # NOTE: <|im_end|> ends a chat turn; <|endoftext|> ends a plain-text document; a toy
        # model that opens a new turn (<|im_start|>) without closing its own is done too.
        eos_token_id=[
            token_id(tokenizer, name) for name in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
        ],
        pad_token_id=token_id(tokenizer, "<|endoftext|>"),
        do_sample=False,
    ).save_pretrained(str(out))


MODEL_CARD = """\
# tiny — agentcache's bundled toy model

A **toy** causal language model that agentcache trains itself so that every path (the local
runtime, the prefix cache, the demo, the tests) runs offline before anything is downloaded.
It produces word-like, chat-shaped text. **It is not for answers**: do not trust what it says.

- Architecture: Llama (`LlamaForCausalLM`), {num_layers} layers, hidden size {hidden}, \
{heads} attention heads / {kv_heads} KV heads (head_dim {head_dim}), tied embeddings, RoPE, \
`max_position_embeddings` {max_pos} (trained on {seq_len}-token windows).
- Parameters: {num_parameters:,}. Weights stored in float16 (`model.safetensors`, \
{size_mb:.2f} MB); `config.json` declares float32, so `from_pretrained` computes in float32.
- Tokenizer: byte-level BPE, {vocab} tokens. `<|endoftext|>`=0, `<|im_start|>`=1, \
`<|im_end|>`=2 (special); `<tool_call>`=3, `</tool_call>`=4, `<tool_response>`=5, \
`</tool_response>`=6 (single tokens, not special, so decoding keeps them).
- Chat template: ChatML. `tools` are listed in the system turn; assistant `tool_calls` are \
rendered as `<tool_call>\\n{{"name": ..., "arguments": ...}}\\n</tool_call>`; each `tool` message \
becomes its own user turn wrapping `<tool_response>\\n...\\n</tool_response>`. \
History is never rewritten, so the prompt of turn n plus the reply and `<|im_end|>` is a \
token prefix of turn n+1. \
Generation stops at `<|im_end|>` (id 2), `<|endoftext|>` (id 0) or a new turn's \
`<|im_start|>` (id 1).

## Training data
Docstrings of the Python {python} standard library on the training machine (modules, classes,
functions; walked with `ast` in sorted path order; test packages skipped), plus ChatML chat
samples synthesised from them (questions answered with the docstring's first sentence, some via a
`lookup_doc` tool call and tool result). Source files are split by a hash of their path: one in
{buckets} is held out for validation.

## Results
| | value |
|---|---|
| training tokens | {train_tokens:,} |
| steps × batch × window | {num_steps} × {batch_size} × {seq_len} |
| final train loss (smoothed) | {train_loss:.4f} |
| **validation loss** ({val_windows} windows of {seq_len} tokens, float32) | **{val_loss:.4f}** |
| training wall time (2 CPU threads) | {wall_minutes:.1f} min |

The wall time was measured on a 2-core machine shared with other jobs; steps that ran alone took
about 1.2 s each, so an idle 2-core machine trains it in roughly 6 minutes.

## Reproduce
```
python scripts/train_tiny.py --out runtime/models/tiny          # train (fixed seeds)
python scripts/train_tiny.py --out runtime/models/tiny --eval-only  # recompute validation loss
```
Exact numbers depend on the Python version's stdlib and on the torch build; `training_stats.json`
records both, with a fingerprint of the validation tokens.
"""


def write_card(out: Path, stats: dict[str, Any], config: LlamaConfig) -> None:
    """Write training_stats.json and the README.md model card."""
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    card = MODEL_CARD.format(
        num_layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_pos=config.max_position_embeddings,
        vocab=config.vocab_size,
        size_mb=stats["safetensors_bytes"] / 1e6,
        wall_minutes=stats["wall_seconds"] / 60,
        buckets=VAL_BUCKETS,
        **stats,
        **stats["train_config"],
    )
    (out / "README.md").write_text(card)


# ----------------------------------------------------------------------------- entry points


def run_training(out: Path, config: TrainConfig) -> None:
    """Gather the corpus, train tokenizer and model, save everything and the model card."""
    torch.manual_seed(SEED)
    out.mkdir(parents=True, exist_ok=True)
    train_records = collect_records("train")
    tokenizer = train_tokenizer([doc_text(record) for record in train_records])
    save_tokenizer(tokenizer, out)
    train_ids = encode_stream(tokenizer, split_texts(train_records, tokenizer, seed=SEED))
    print(f"train: {len(train_records)} docstrings, {train_ids.numel():,} tokens", flush=True)
    model_cfg = model_config(tokenizer)
    model = LlamaForCausalLM(model_cfg)
    num_parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {num_parameters:,} parameters", flush=True)
    train_loss, wall = train(model, train_ids, config)
    save_model(model, tokenizer, out)
    shipped = evaluate_shipped(out)
    subset = evaluate_shipped(out, max_windows=SUBSET_WINDOWS)
    stats = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "num_parameters": num_parameters,
        "safetensors_bytes": (out / "model.safetensors").stat().st_size,
        "train_tokens": train_ids.numel(),
        "train_loss": train_loss,
        "wall_seconds": wall,
        "train_config": vars_of(config),
        "val_subset_loss": subset["val_loss"],
        "val_subset_windows": subset["val_windows"],
        "val_subset_sha256": subset["val_sha256"],
        **shipped,
    }
    write_card(out, stats, model_cfg)
    print(f"train_loss {train_loss:.4f}  val_loss {shipped['val_loss']:.4f}  {wall:.0f}s")


def vars_of(config: TrainConfig) -> dict[str, Any]:
    """The fields of a slotted dataclass as a dict."""
    return {name: getattr(config, name) for name in TrainConfig.__dataclass_fields__}


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and train, or only re-evaluate the shipped weights."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=TrainConfig().num_steps)
    parser.add_argument("--eval-only", action="store_true", help="recompute the val loss only")
    parser.add_argument("--max-windows", type=int, default=EVAL_MAX_WINDOWS)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.eval_only:
        result = evaluate_shipped(args.out, max_windows=args.max_windows)
        print(json.dumps(result, indent=2))
        return
    run_training(args.out, TrainConfig(num_steps=args.steps))


if __name__ == "__main__":
    main()
