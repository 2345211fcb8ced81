"""Fine-tune the bundled ``tiny`` model to answer from retrieved sources, and measure it.

The task is the demo's own: a question about a stdlib function, class or module; the demo's
prompt (system prompt, pinned documents, tool schemas, the planner's ``search_docs`` /
``read_doc`` calls and their results, the right chunk among BM25 distractors at varying
positions); as target the short grounded answer ``"<dotted name>: <first sentence>"``. Whole
top-level modules are held out for evaluation. Prompts are rendered by the demo's own agent
(with a scripted backend), so training sees exactly the bytes the demo sends. Keeps the
tokenizer and the architecture; never imported at run time; downloads nothing.

    python scripts/train_grounded.py --out runtime/models/tiny            # fine-tune (seeded)
    python scripts/train_grounded.py --out runtime/models/tiny --eval-only  # grounding figures
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
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
TAIL_WEIGHT = 0.5
REFRESH_EVERY = 10  # NOTE: optimizer steps between recomputing the heads' KV.
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

    num_examples: int = 900
    accumulate: int = 2
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_minutes: float = 38.0
    """Stop early (and record it) when the wall time passes this many minutes."""


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
    """``"<dotted name>: <first sentence>"`` from the first chunk of a source, if it is prose."""
    name, _, doc = chunk.text.partition("\n\n")
    sentence = train_tiny.first_sentence(doc)
    return None if sentence is None else f"{name.strip()}: {sentence}"


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
            if answer is not None and len(answer) <= 200:
                found.append((chunk, answer))
        return found

    def render(
        self, history: list[tuple[str, Chunk, str]], rng: random.Random, system: str
    ) -> tuple[str, bool]:
        """The final prompt of the last question in ``history`` (earlier ones answered)."""
        tools = ForcedTools(self.index, {s.source: s.text for s in self.sources})
        answers = [answer for _, _, answer in history[:-1]] + ["(unused)"]
        backend = FakeBackend(answers, model="tiny", tool_call_format="hermes")
        documents = rng.choice(self.document_sets)
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


class ForcedTools(demo.DocTools):
    """The demo's tools, with the target chunk always among the search results."""

    forced: Chunk | None = None

    def search_docs(self, query: str) -> str:
        """Search, then put the forced chunk in place of one result (results in id order)."""
        chunks = self.index.retrieve(query, k=3)
        forced = self.forced
        if forced is not None and forced not in chunks:
            slot = int(hashlib.sha256(query.encode()).digest()[0]) % len(chunks)
            chunks[slot] = forced
            chunks.sort(key=lambda chunk: chunk.id)
        return demo.format_chunks(chunks)

    def read_doc(self, name: str) -> str:
        """The docstring of ``name``, trying every module/qualname split of the dotted name."""
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            module, qualname = ".".join(parts[:cut]), ".".join(parts[cut:])
            text = self.sources.get(f"{module}:{qualname}" if qualname else module)
            if text is not None:
                return text
        return f"no docstring for {name!r}"


SYSTEMS = (demo.SYSTEM, demo.SYSTEM_NEUTRAL)


def make_examples(renderer: Renderer, held_out: bool, count: int, seed: int) -> list[Example]:
    """``count`` examples from the training (or held-out) modules, deterministically."""
    rng = random.Random(seed)
    pool = [t for t in renderer.targets() if is_held_out(top_module(t[0].source)) == held_out]
    examples: list[Example] = []
    while len(examples) < count:
        turns = 1 if held_out or rng.random() < 0.85 else 2
        history = []
        for _ in range(turns):
            chunk, answer = rng.choice(pool)
            history.append((question_for(chunk.source, rng), chunk, answer))
        prompt, has_read_doc = renderer.render(history, rng, rng.choice(SYSTEMS))
        if len(renderer.tokenizer(prompt)["input_ids"]) > MAX_PROMPT_TOKENS:
            continue
        chunk, answer = history[-1][1], history[-1][2]
        examples.append(Example(prompt, answer, top_module(chunk.source), has_read_doc))
    return examples


# ----------------------------------------------------------------------------- training


TURN_START = "<|im_start|>user\n"


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

    def clear(self) -> None:
        """Forget every stored head (the weights moved)."""
        self.stored.clear()

    def split(self, example: Example) -> tuple[DynamicCache, int, torch.Tensor, int]:
        """(fresh copy of the head's KV, head length, tail ids ``[1, t]``, answer start in tail)."""
        cut = example.prompt.index(TURN_START)
        head, rest = example.prompt[:cut], example.prompt[cut:]
        if head not in self.stored:
            head_ids = torch.tensor([self.encode(head)])  # [1, h]
            cache = DynamicCache(config=self.model.config)
            with torch.no_grad():
                self.model.model(input_ids=head_ids, past_key_values=cache, use_cache=True)
            self.stored[head] = (cache, head_ids.shape[1])
        cache, head_len = self.stored[head]
        rest_ids = self.encode(rest)
        answer_ids = self.encode(example.answer) + [
            train_tiny.token_id(self.tokenizer, "<|im_end|>")
        ]
        tail = torch.tensor([rest_ids + answer_ids])  # [1, t]
        return copy.deepcopy(cache), head_len, tail, len(rest_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_loss(prefix: PrefixKV, example: Example) -> torch.Tensor:
    """Cross-entropy on the answer plus ``TAIL_WEIGHT`` x the language-model loss of the tail.

    NOTE: the tail repeats text (the tool call copies the question, ``read_doc`` repeats the
    retrieved chunk): its LM loss is copying practice, many more copy targets per example than
    the answer alone, at no extra forward cost.
    """
    cache, _, tail, start = prefix.split(example)
    hidden = prefix.model.model(input_ids=tail, past_key_values=cache, use_cache=True)
    logits = prefix.model.lm_head(hidden.last_hidden_state[0, :-1]).float()  # [t - 1, vocab]
    losses = torch.nn.functional.cross_entropy(logits, tail[0, 1:], reduction="none")  # [t - 1]
    return losses[start - 1 :].mean() + TAIL_WEIGHT * losses[: start - 1].mean()


def lr_at(step: int, num_steps: int, config: TuneConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, num_steps - config.warmup_steps))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def fine_tune(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: list[Example],
    config: TuneConfig,
) -> dict[str, Any]:
    """One pass over ``examples`` with gradient accumulation; returns what happened."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )
    num_steps = len(examples) // config.accumulate
    prefix = PrefixKV(model, tokenizer)
    started, smoothed, done = time.perf_counter(), float("nan"), 0
    model.train()
    for step in range(num_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, num_steps, config)
        optimizer.zero_grad(set_to_none=True)
        if step % REFRESH_EVERY == 0:
            prefix.clear()
        for example in examples[step * config.accumulate : (step + 1) * config.accumulate]:
            loss = answer_loss(prefix, example) / config.accumulate
            loss.backward()
            value = loss.item() * config.accumulate
            smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
            done += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        elapsed = time.perf_counter() - started
        if step % 10 == 0 or step == num_steps - 1:
            print(
                f"step {step:4d}/{num_steps}  loss {smoothed:.4f}  {elapsed:6.0f}s",
                flush=True,
            )
        if elapsed > 60 * config.max_minutes:
            print(f"stopping at the time budget after {done} examples", flush=True)
            break
    model.eval()
    return {
        "loss_answer_plus_weighted_tail": smoothed,
        "examples_seen": done,
        "wall_seconds": time.perf_counter() - started,
    }


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
    """Greedy answer (up to 64 tokens), stopping at the end of the turn."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    output = model.generate(ids, max_new_tokens=48, do_sample=False)
    return str(tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)).strip()


def grounding(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example]
) -> dict[str, Any]:
    """Exact-answer rate, exact-first-sentence rate and mean ROUGE-L on ``examples``."""
    rows = []
    for example in examples:
        text = generate(model, tokenizer, example.prompt)
        sentence = example.answer.partition(": ")[2]
        rows.append(
            {
                "exact": text == example.answer,
                "sentence": sentence in text,
                "rouge_l": rouge_l(text, example.answer),
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
            "rouge_l": sum(r["rouge_l"] for r in selected) / count,
        }

    return {
        "all": summary(rows),
        "search_only": summary([r for r in rows if not r["read_doc"]]),
        "with_read_doc": summary([r for r in rows if r["read_doc"]]),
        "samples": [
            {"target": e.answer, "got": r["text"]} for e, r in zip(examples[:4], rows, strict=False)
        ],
    }


def corpus() -> list[TextSource]:
    """The demo's stdlib corpus, unbounded (every module, not the demo's first 250 files)."""
    return stdlib_sources(max_files=100_000, max_chars=10**9)


def load(out: Path) -> LlamaForCausalLM:
    """The weights in ``out`` in float32."""
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM), "tiny is a Llama"
    model.eval()
    return model


def main(argv: list[str] | None = None) -> None:
    """Build the task, report the old model, fine-tune, report the new one, save."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=train_tiny.DEFAULT_OUT)
    parser.add_argument("--examples", type=int, default=TuneConfig().num_examples)
    parser.add_argument("--eval-examples", type=int, default=60)
    parser.add_argument("--max-minutes", type=float, default=TuneConfig().max_minutes)
    parser.add_argument("--eval-only", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--before", type=Path, default=None, help="--eval-only JSON of the old weights to record"
    )
    parser.add_argument(
        "--finish", action="store_true", help="only record figures, val losses and the card"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    if args.finish:
        finish(args.out, args.before)
        return
    tokenizer = train_tiny.load_tokenizer(args.out)
    renderer = Renderer(corpus(), tokenizer)
    held_out = make_examples(renderer, True, args.eval_examples, seed=SEED + 1)
    modules = sorted({e.module for e in held_out})
    print(f"held-out modules ({len(modules)}): {', '.join(modules)}", file=sys.stderr)
    if args.eval_only:
        result = grounding(load(args.out), tokenizer, held_out)
        print(json.dumps(result, indent=2), flush=True)
        return
    config = TuneConfig(num_examples=args.examples, max_minutes=args.max_minutes)
    train = make_examples(renderer, False, config.num_examples, seed=SEED)
    model = load(args.out)
    run = fine_tune(model, tokenizer, train, config)
    after = grounding(model, tokenizer, held_out)
    print("after:", json.dumps(after, indent=2), flush=True)
    train_tiny.save_model(model, tokenizer, args.out)
    record = {
        "seed": SEED,
        "held_out_modules": modules,
        "tune_config": {k: getattr(config, k) for k in TuneConfig.__dataclass_fields__},
        "run": run,
        "after": {k: v for k, v in after.items() if k != "samples"},
        "samples_after": after["samples"],
    }
    (args.out / "grounding_stats.json").write_text(json.dumps(record, indent=2) + "\n")
    finish(args.out, args.before)


def finish(out: Path, before: Path | None) -> None:
    """Record the old model's figures, recompute the validation losses, rewrite the card."""
    grounding_path = out / "grounding_stats.json"
    record = json.loads(grounding_path.read_text())
    if before is not None:
        old = json.loads(before.read_text())
        record["before"] = {k: v for k, v in old.items() if k != "samples"}
        record["samples_before"] = old.get("samples", [])
    grounding_path.write_text(json.dumps(record, indent=2) + "\n")
    stats_path = out / "training_stats.json"
    stats = json.loads(stats_path.read_text())
    shipped = train_tiny.evaluate_shipped(out)
    subset = train_tiny.evaluate_shipped(out, max_windows=train_tiny.SUBSET_WINDOWS)
    stats.update(shipped)
    stats["val_subset_loss"] = subset["val_loss"]
    stats["val_subset_sha256"] = subset["val_sha256"]
    stats["safetensors_bytes"] = (out / "model.safetensors").stat().st_size
    stats["grounded_finetune"] = {k: record[k] for k in ("tune_config", "run", "seed")}
    model = load(out)
    train_tiny.write_card(out, stats, model.config)
    card = (out / "README.md").read_text().replace(TOY_LINE, GROUNDED_LINE)
    (out / "README.md").write_text(card + grounded_section(record))


TOY_LINE = (
    "It produces word-like, chat-shaped text. **It is not for answers**: do not trust what it says."
)
GROUNDED_LINE = (
    "It was then fine-tuned on the demo's own task (below): answer from the retrieved sources "
    "by copying the relevant docstring's first sentence. **It does not reason, paraphrase or "
    "know anything beyond the prompt**: trust only what it copies, and check the source."
)


def grounded_section(record: dict[str, Any]) -> str:
    """The card's section on the grounded-answer fine-tune, with old vs new figures."""
    rows = []
    for split in ("all", "search_only", "with_read_doc"):
        old, new = record.get("before", {}).get(split), record["after"][split]
        for key, label in (
            ("exact_answer", "exact answer (name + first sentence)"),
            ("exact_first_sentence", "first sentence copied exactly"),
            ("rouge_l", "ROUGE-L F1 vs the target answer"),
        ):
            before = "n/a" if old is None else f"{old[key]:.3f}"
            rows.append(f"| {split} (n={new['n']}) | {label} | {before} | {new[key]:.3f} |")
    run, config = record["run"], record["tune_config"]
    return f"""
## Grounded-answer fine-tune (`scripts/train_grounded.py`)
Task: the demo's prompt, rendered by the demo's own agent (system prompt, pinned documents, tool
schemas, the planner's `search_docs` / `read_doc` calls and results; the right chunk among BM25
distractors at varying positions); target `"<dotted name>: <first sentence of its docstring>"`.
Whole top-level modules are held out ({", ".join(record["held_out_modules"])}).
Trained on {run["examples_seen"]} examples ({run["wall_seconds"] / 60:.1f} min on a shared 2-core
machine, lr {config["lr"]}, loss on the answer plus {TAIL_WEIGHT} x the language-model loss of the
turn's tail). Greedy answers on held-out modules, old weights vs these:

| held-out split | figure | old | new |
|---|---|---|---|
{chr(10).join(rows)}

`search_only`: the answer must be picked among the search results; `with_read_doc`: the planner
also read the named object, so its docstring is the last tool result. What it can do: copy a
docstring's first sentence from the prompt, often from the right source. What it cannot do:
answer anything the sources do not say, combine sources, follow instructions, or plan tool calls
(the demo's planner picks them).

```
python scripts/train_grounded.py --out runtime/models/tiny --eval-only > before.json  # old figures
python scripts/train_grounded.py --out runtime/models/tiny --before before.json       # fine-tune
```
"""


if __name__ == "__main__":
    main()
