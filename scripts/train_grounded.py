"""Teach the bundled ``tiny`` model the demo's job: answer by copying from the retrieved sources.

The task is the demo's own: a question about a stdlib module, class or function; the demo's
prompt (system prompt, pinned documents, tool schemas, the planner's ``search_docs`` /
``read_doc`` calls and their results, the right chunk among BM25 distractors at varying
positions); as target the grounded answer ``"<dotted name>: <first sentence>"``, both copied
verbatim from the chunk that starts with ``"<dotted name>\\n\\n<docstring>"`` (the sentence keeps
the docstring's line breaks, so every answer token after the first is a copy of the token that
follows the same text in the prompt). Prompts are rendered by the demo's own agent with a
scripted backend, so training sees the bytes the demo sends. Whole top-level modules are held
out for evaluation. Keeps the tokenizer and the architecture; never imported at run time;
downloads nothing.

Curriculum (the first attempt fine-tuned on full ~2300-token prompts of a model pre-trained on
256-token windows, and learned nothing in 900 examples): the prompt's stable head (system
prompt, pinned documents, tool schemas) runs without gradients and its KV is reused; only the
turn's tail (question, tool calls, tool results, answer) is trained. Stage 1 uses prompts
without pinned documents and short tails, stage 2 every document set and prompts up to
``MAX_PROMPT_TOKENS``. A slice of ``train_tiny``'s language-model windows is mixed in so the
model keeps its language.

    python scripts/train_grounded.py --base runtime/models/tiny --out /tmp/new  # fine-tune
    python scripts/train_grounded.py --out runtime/models/tiny --eval-only      # figures

A stage 0 that teaches long-range copying on synthetic sequences first is
``scripts/train_copy.py``; continue from its output with ``--stage1 0`` (and a lower ``--lr``).
Measured runs (none learned to copy; none shipped) are recorded in ``docs/training/``. On a
heavily shared CPU ``--threads 1`` is faster than 2 (2 threads spent 3.5x the CPU time per step).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_tiny  # noqa: E402  (sibling script)

from agentcache import demo  # noqa: E402
from agentcache.backends.fake import FakeBackend  # noqa: E402
from agentcache.prompt import Document  # noqa: E402
from agentcache.rag import Chunk, DocumentIndex, TextSource  # noqa: E402
from agentcache.rag.chunking import chunk_sources  # noqa: E402
from agentcache.rag.stdlib import stdlib_sources  # noqa: E402

SEED = 4321
HELD_OUT_BUCKETS = 8  # NOTE: one top-level module in HELD_OUT_BUCKETS is held out.
MAX_PROMPT_TOKENS = 2300
MAX_ANSWER_CHARS = 200
QUESTIONS_DOTTED = (
    "What does {name} do?",
    "What is {name} for?",
    "Explain {name} in one sentence.",
    "Can you tell me what {name} is?",
)
QUESTIONS_PLAIN = (
    "In {module}, what does {leaf} do?",
    "What is {leaf} in the {module} module for?",
)
QUESTIONS_MODULE = ("What is the {module} module for?", "What does the {module} module do?")
SYSTEMS = (demo.SYSTEM, demo.SYSTEM_NEUTRAL)
TURN_START = "<|im_start|>user\n"


@dataclass(frozen=True, slots=True)
class Example:
    """One rendered demo prompt and its grounded answer."""

    prompt: str
    answer: str
    module: str
    has_read_doc: bool


@dataclass(frozen=True, slots=True)
class TuneConfig:
    """Hyper-parameters of the fine-tune; every value is recorded in training_stats.json."""

    stage1_batches: int = 400
    """Synthetic demo-shaped turns (no system/tools head, 3-4 short chunks, 1-3 answers)."""
    stage1_batch_size: int = 8
    stage1_chunk_chars: int = 120
    """Chunks shown in stage 1 are cut after this many characters (never inside the answer)."""
    stage1_fraction: float = 0.8
    """Stage 1 ends after this fraction of the time budget even if batches remain."""
    context_weight: float = 0.1
    """Stage 1 loss weight of non-answer tokens (answers weigh 1)."""
    stage2_examples: int = 250
    """Real demo prompts (any document set, whole prompt at most MAX_PROMPT_TOKENS tokens)."""
    stage2_tail: int = 700
    """Longest stage-2 tail (first user turn to the answer) in tokens; the head has no grad."""
    accumulate: int = 4
    """Stage-2 examples per optimizer step."""
    lr: float = 2e-3
    min_lr: float = 5e-5
    warmup_steps: int = 20
    tail_weight: float = 0.3
    """Stage-2 weight of the language-model loss on the tail's prompt tokens (copies of the
    question and of retrieved chunks in read_doc results: cheap extra copying practice)."""
    lm_every: int = 4
    """One train_tiny training window (256 tokens, LM loss) every lm_every optimizer steps."""
    refresh_every: int = 10
    """Stage-2 optimizer steps between recomputing the prompt heads' KV (the weights move)."""
    max_minutes: float = 50.0
    """Stop early (and record it) when the wall time passes this; the learning-rate schedule
    follows max(step fraction, time fraction), so a stop comes at the low end of the decay."""
    checkpoint_minutes: float = 10.0


def top_module(source: str) -> str:
    """``json.decoder:JSONDecoder`` -> ``json``."""
    return source.split(":")[0].split(".")[0]


def is_held_out(module: str) -> bool:
    """Whole top-level modules go to the held-out split by a stable hash of their name."""
    return hashlib.sha256(module.encode()).digest()[0] % HELD_OUT_BUCKETS == 0


def dotted(source: str) -> str:
    """``json.decoder:JSONDecoder`` -> ``json.decoder.JSONDecoder``."""
    return source.replace(":", ".")


def answer_of(chunk: Chunk) -> str | None:
    """``"<dotted name>: <first sentence>"`` copied verbatim from a source's first chunk.

    The sentence is ``train_tiny.first_sentence`` (prose only) located in the raw docstring, so
    it keeps the docstring's own line breaks; a sentence that ``first_sentence`` had to end with
    an added ``.`` keeps that ``.``.
    """
    name, _, doc = chunk.text.partition("\n\n")
    sentence = train_tiny.first_sentence(doc)
    if sentence is None:
        return None
    span = locate(sentence, doc)
    if span is None and sentence.endswith("."):
        found = locate(sentence[:-1], doc)
        span = None if found is None else found + "."
    return f"{name.strip()}: {span or sentence}"


def locate(sentence: str, doc: str) -> str | None:
    """The first span of ``doc`` with the words of ``sentence`` separated by any whitespace."""
    pattern = r"\s+".join(re.escape(word) for word in sentence.split())
    match = re.search(pattern, doc)
    return None if match is None else match.group(0)


def normalized(text: str) -> str:
    """Whitespace runs collapsed to one space (answers keep the docstring's line breaks)."""
    return " ".join(text.split())


def question_for(source: str, rng: random.Random) -> str:
    """A question naming the object: dotted (the planner adds read_doc) or in words."""
    module, _, qualname = source.partition(":")
    if not qualname:
        if rng.random() < 0.5:
            return rng.choice(QUESTIONS_MODULE).format(module=module)
        return rng.choice(QUESTIONS_DOTTED).format(name=module)
    if rng.random() < 0.5:
        return rng.choice(QUESTIONS_DOTTED).format(name=dotted(source))
    return rng.choice(QUESTIONS_PLAIN).format(module=module, leaf=qualname)


class ForcedTools(demo.DocTools):
    """The demo's tools (same schemas), with the target chunk always among the search results."""

    forced: Chunk | None = None

    def search_docs(self, query: str) -> str:
        chunks = self.index.retrieve(query, k=3)
        forced = self.forced
        if forced is not None and forced not in chunks:
            slot = int(hashlib.sha256(query.encode()).digest()[0]) % len(chunks)
            chunks[slot] = forced
            chunks.sort(key=lambda chunk: chunk.id)
        return demo.format_chunks(chunks)

    # NOTE: the registry builds tool schemas from docstrings: keep the demo's, byte for byte.
    search_docs.__doc__ = demo.DocTools.search_docs.__doc__


class Renderer:
    """Renders demo prompts through the demo's agent with a scripted backend."""

    def __init__(self, sources: list[TextSource], tokenizer: PreTrainedTokenizerFast) -> None:
        self.sources = sources
        self.chunks = chunk_sources(sources)
        self.index = DocumentIndex(self.chunks)
        self.tokenizer = tokenizer
        self.pinned = demo._pinned(self.chunks)
        module_docs = [
            Document(c.id, c.text, source=c.source)
            for c in self.chunks
            if c.position == 0 and ":" not in c.source
        ]
        # NOTE: a few fixed pinned-document sets, so the stable prompt heads repeat and their
        # KV can be computed once per refresh (see PrefixKV) instead of once per example.
        picker = random.Random(SEED)
        self.document_sets: list[list[Document]] = [list(self.pinned), []]
        for size in (2, 3, 4, 5):
            picked = picker.sample(module_docs, k=size)
            self.document_sets.append(sorted(picked, key=lambda doc: doc.id))

    def targets(self) -> list[tuple[Chunk, str]]:
        """First chunks whose docstring starts with a usable sentence, with their answers."""
        found = []
        for chunk in self.chunks:
            answer = answer_of(chunk) if chunk.position == 0 else None
            if answer is not None and len(answer) <= MAX_ANSWER_CHARS:
                found.append((chunk, answer))
        return found

    def render(
        self,
        history: list[tuple[str, Chunk, str]],
        documents: list[Document],
        system: str,
    ) -> tuple[str, bool]:
        """The final prompt of the last question in ``history`` (earlier ones answered)."""
        tools = ForcedTools(self.index, {s.source: s.text for s in self.sources})
        answers = [answer for _, _, answer in history[:-1]] + ["(unused)"]
        backend = FakeBackend(answers, model="tiny", tool_call_format="hermes")
        agent = demo.Agent(
            backend,
            system=system,
            documents=documents,
            planner=demo.plan,
            config=demo.AgentConfig(max_steps=3, namespace="agentcache-demo"),
        )
        agent.registry.add(tools.search_docs, cache=False)
        agent.registry.add(tools.read_doc, cache=False)
        for question, chunk, _ in history:
            tools.forced = chunk
            agent.run(question)
        prompt = backend.prompts[-1]
        text = self.tokenizer.apply_chat_template(
            prompt.to_messages(),
            tools=prompt.tool_schemas() or None,
            add_generation_prompt=True,
            tokenize=False,
        )
        has_read_doc = any(name == "read_doc" for name, _ in demo.plan(history[-1][0]))
        return str(text), has_read_doc

    def num_tokens(self, text: str) -> int:
        """Token count of ``text`` (no special tokens added)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def make_examples(
    renderer: Renderer,
    held_out: bool,
    count: int,
    seed: int,
    *,
    document_sets: list[list[Document]] | None = None,
    max_tail: int = MAX_PROMPT_TOKENS,
) -> list[Example]:
    """``count`` examples from the training (or held-out) modules, deterministically.

    ``document_sets``: the pinned-document sets to draw from (default: all of the renderer's);
    ``max_tail``: longest turn tail in tokens (from the first user turn to the prompt's end).
    """
    rng = random.Random(seed)
    pool = [t for t in renderer.targets() if is_held_out(top_module(t[0].source)) == held_out]
    sets = renderer.document_sets if document_sets is None else document_sets
    examples: list[Example] = []
    while len(examples) < count:
        turns = 1 if held_out or rng.random() < 0.85 else 2
        history = []
        for _ in range(turns):
            chunk, answer = rng.choice(pool)
            history.append((question_for(chunk.source, rng), chunk, answer))
        system = rng.choice(SYSTEMS)
        prompt, has_read_doc = renderer.render(history, rng.choice(sets), system)
        tail = prompt[prompt.index(TURN_START) :]
        if renderer.num_tokens(tail) > max_tail:
            continue
        if renderer.num_tokens(prompt) > MAX_PROMPT_TOKENS:
            continue
        chunk, answer = history[-1][1], history[-1][2]
        examples.append(Example(prompt, answer, top_module(chunk.source), has_read_doc))
    return examples


# ----------------------------------------------------------------------------- stage 1


Piece = tuple[str, bool]
"""A piece of a training sequence and whether it is an answer (full loss) or context."""


def short_text(chunk: Chunk, answer: str, max_chars: int) -> str:
    """The chunk's text cut after ``max_chars`` characters, never inside its answer."""
    sentence = answer.partition(": ")[2]
    end = chunk.text.find(sentence)
    keep = max(max_chars, end + len(sentence) if end >= 0 else len(chunk.text))
    return chunk.text[:keep]


def tool_call(name: str, arguments: dict[str, str]) -> str:
    """One hermes tool call as the chat template renders it (compact arguments)."""
    payload = json.dumps(arguments, separators=(",", ":"))
    return f'<tool_call>\n{{"name": "{name}", "arguments": {payload}}}\n</tool_call>'


def synthetic_sequence(
    rng: random.Random,
    pool: list[tuple[Chunk, str]],
    by_module: dict[str, list[tuple[Chunk, str]]],
    max_chars: int,
) -> list[Piece]:
    """A short demo-shaped turn: question, search call, 3-4 chunks, answer, follow-up Q/As.

    Distractors are mostly siblings from the same top-level module (as BM25 returns them);
    1-3 of the shown chunks are asked about, so every sequence holds several copy targets.
    """
    target = rng.choice(pool)
    siblings = [t for t in by_module[top_module(target[0].source)] if t[0] != target[0]]
    shown = [target]
    while len(shown) < rng.randint(3, 4):
        other = rng.choice(siblings) if siblings and rng.random() < 0.7 else rng.choice(pool)
        if all(other[0] != s[0] for s in shown):
            shown.append(other)
    asked = [target] + rng.sample(shown[1:], k=rng.randint(0, min(2, len(shown) - 1)))
    shown.sort(key=lambda t: t[0].id)
    results = "\n\n".join(f"[{c.id}] ({c.source})\n{short_text(c, a, max_chars)}" for c, a in shown)
    question = question_for(target[0].source, rng)
    calls = [tool_call("search_docs", {"query": question})]
    responses = [results]
    if "." in question and rng.random() < 0.5:
        calls.append(tool_call("read_doc", {"name": dotted(target[0].source)}))
        responses.append(short_text(target[0], target[1], 2 * max_chars))
    context = f"{TURN_START}{question}<|im_end|>\n<|im_start|>assistant\n" + "\n".join(calls)
    for response in responses:
        context += f"<|im_end|>\n{TURN_START}<tool_response>\n{response}\n</tool_response>"
    pieces: list[Piece] = [(context + "<|im_end|>\n<|im_start|>assistant\n", False)]
    for number, (chunk, answer) in enumerate(asked):
        if number:
            follow = question_for(chunk.source, rng)
            pieces.append((f"\n{TURN_START}{follow}<|im_end|>\n<|im_start|>assistant\n", False))
        pieces.append((answer + "<|im_end|>", True))
    return pieces


def synthetic_batches(
    renderer: Renderer, count: int, batch_size: int, seed: int, max_chars: int
) -> list[list[list[Piece]]]:
    """``count`` batches of synthetic sequences from the training modules (seeded)."""
    rng = random.Random(seed)
    pool = [t for t in renderer.targets() if not is_held_out(top_module(t[0].source))]
    by_module: dict[str, list[tuple[Chunk, str]]] = {}
    for target in pool:
        by_module.setdefault(top_module(target[0].source), []).append(target)
    return [
        [synthetic_sequence(rng, pool, by_module, max_chars) for _ in range(batch_size)]
        for _ in range(count)
    ]


def encode_batch(
    tokenizer: PreTrainedTokenizerFast, batch: list[list[Piece]], context_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids ``[b, n]``, attention mask ``[b, n]``, per-target loss weights ``[b, n - 1]``)."""
    rows, weights = [], []
    for pieces in batch:
        ids: list[int] = []
        row_weights: list[float] = []
        for text, is_answer in pieces:
            encoded = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids += encoded
            row_weights += [1.0 if is_answer else context_weight] * len(encoded)
        rows.append(ids)
        weights.append(row_weights[1:])
    width = max(len(ids) for ids in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [b, n]; pad id 0
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # [b, n]
    loss_weights = torch.zeros(len(rows), width - 1)  # [b, n - 1]
    for row, (ids, row_weights) in enumerate(zip(rows, weights, strict=True)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        loss_weights[row, : len(row_weights)] = torch.tensor(row_weights)
    return input_ids, mask, loss_weights


def synthetic_loss(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    batch: list[list[Piece]],
    context_weight: float,
) -> tuple[torch.Tensor, float]:
    """(weighted loss: answers 1, context ``context_weight``; mean answer-token loss)."""
    ids, mask, weights = encode_batch(tokenizer, batch, context_weight)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # [b, n-1, V]
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(weights)  # [b, n - 1]
    answer = weights == 1.0
    answer_mean = (losses * answer).sum() / answer.sum()
    return (losses * weights).sum() / weights.sum(), answer_mean.item()


# ----------------------------------------------------------------------------- training


class PrefixKV:
    """KV of the prompts' stable heads (system, documents, tools), computed without gradients.

    Every example's prompt starts with one of a few heads; its KV is computed once and reused
    until ``clear`` (called every few optimizer steps, so it follows the changing weights).
    Only the tail (the turn, the tool results and the answer) runs with gradients.
    """

    def __init__(self, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stored: dict[str, tuple[DynamicCache, int]] = {}
        self.end_id = train_tiny.token_id(tokenizer, "<|im_end|>")

    def clear(self) -> None:
        """Forget every stored head (the weights moved)."""
        self.stored.clear()

    def split(self, example: Example) -> tuple[DynamicCache, torch.Tensor, int]:
        """(fresh copy of the head's KV, tail ids ``[1, t]``, answer start in the tail)."""
        cut = example.prompt.index(TURN_START)
        head, rest = example.prompt[:cut], example.prompt[cut:]
        if head not in self.stored:
            head_ids = torch.tensor([self.encode(head)])  # [1, h]
            cache = DynamicCache(config=self.model.config)
            with torch.no_grad():
                self.model.model(input_ids=head_ids, past_key_values=cache, use_cache=True)
            self.stored[head] = (cache, head_ids.shape[1])
        cache, _ = self.stored[head]
        rest_ids = self.encode(rest)
        tail = torch.tensor([rest_ids + self.encode(example.answer) + [self.end_id]])  # [1, t]
        return copy.deepcopy(cache), tail, len(rest_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_loss(
    prefix: PrefixKV, example: Example, tail_weight: float
) -> tuple[torch.Tensor, float]:
    """(answer cross-entropy + ``tail_weight`` x tail LM loss, the answer loss alone)."""
    cache, tail, start = prefix.split(example)
    hidden = prefix.model.model(input_ids=tail, past_key_values=cache, use_cache=True)
    logits = prefix.model.lm_head(hidden.last_hidden_state[0, :-1]).float()  # [t - 1, vocab]
    losses = torch.nn.functional.cross_entropy(logits, tail[0, 1:], reduction="none")  # [t - 1]
    answer = losses[start - 1 :].mean()
    return answer + tail_weight * losses[: start - 1].mean(), answer.item()


def lm_loss(model: LlamaForCausalLM, window: torch.Tensor) -> torch.Tensor:
    """Plain next-token loss on one ``[1, 256]`` window of train_tiny's training stream."""
    return model(input_ids=window, labels=window).loss


def lr_at(step: int, progress: float, config: TuneConfig) -> float:
    """Linear warm-up over steps, then cosine decay to ``min_lr`` over ``progress`` in [0, 1]."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, progress)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def lm_windows(tokenizer: PreTrainedTokenizerFast, count: int) -> torch.Tensor:
    """``count`` random 256-token windows of train_tiny's training stream (seeded)."""
    texts = train_tiny.split_texts(train_tiny.collect_records("train"), tokenizer, seed=1234)
    stream = train_tiny.encode_stream(tokenizer, texts)
    generator = torch.Generator().manual_seed(SEED)
    starts = torch.randint(0, stream.numel() - train_tiny.SEQ_LEN, (count,), generator=generator)
    return torch.stack([stream[s : s + train_tiny.SEQ_LEN] for s in starts.tolist()])


def fine_tune(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    stage1: list[list[list[Piece]]],
    stage2: list[Example],
    config: TuneConfig,
    checkpoint: Path | None,
) -> dict[str, Any]:
    """Stage 1 batches, then stage 2 examples, within the time budget; returns what happened."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    steps: list[tuple[int, Any]] = [(1, batch) for batch in stage1]
    for start in range(0, len(stage2), config.accumulate):
        steps.append((2, stage2[start : start + config.accumulate]))
    windows = lm_windows(tokenizer, len(steps) // config.lm_every + 1)
    budget = 60 * config.max_minutes
    prefix = PrefixKV(model, tokenizer)
    started = saved = time.perf_counter()
    smooth = {"answer1": float("nan"), "answer2": float("nan"), "lm": float("nan")}
    seen = {"stage1_batches": 0, "stage2_examples": 0, "lm_windows": 0, "optimizer_steps": 0}
    model.train()
    step, stage2_at = 0, len(stage1)
    while step < len(steps):
        elapsed = time.perf_counter() - started
        if step < stage2_at and elapsed > config.stage1_fraction * budget:
            step = stage2_at  # NOTE: stage 1 ran out of time: move on to the demo prompts.
            continue
        lr = lr_at(seen["optimizer_steps"], max(step / len(steps), elapsed / budget), config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        stage, work = steps[step]
        if stage == 1:
            loss, answer = synthetic_loss(model, tokenizer, work, config.context_weight)
            loss.backward()
            smooth["answer1"] = ema(smooth["answer1"], answer)
            seen["stage1_batches"] += 1
        else:
            if (step - stage2_at) % config.refresh_every == 0:
                prefix.clear()
            for example in work:
                loss, answer = answer_loss(prefix, example, config.tail_weight)
                (loss / len(work)).backward()
                smooth["answer2"] = ema(smooth["answer2"], answer)
                seen["stage2_examples"] += 1
        if step % config.lm_every == 0:
            lm = lm_loss(model, windows[seen["lm_windows"] : seen["lm_windows"] + 1])
            (0.5 * lm).backward()
            smooth["lm"] = ema(smooth["lm"], lm.item())
            seen["lm_windows"] += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seen["optimizer_steps"] += 1
        elapsed = time.perf_counter() - started
        if step % 10 == 0 or step == len(steps) - 1:
            print(
                f"step {step:4d}/{len(steps)} stage {stage}  answer_loss "
                f"{smooth['answer1']:.4f}/{smooth['answer2']:.4f}  lm_loss {smooth['lm']:.4f}  "
                f"lr {lr:.2e}  {elapsed:6.0f}s",
                flush=True,
            )
        if checkpoint is not None and time.perf_counter() - saved > 60 * config.checkpoint_minutes:
            save_checkpoint(model, tokenizer, checkpoint, seen)
            saved = time.perf_counter()
        if elapsed > budget:
            print(f"stopping at the time budget: {seen}", flush=True)
            break
        step += 1
    model.eval()
    return {
        "answer_loss_smoothed_stage1": smooth["answer1"],
        "answer_loss_smoothed_stage2": smooth["answer2"],
        "lm_loss_smoothed": smooth["lm"],
        **seen,
        "wall_seconds": time.perf_counter() - started,
    }


def ema(previous: float, value: float) -> float:
    """Exponential moving average (0.95) that starts at the first value."""
    return value if math.isnan(previous) else 0.95 * previous + 0.05 * value


def save_checkpoint(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, seen: dict[str, int]
) -> None:
    """Save a float16 copy of the weights (the training model stays float32)."""
    out.mkdir(parents=True, exist_ok=True)
    train_tiny.save_model(copy.deepcopy(model), tokenizer, out)
    (out / "checkpoint.json").write_text(json.dumps(seen) + "\n")
    print(f"checkpoint after {seen} -> {out}", flush=True)


# ----------------------------------------------------------------------------- evaluation


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over whitespace words (longest common subsequence)."""
    a, b = candidate.split(), reference.split()
    if not a or not b:
        return 0.0
    previous = [0] * (len(b) + 1)
    for word in a:
        current = [0]
        for j, other in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if word == other else max(previous[j], current[-1]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


@torch.no_grad()
def generate(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str) -> str:
    """Greedy answer (up to 96 tokens), stopping where the shipped generation config says."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    output = model.generate(ids, max_new_tokens=96, do_sample=False)
    return str(tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)).strip()


def grounding(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example]
) -> dict[str, Any]:
    """Exact-answer, exact-first-sentence and source-named rates and mean ROUGE-L.

    Comparisons are on whitespace-normalized text (an answer that keeps or drops the
    docstring's line breaks has the same words); ``source_named``: the answer starts with the
    right dotted name followed by ``:``.
    """
    rows = []
    for example in examples:
        text = generate(model, tokenizer, example.prompt)
        got, target = normalized(text), normalized(example.answer)
        name, _, sentence = target.partition(": ")
        rows.append(
            {
                "exact": got == target,
                "sentence": sentence in got,
                "named": got.startswith(name + ":"),
                "rouge_l": rouge_l(got, target),
                "read_doc": example.has_read_doc,
                "text": text,
            }
        )

    def summary(selected: list[dict[str, Any]]) -> dict[str, Any]:
        count = max(1, len(selected))
        return {
            "n": len(selected),
            "exact_answer": sum(r["exact"] for r in selected) / count,
            "exact_first_sentence": sum(r["sentence"] for r in selected) / count,
            "source_named": sum(r["named"] for r in selected) / count,
            "rouge_l": sum(r["rouge_l"] for r in selected) / count,
        }

    return {
        "all": summary(rows),
        "search_only": summary([r for r in rows if not r["read_doc"]]),
        "with_read_doc": summary([r for r in rows if r["read_doc"]]),
        "samples": [
            {"target": e.answer, "got": r["text"]} for e, r in zip(examples[:6], rows, strict=False)
        ],
    }


def corpus() -> list[TextSource]:
    """The demo's stdlib corpus, unbounded (every module, not the demo's first 250 files)."""
    return stdlib_sources(max_files=100_000, max_chars=10**9)


def load(path: Path) -> LlamaForCausalLM:
    """The weights in ``path`` in float32."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM), "tiny is a Llama"
    model.eval()
    return model


# ----------------------------------------------------------------------------- entry points


def copy_model_files(base: Path, out: Path) -> None:
    """Put the base model's files (tokenizer, configs, card, stats) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    if base.resolve() == out.resolve():
        return
    for path in base.iterdir():
        if path.is_file():
            shutil.copy2(path, out / path.name)


def train_and_evaluate(
    args: argparse.Namespace, renderer: Renderer, held_out: list[Example]
) -> None:
    """Fine-tune the base weights, save them to ``--out`` and record the held-out figures."""
    config = TuneConfig(
        stage1_batches=args.stage1,
        stage2_examples=args.stage2,
        max_minutes=args.max_minutes,
        lr=args.lr,
    )
    started = time.perf_counter()
    stage1 = synthetic_batches(
        renderer, config.stage1_batches, config.stage1_batch_size, SEED, config.stage1_chunk_chars
    )
    stage2 = make_examples(
        renderer, False, config.stage2_examples, seed=SEED + 2, max_tail=config.stage2_tail
    )
    print(f"training data built in {time.perf_counter() - started:.0f}s", flush=True)
    base_sha = hashlib.sha256((args.base / "model.safetensors").read_bytes()).hexdigest()
    copy_model_files(args.base, args.out)
    model = load(args.base)
    torch.manual_seed(SEED)
    run = fine_tune(model, renderer.tokenizer, stage1, stage2, config, args.out / "checkpoint")
    after = grounding(model, renderer.tokenizer, held_out)
    print("after:", json.dumps(after, indent=2), flush=True)
    train_tiny.save_model(model, renderer.tokenizer, args.out)
    record = {
        "seed": SEED,
        "base_sha256": base_sha,
        "held_out_modules": sorted({e.module for e in held_out}),
        "tune_config": {f.name: getattr(config, f.name) for f in fields(TuneConfig)},
        "run": run,
        "after": {k: v for k, v in after.items() if k != "samples"},
        "samples_after": after["samples"],
    }
    (args.out / "grounding_stats.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Build the task, fine-tune, report; or only report (``--eval-only``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, default=train_tiny.DEFAULT_OUT)
    parser.add_argument("--out", type=Path, default=train_tiny.DEFAULT_OUT)
    parser.add_argument("--stage1", type=int, default=TuneConfig().stage1_batches)
    parser.add_argument("--stage2", type=int, default=TuneConfig().stage2_examples)
    parser.add_argument("--lr", type=float, default=TuneConfig().lr, help="peak learning rate")
    parser.add_argument("--eval-examples", type=int, default=60)
    parser.add_argument("--max-minutes", type=float, default=TuneConfig().max_minutes)
    parser.add_argument("--eval-only", action="store_true", help="figures of --out's weights")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--before", type=Path, default=None, help="--eval-only JSON of the base weights"
    )
    parser.add_argument(
        "--finish", action="store_true", help="record figures, val losses and the card in --out"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.finish:
        finish(args.out, args.before)
        return
    tokenizer = train_tiny.load_tokenizer(args.base)
    renderer = Renderer(corpus(), tokenizer)
    held_out = make_examples(renderer, True, args.eval_examples, seed=SEED + 1)
    modules = sorted({e.module for e in held_out})
    print(f"held-out modules ({len(modules)}): {', '.join(modules)}", file=sys.stderr)
    if args.eval_only:
        result = grounding(load(args.out), tokenizer, held_out)
        print(json.dumps(result, indent=2), flush=True)
        return
    train_and_evaluate(args, renderer, held_out)


def finish(out: Path, before: Path | None) -> None:
    """Record the base model's figures, recompute the validation losses, rewrite the card."""
    grounding_path = out / "grounding_stats.json"
    record = json.loads(grounding_path.read_text())
    if before is not None:
        old = json.loads(before.read_text())
        record["before"] = {k: v for k, v in old.items() if k != "samples"}
        record["samples_before"] = old.get("samples", [])
    grounding_path.write_text(json.dumps(record, indent=2) + "\n")
    stats_path = out / "training_stats.json"
    stats = json.loads(stats_path.read_text())
    stats.setdefault("val_loss_before_grounded_finetune", stats["val_loss"])
    stats.setdefault("val_subset_loss_before_grounded_finetune", stats["val_subset_loss"])
    shipped = train_tiny.evaluate_shipped(out)
    subset = train_tiny.evaluate_shipped(out, max_windows=train_tiny.SUBSET_WINDOWS)
    stats.update(shipped)
    stats["val_subset_loss"] = subset["val_loss"]
    stats["val_subset_sha256"] = subset["val_sha256"]
    stats["safetensors_bytes"] = (out / "model.safetensors").stat().st_size
    stats["grounded_finetune"] = {
        k: record[k] for k in ("seed", "base_sha256", "tune_config", "run", "held_out_modules")
    }
    stats["grounded_finetune"]["held_out_after"] = record["after"]
    stats["grounded_finetune"]["held_out_before"] = record.get("before")
    model = load(out)
    train_tiny.write_card(out, stats, model.config)
    card = (out / "README.md").read_text().replace(TOY_LINE, GROUNDED_LINE)
    (out / "README.md").write_text(card + grounded_section(record, stats))


TOY_LINE = (
    "It produces word-like, chat-shaped text. **It is not for answers**: do not trust what it says."
)
GROUNDED_LINE = (
    "It was then fine-tuned on the demo's own task (below): answer from the retrieved sources "
    "by copying the relevant docstring's first sentence. **It does not reason, paraphrase or "
    "know anything beyond the prompt**: trust only what it copies, and check the source."
)


def grounded_section(record: dict[str, Any], stats: dict[str, Any]) -> str:
    """The card's section on the grounded-answer fine-tune, with old vs new figures."""
    rows = []
    for split in ("all", "search_only", "with_read_doc"):
        old, new = record.get("before", {}).get(split), record["after"][split]
        for key, label in (
            ("exact_answer", "exact answer (name + first sentence)"),
            ("exact_first_sentence", "first sentence copied exactly"),
            ("source_named", "answer starts with the right dotted name"),
            ("rouge_l", "ROUGE-L F1 vs the target answer"),
        ):
            before = "n/a" if old is None else f"{old[key]:.3f}"
            rows.append(f"| {split} (n={new['n']}) | {label} | {before} | {new[key]:.3f} |")
    run, config = record["run"], record["tune_config"]
    return f"""
## Grounded-answer fine-tune (`scripts/train_grounded.py`)
Task: a question about a stdlib object; the demo's prompt with the right chunk among distractors;
target `"<dotted name>: <first sentence of its docstring>"`, both copied from the chunk (the
sentence keeps the docstring's line breaks; figures compare whitespace-normalized text).
Stage 1: {run["stage1_batches"]} batches of {config["stage1_batch_size"]} short synthetic
demo-shaped turns (search call, 3-4 chunks cut to {config["stage1_chunk_chars"]}+ characters,
mostly same-module distractors, 1-3 questions each). Stage 2: {run["stage2_examples"]} real demo
prompts rendered by the demo's agent (head without gradients). Mixed in: {run["lm_windows"]}
language-model windows of `train_tiny`'s training stream. Peak lr {config["lr"]},
{run["wall_seconds"] / 60:.1f} min on a shared 2-core machine. Whole top-level modules are held
out ({", ".join(record["held_out_modules"])}); greedy answers on their demo prompts, base weights
vs these:

| held-out split | figure | base | fine-tuned |
|---|---|---|---|
{chr(10).join(rows)}

Validation loss (train_tiny's {stats["val_windows"]} windows): base
{stats["val_loss_before_grounded_finetune"]:.4f}, fine-tuned {stats["val_loss"]:.4f}.
`search_only`: the answer must be picked among the search results; `with_read_doc`: the planner
also called `read_doc` (on the named object, or on the module for questions that name it in
words). What it can do: copy a docstring's first sentence from the prompt. What it cannot do:
answer anything the sources do not say, combine sources, follow instructions, or plan tool
calls (the demo's planner picks them).

```
python scripts/train_tiny.py --out /tmp/base                                  # base weights
python scripts/train_grounded.py --out /tmp/base --eval-only > before.json    # base figures
python scripts/train_grounded.py --base /tmp/base --out /tmp/new              # fine-tune
python scripts/train_grounded.py --out /tmp/new --finish --before before.json # card, stats
```
"""


if __name__ == "__main__":
    main()
