"""scripts/train_copy.py's induction rows: a repeated random segment, scored on the repeats only.

A stub model that predicts the true next token on one side of the first repeat and a wrong token
on the other shows exactly which positions ``induction_loss`` counts.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from tests.script_module import load_module

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_copy.py"


def load_script() -> ModuleType:
    """Import scripts/train_copy.py (not a package) under a private module name."""
    return load_module(SCRIPT, "_train_copy")


def segment_len(row: torch.Tensor) -> int:
    """Where the row's first token recurs (random ids: the segment's length)."""
    return int((row[1:] == row[0]).nonzero()[0]) + 1


class StubModel:
    """Logits favouring the true next token only where ``right(t, segment)`` holds."""

    device = torch.device("cpu")

    def __init__(self, right: str) -> None:
        self.right = right

    def __call__(self, input_ids: torch.Tensor) -> SimpleNamespace:
        rows, width = input_ids.shape
        logits = torch.zeros(rows, width, 4096)  # [rows, n, V]
        for row in range(rows):
            seg = segment_len(input_ids[row])
            for t in range(width - 1):
                in_repeat = t + 1 >= seg
                target = int(input_ids[row, t + 1])
                wrong = 7 if target != 7 else 8
                good = in_repeat if self.right == "repeats" else not in_repeat
                logits[row, t, target if good else wrong] = 50.0
        return SimpleNamespace(logits=logits)


def test_random_rows_repeat_one_segment() -> None:
    script = load_script()
    config = script.CopyConfig(random_rows=6, random_len=64)
    ids = script.random_repeats(torch.Generator().manual_seed(0), config)
    assert ids.shape == (6, 64)
    assert int(ids.min()) >= script.FIRST_PLAIN_ID
    for row in ids:
        seg = segment_len(row)
        assert 8 <= seg <= 64 // 3
        assert torch.equal(row[seg:], row[: 64 - seg])


def test_induction_loss_counts_the_repeats_and_nothing_else() -> None:
    script = load_script()
    config = script.CopyConfig(random_rows=4, random_len=48)
    ids = script.random_repeats(torch.Generator().manual_seed(1), config)
    loss, accuracy = script.induction_loss(StubModel("repeats"), ids)
    assert accuracy == 1.0 and float(loss) < 1e-6
    loss, accuracy = script.induction_loss(StubModel("first segment"), ids)
    assert accuracy == 0.0 and math.isclose(float(loss), 50.0, rel_tol=1e-4)
