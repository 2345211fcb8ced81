"""Stage 0 of the grounded-answer fine-tune: long-range copying (an induction mechanism).

The bundled ``tiny`` model was pre-trained on 256-token windows and never learned to copy from
far back in its prompt, which the demo's job (``scripts/train_grounded.py``) needs at ~2,300
tokens. This stage trains that skill on synthetic sequences of 512-3,000 tokens built from the
training modules' chunks, rendered as the demo renders search results: distractor chunks
(half from the target's own module) with the asked chunks planted at random positions, some
chunks shown twice (as ``read_doc`` shows them), then questions each answered
``"<dotted name>: <first sentence>"``. Loss: answers 1, repeated chunks ``repeat_weight``, the
rest ``context_weight`` (keeps the language). It knows nothing of the demo's agent or planner.

    python scripts/train_copy.py --base runtime/models/tiny --out /tmp/copy --threads 1
    python scripts/train_grounded.py --base /tmp/copy --out /tmp/new --stage1 0  # real prompts
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_grounded as grounded  # noqa: E402  (sibling script)
import train_tiny  # noqa: E402  (sibling script)

from agentcache.rag import Chunk  # noqa: E402

__all__ = ["CopyConfig", "CopySet", "copy_probe", "induction_loss", "main", "train_copy"]

CHARS_PER_TOKEN = 3.0  # NOTE: about 3.2 on stdlib docstrings with this tokenizer; errs short.
FIRST_PLAIN_ID = 7  # NOTE: ids 0-6 are the chat and tool-call tokens (tiny's README).
VOCAB_SIZE = 4096
Target = tuple[Chunk, str]
Piece = tuple[str, float]
"""A piece of a training sequence and the loss weight of its tokens."""


@dataclass(frozen=True, slots=True)
class CopyConfig:
    """Hyper-parameters of stage 0; every value is recorded in the run's JSON."""

    min_len: int = 512
    """Sequence length (tokens) at the start; it grows towards ``max_len`` (see ramp_gate)."""
    max_len: int = 3000
    ramp_gate: float = 0.5
    """The length grows by ``ramp_tokens`` per step only while the smoothed accuracy on the
    repeated chunks is above this (the copy mechanism works at the current length)."""
    ramp_tokens: int = 24
    random_rows: int = 4
    """Rows of random tokens repeated (the classic induction task) added to each step."""
    random_len: int = 384
    tokens_per_step: int = 3072
    """Sequences are added to a step's batch until it holds about this many tokens (0: none,
    only the random rows: an induction warm-up)."""
    questions: int = 4
    """Chunks asked about (and answered) at the end of each sequence."""
    repeat_chance: float = 0.4
    """Chance that an asked chunk is shown again right before its question (as read_doc does)."""
    sibling_chance: float = 0.5
    """Chance that a distractor comes from the target's own top-level module."""
    reshow_fraction: float = 0.4
    """Share of the sequence that shows earlier chunks again (weight ``repeat_weight``)."""
    context_weight: float = 0.05
    repeat_weight: float = 0.8
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 30
    eval_every: int = 50
    max_minutes: float = 45.0
    """Budget in CPU minutes of this process (``time.process_time``: a paused or starved run
    keeps its schedule); the length ramp and the learning rate follow it."""
    max_wall_minutes: float = 90.0
    """Hard stop in wall-clock minutes (deadlines), whatever the schedule says."""
    checkpoint_minutes: float = 8.0


class CopySet:
    """One split's chunks (training or held-out modules) and synthetic sequences built on them."""

    def __init__(self, renderer: grounded.Renderer, *, held_out: bool, config: CopyConfig) -> None:
        def keep(chunk: Chunk) -> bool:
            return grounded.is_held_out(grounded.top_module(chunk.source)) == held_out

        self.tokenizer = renderer.tokenizer
        self.config = config
        self.targets = [t for t in renderer.targets() if keep(t[0])]
        self.chunks = [c for c in renderer.chunks if keep(c) and len(c.text) < 1500]
        self.by_module: dict[str, list[Chunk]] = {}
        for chunk in self.chunks:
            self.by_module.setdefault(grounded.top_module(chunk.source), []).append(chunk)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def sequence(self, rng: random.Random, length: int) -> tuple[list[int], list[float]]:
        """(ids, per-token loss weights) of one sequence of at most ``length`` tokens."""
        asked = rng.sample(self.targets, k=self.config.questions)
        tail = self.questions(rng, asked)
        tail_len = sum(len(self.encode(text)) for text, _ in tail)
        shown = [chunk for chunk, _ in asked]
        budget = length - tail_len - 2 * len(shown) * 8
        budget -= sum(len(self.encode(grounded.demo.format_chunks([c]))) for c in shown)
        budget = int(budget * (1 - self.config.reshow_fraction))
        while budget > 0:
            chunk = self.distractor(rng, rng.choice(shown))
            budget -= len(self.encode(grounded.demo.format_chunks([chunk]))) + 2
            if budget > 0:
                shown.append(chunk)
        rng.shuffle(shown)
        pieces = self.results(rng, shown) + self.reshown(rng, shown, length) + tail
        ids: list[int] = []
        weights: list[float] = []
        for text, weight in pieces:
            encoded = self.encode(text)
            ids += encoded
            weights += [weight] * len(encoded)
        return ids, weights

    def reshown(self, rng: random.Random, shown: list[Chunk], length: int) -> list[Piece]:
        """Some shown chunks again, verbatim and in a new order: dense copy targets."""
        again = rng.sample(shown, k=len(shown))
        text = grounded.demo.format_chunks(again)
        keep = text[: int(self.config.reshow_fraction * length * CHARS_PER_TOKEN)]
        return [(tool_result(keep), self.config.repeat_weight)] if keep else []

    def distractor(self, rng: random.Random, near: Chunk) -> Chunk:
        """A chunk from ``near``'s top-level module (``sibling_chance``) or from anywhere."""
        siblings = self.by_module.get(grounded.top_module(near.source), [])
        if siblings and rng.random() < self.config.sibling_chance:
            return rng.choice(siblings)
        return rng.choice(self.chunks)

    def results(self, rng: random.Random, shown: list[Chunk]) -> list[Piece]:
        """The chunks as 1-4 tool results, each wrapped as the demo's chat template wraps it."""
        cuts = sorted(rng.sample(range(1, len(shown)), k=min(3, len(shown) - 1)))
        groups = [shown[a:b] for a, b in zip([0, *cuts], [*cuts, len(shown)], strict=True)]
        weight = self.config.context_weight
        return [(tool_result(grounded.demo.format_chunks(group)), weight) for group in groups]

    def questions(self, rng: random.Random, asked: list[Target]) -> list[Piece]:
        """Question turns (some after a repeat of the chunk) each followed by its answer."""
        weight = self.config.context_weight
        pieces: list[Piece] = []
        for chunk, answer in asked:
            question = grounded.question_for(chunk.source, rng)
            pieces.append((f"{grounded.TURN_START}{question}<|im_end|>\n", weight))
            if rng.random() < self.config.repeat_chance:
                # NOTE: the header (the name) is the cue; what follows it is a copy.
                name, rest = chunk.text.split("\n", 1)
                pieces.append((f"{grounded.TURN_START}<tool_response>\n{name}", weight))
                copied = f"\n{rest}\n</tool_response><|im_end|>\n"
                pieces.append((copied, self.config.repeat_weight))
            pieces.append(("<|im_start|>assistant\n", weight))
            pieces.append((answer + "<|im_end|>\n", 1.0))
        return pieces


def tool_result(text: str) -> str:
    """A tool result turn as the tiny chat template renders it."""
    return f"{grounded.TURN_START}<tool_response>\n{text}\n</tool_response><|im_end|>\n"


def batch_tensors(
    rows: list[tuple[list[int], list[float]]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids ``[b, n]``, attention mask ``[b, n]``, next-token loss weights ``[b, n - 1]``)."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [b, n]; pad id 0
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # [b, n]
    weights = torch.zeros(len(rows), width - 1)  # [b, n - 1]
    for row, (ids, row_weights) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        weights[row, : len(ids) - 1] = torch.tensor(row_weights[1:])
    return input_ids, mask, weights


def weighted_loss(
    model: LlamaForCausalLM, rows: list[tuple[list[int], list[float]]], repeat_weight: float = -1
) -> tuple[torch.Tensor, float, float, float]:
    """(weighted loss, answer-token loss, answer-token and repeated-token argmax accuracy)."""
    ids, mask, weights = (tensor.to(model.device) for tensor in batch_tensors(rows))
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # [b, n-1, V]
    targets = ids[:, 1:]  # [b, n - 1]
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view_as(weights)  # [b, n - 1]
    answer = weights == 1.0
    hits = logits.argmax(-1) == targets  # [b, n - 1]
    repeated = weights == repeat_weight
    count = max(1, int(answer.sum()))
    return (
        (losses * weights).sum() / weights.sum(),
        float((losses.detach() * answer).sum()) / count,
        float((hits & answer).sum()) / count,
        float((hits & repeated).sum()) / max(1, int(repeated.sum())),
    )


def random_repeats(generator: torch.Generator, config: CopyConfig) -> torch.Tensor:
    """``[random_rows, random_len]`` ids: per row a random segment of 8 to ``random_len / 3``
    tokens, repeated; only the repeats are predictable, and only by copying."""
    rows = []
    for _ in range(config.random_rows):
        segment_len = int(torch.randint(8, config.random_len // 3 + 1, (1,), generator=generator))
        segment = torch.randint(FIRST_PLAIN_ID, VOCAB_SIZE, (segment_len,), generator=generator)
        rows.append(segment.repeat(config.random_len // segment_len + 1)[: config.random_len])
    return torch.stack(rows)  # [rows, random_len]


def induction_loss(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(mean loss on the tokens after each row's first segment, their argmax accuracy)."""
    ids = ids.to(model.device)
    logits = model(input_ids=ids).logits[:, :-1].float()  # [rows, n - 1, V]
    targets = ids[:, 1:]  # [rows, n - 1]
    first = targets == ids[:, :1]  # NOTE: the segment restarts where its first token recurs.
    seen = torch.cumsum(first.long(), dim=1) > 0  # [rows, n - 1]: inside a repeat
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view_as(targets)
    hits = (logits.argmax(-1) == targets) & seen
    return (losses * seen).sum() / seen.sum(), float(hits.sum()) / max(1, int(seen.sum()))


def lr_at(step: int, elapsed: float, config: CopyConfig) -> float:
    """Linear warm-up over steps, then cosine decay to ``min_lr`` over the time budget."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, elapsed / (60 * config.max_minutes))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def copy_probe(
    model: LlamaForCausalLM,
    synthetic: list[tuple[list[int], list[float]]],
    demo_rows: list[tuple[list[int], list[float]]],
) -> dict[str, float]:
    """Teacher-forced answer loss and token accuracy on held-out synthetic and demo prompts."""
    model.eval()
    figures: dict[str, float] = {}
    for name, rows in (("synthetic", synthetic), ("demo", demo_rows)):
        losses, accuracies = zip(*(weighted_loss(model, [row])[1:3] for row in rows), strict=True)
        figures[f"{name}_answer_loss"] = sum(losses) / len(losses)
        figures[f"{name}_answer_acc"] = sum(accuracies) / len(accuracies)
    model.train()
    return figures


def demo_rows(renderer: grounded.Renderer, count: int) -> list[tuple[list[int], list[float]]]:
    """Held-out demo prompts with their answers: weight 1 on the answer, 0 elsewhere."""
    rows = []
    for example in grounded.make_examples(renderer, True, count, seed=grounded.SEED + 7):
        prompt = list(renderer.tokenizer(example.prompt, add_special_tokens=False)["input_ids"])
        answer = list(
            renderer.tokenizer(example.answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        )
        rows.append((prompt + answer, [0.0] * len(prompt) + [1.0] * len(answer)))
    return rows


def train_copy(
    model: LlamaForCausalLM, renderer: grounded.Renderer, config: CopyConfig, out: Path
) -> list[dict[str, float]]:
    """Stage-0 training within ``config.max_minutes``; returns the probe curve."""
    train_set = CopySet(renderer, held_out=False, config=config)
    probe_rng = random.Random(grounded.SEED + 5)
    held = CopySet(renderer, held_out=True, config=config)
    synthetic = [held.sequence(probe_rng, 2048) for _ in range(6)]
    real = demo_rows(renderer, 6)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    rng = random.Random(grounded.SEED)
    curve: list[dict[str, float]] = []
    started, wall, saved = time.process_time(), time.perf_counter(), time.perf_counter()
    step, smooth, length = 0, [math.nan] * 5, config.min_len
    generator = torch.Generator().manual_seed(grounded.SEED)
    model.train()
    while (elapsed := time.process_time() - started) < 60 * config.max_minutes:
        if time.perf_counter() - wall > 60 * config.max_wall_minutes:
            break
        if step % config.eval_every == 0:
            curve.append({"step": step, "seconds": elapsed, **copy_probe(model, synthetic, real)})
            print(json.dumps(curve[-1]), flush=True)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, elapsed, config)
        optimizer.zero_grad(set_to_none=True)
        loss, answer_loss, accuracy, copied = torch.zeros(()), math.nan, math.nan, math.nan
        if config.tokens_per_step > 0:
            rows = [train_set.sequence(rng, length)]
            while sum(len(ids) for ids, _ in rows) < config.tokens_per_step - length // 2:
                rows.append(train_set.sequence(rng, length))
            loss, answer_loss, accuracy, copied = weighted_loss(model, rows, config.repeat_weight)
        random_loss, random_acc = induction_loss(model, random_repeats(generator, config))
        (loss + random_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        new = (answer_loss, accuracy, copied, random_acc, random_loss.item())
        smooth = [grounded.ema(a, b) for a, b in zip(smooth, new, strict=True)]
        if smooth[2] > config.ramp_gate:
            length = min(config.max_len, length + config.ramp_tokens)
        if step % 10 == 0:
            print(
                f"step {step} len {length} answer_loss {smooth[0]:.3f} acc {smooth[1]:.3f} "
                f"repeat_acc {smooth[2]:.3f} random_acc {smooth[3]:.3f} "
                f"random_loss {smooth[4]:.3f} cpu {elapsed:.0f}s "
                f"wall {time.perf_counter() - wall:.0f}s",
                flush=True,
            )
        if time.perf_counter() - saved > 60 * config.checkpoint_minutes:
            save(model, renderer.tokenizer, out / "checkpoint", {"step": step, "curve": curve})
            saved = time.perf_counter()
        step += 1
    curve.append(
        {
            "step": step,
            "seconds": time.process_time() - started,
            **copy_probe(model, synthetic, real),
        }
    )
    print(json.dumps(curve[-1]), flush=True)
    model.eval()
    return curve


def save(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    out: Path,
    record: dict[str, object],
) -> None:
    """Float16 weights (from a copy: the training model stays float32) and the run record."""
    grounded.copy_model_files(Path(str(model.name_or_path)), out)  # NOTE: the base's directory
    train_tiny.save_model(copy.deepcopy(model), tokenizer, out)
    (out / "copy_stats.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Stage 0 from ``--base`` into ``--out`` (weights, tokenizer, copy_stats.json)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, default=train_tiny.DEFAULT_OUT)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-minutes", type=float, default=CopyConfig().max_minutes)
    parser.add_argument("--max-wall-minutes", type=float, default=CopyConfig().max_wall_minutes)
    parser.add_argument("--lr", type=float, default=CopyConfig().lr)
    parser.add_argument("--max-len", type=int, default=CopyConfig().max_len)
    parser.add_argument("--tokens-per-step", type=int, default=CopyConfig().tokens_per_step)
    parser.add_argument("--random-rows", type=int, default=CopyConfig().random_rows)
    parser.add_argument("--random-len", type=int, default=CopyConfig().random_len)
    parser.add_argument("--eval-every", type=int, default=CopyConfig().eval_every)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = CopyConfig(
        max_minutes=args.max_minutes,
        max_wall_minutes=args.max_wall_minutes,
        lr=args.lr,
        max_len=args.max_len,
        tokens_per_step=args.tokens_per_step,
        random_rows=args.random_rows,
        random_len=args.random_len,
        eval_every=args.eval_every,
    )
    renderer = grounded.Renderer(grounded.corpus(), train_tiny.load_tokenizer(args.base))
    model = grounded.load(args.base).to(args.device)
    torch.manual_seed(grounded.SEED)
    started = time.perf_counter()
    curve = train_copy(model, renderer, config, args.out)
    record = {
        "command": " ".join(sys.argv),
        "seed": grounded.SEED,
        "copy_config": asdict(config),
        "wall_seconds": time.perf_counter() - started,
        "curve": curve,
    }
    save(model, renderer.tokenizer, args.out, record)


if __name__ == "__main__":
    main()
