"""Fine-tune the bundled ``tiny`` model under exact chunk-reuse's block attention mask (issue 17).

Exact mode (``runtime/chunks/assembler.py``) reuses each document's KV computed alone; it equals a
full prefill under ``runtime.chunks.assembler.block_attention_mask``: a token inside a document span
attends only to earlier tokens of its own span, every other token to everything before it. A
model trained only causally loses quality under that mask. This script fine-tunes ``tiny`` from
its shipped weights on ``scripts/train_tiny.py``'s training windows, each cut into seeded random
document spans at the start (2-5 spans of 24-64 tokens) followed by a free tail of at least 48
tokens (where a question and answer go), loss on all tokens. ``--mask causal`` is the control:
the same steps and data with the ordinary causal mask. Evaluation uses train_tiny's held-out
validation windows cut into spans the same seeded way. Never imported at run time; downloads
nothing. Figures, and why no ``tiny-block`` model ships: ``docs/training/block_attention.json``,
from

    python scripts/train_block.py --eval-only --threads 1 --stats base.json
    python scripts/train_block.py --mask block --threads 1 --out /tmp/block --stats block.json
    python scripts/train_block.py --mask causal --threads 1 --out /tmp/causal --stats causal.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.chunks.assembler import block_attention_mask  # noqa: E402
from scripts import train_tiny  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
BASE = REPO_ROOT / "runtime" / "models" / "tiny"
SEED = 4321
MIN_TAIL = 48
Mask = Literal["block", "causal"]
Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class BlockConfig:
    """Hyper-parameters of one fine-tune; every value is recorded in the stats json."""

    mask: Mask = "block"
    num_steps: int = 120
    batch_size: int = 8
    seq_len: int = train_tiny.SEQ_LEN
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 6
    weight_decay: float = 0.1
    min_spans: int = 2
    max_spans: int = 5
    min_span_len: int = 24
    max_span_len: int = 64
    min_tail: int = MIN_TAIL
    max_minutes: float = 15.0
    seed: int = SEED


def random_spans(rng: random.Random, config: BlockConfig) -> tuple[Span, ...]:
    """Seeded document spans ``[start, end)`` laid end to end from 0, leaving >= min_tail free."""
    while True:
        count = rng.randint(config.min_spans, config.max_spans)
        lengths = [rng.randint(config.min_span_len, config.max_span_len) for _ in range(count)]
        if sum(lengths) <= config.seq_len - config.min_tail:
            break
    spans, start = [], 0
    for length in lengths:
        spans.append((start, start + length))
        start += length
    return tuple(spans)


def batch_mask(spans_list: list[tuple[Span, ...]], length: int, mask: Mask) -> torch.Tensor:
    """``[b, 1, length, length]`` bool mask (True = may attend), block or plain causal."""
    rows = [block_attention_mask(length, spans if mask == "block" else ()) for spans in spans_list]
    return torch.stack(rows).unsqueeze(1)


def token_losses(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """``[b, length-1]`` next-token cross-entropy of ``ids`` ``[b, length]`` under ``attn``."""
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
    )


def lr_at(step: int, config: BlockConfig) -> float:
    """Linear warm-up, then cosine decay from ``lr`` to ``min_lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.num_steps - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def train(model: LlamaForCausalLM, train_ids: torch.Tensor, config: BlockConfig) -> dict[str, Any]:
    """Run the step budget (or stop at ``max_minutes``); data and spans do not depend on mask."""
    generator = torch.Generator().manual_seed(config.seed)
    rng = random.Random(config.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay}],
        lr=config.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    smoothed, started, steps_done = float("nan"), time.perf_counter(), 0
    model.train()
    for step in range(config.num_steps):
        if time.perf_counter() - started > config.max_minutes * 60:
            print(f"stopping at step {step}: --max-minutes reached", flush=True)
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        starts = torch.randint(
            0, train_ids.numel() - config.seq_len, (config.batch_size,), generator=generator
        )
        batch = torch.stack([train_ids[s : s + config.seq_len] for s in starts.tolist()])
        spans = [random_spans(rng, config) for _ in range(config.batch_size)]
        loss = token_losses(model, batch, batch_mask(spans, config.seq_len, config.mask)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps_done = step + 1
        smoothed = loss.item() if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * loss.item()
        if step % 25 == 0 or step == config.num_steps - 1:
            elapsed = time.perf_counter() - started
            print(f"step {step:4d}  loss {smoothed:.4f}  {elapsed:6.0f}s", flush=True)
    return {
        "steps_done": steps_done,
        "train_loss": smoothed,
        "wall_seconds": time.perf_counter() - started,
    }


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, config: BlockConfig) -> dict[str, Any]:
    """Mean held-out loss on all predicted tokens and on tail tokens, under each mask.

    Tail tokens: predictions of tokens after the last span (the free part that attends to all).
    Spans come from ``random.Random(config.seed + 1)``, so every model sees the same cut.
    """
    model.eval()
    rng = random.Random(config.seed + 1)
    spans = [random_spans(rng, config) for _ in range(windows.shape[0])]
    tail = torch.zeros(windows.shape[0], windows.shape[1] - 1, dtype=torch.bool)
    for row, window_spans in enumerate(spans):
        tail[row, window_spans[-1][1] - 1 :] = True  # NOTE: loss index i predicts token i+1
    result: dict[str, Any] = {"windows": int(windows.shape[0])}
    for mask in ("block", "causal"):
        losses = []
        for start in range(0, windows.shape[0], 16):
            batch = windows[start : start + 16]
            attn = batch_mask(spans[start : start + 16], windows.shape[1], mask)
            losses.append(token_losses(model, batch, attn))
        loss = torch.cat(losses)
        result[f"{mask}_all"] = loss.mean().item()
        result[f"{mask}_tail"] = loss[tail].mean().item()
    result["tail_tokens"] = int(tail.sum())
    return result


def load(folder: Path) -> LlamaForCausalLM:
    """Load a model folder in float32."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM), "tiny is a Llama"
    return model


def main(argv: list[str] | None = None) -> None:
    """Fine-tune (or, with --eval-only, only evaluate) and write the stats json."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mask", choices=["block", "causal"], default="block")
    parser.add_argument("--steps", type=int, default=BlockConfig().num_steps)
    parser.add_argument("--lr", type=float, default=BlockConfig().lr, help="peak learning rate")
    parser.add_argument("--max-minutes", type=float, default=BlockConfig().max_minutes)
    parser.add_argument("--base", type=Path, default=BASE)
    parser.add_argument("--out", type=Path, help="folder for the fine-tuned model")
    parser.add_argument("--eval-only", action="store_true", help="evaluate --base only")
    parser.add_argument("--stats", type=Path, required=True, help="stats json to write")
    parser.add_argument("--max-windows", type=int, default=64, help="validation windows")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    config = BlockConfig(
        mask=args.mask,
        num_steps=args.steps,
        lr=args.lr,
        min_lr=args.lr / 10,
        max_minutes=args.max_minutes,
    )
    windows = train_tiny.validation_windows(args.base, max_windows=args.max_windows)
    model = load(args.base)
    stats: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "base": str(args.base.relative_to(REPO_ROOT) if args.base.is_absolute() else args.base),
        "config": asdict(config),
        "threads": args.threads,
        "val_sha256": train_tiny.fingerprint(windows),
    }
    if not args.eval_only:
        assert args.out is not None, "--out is required unless --eval-only"
        tokenizer = train_tiny.load_tokenizer(args.base)
        records = train_tiny.collect_records("train")
        texts = train_tiny.split_texts(records, tokenizer, seed=train_tiny.SEED)
        train_ids = train_tiny.encode_stream(tokenizer, texts)
        stats["train"] = train(model, train_ids, config)
        args.out.mkdir(parents=True, exist_ok=True)
        train_tiny.save_model(model, tokenizer, args.out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(args.base / name, args.out / name)
        model = load(args.out)  # NOTE: evaluate the float16 weights as shipped
        stats["safetensors_bytes"] = (args.out / "model.safetensors").stat().st_size
    stats["eval"] = evaluate(model, windows, config)
    args.stats.parent.mkdir(parents=True, exist_ok=True)
    args.stats.write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    print(json.dumps(stats["eval"], indent=2))


if __name__ == "__main__":
    main()
