"""The bundled ``tiny`` model under a chat template that knows no tools (SmolLM2's shape)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from runtime.models import resolve_model

PLAIN_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2's template without its default system line: no tools, no tool turns."""


def plain_tiny(parent: Path) -> Path:
    """A copy of ``tiny`` under ``parent`` whose chat template is ``PLAIN_CHATML``."""
    folder = parent / "tiny"
    shutil.copytree(resolve_model("tiny"), folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["chat_template"] = PLAIN_CHATML
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder
