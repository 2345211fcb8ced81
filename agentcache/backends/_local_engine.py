"""The local backend's side of the runtime: importing it, checking a model name before torch
loads, the engine's config from the backend's keywords, ChatML stops and document spans.

``agentcache.backends.local`` uses these; nothing here holds conversation state.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from agentcache.exceptions import BackendUnavailableError, ConfigError

if TYPE_CHECKING:
    from runtime.config import EngineConfig

__all__ = [
    "CHATML_STOPS",
    "MARKUP_STOPS",
    "check_model_name",
    "document_spans",
    "engine_config",
    "import_runtime",
    "quiet_loading",
    "turn_stops",
    "unloadable",
]

_HINT = "install the local runtime: pip install 'agentcache[local]'"
_KEYWORD_DEFAULTS: dict[str, Any] = {"prefix_cache": True, "dtype": "float32",
                                     "weights": "float32", "kv_dtype": "auto",
                                     "device": "cpu"}  # fmt: skip
"""LocalBackend's engine keywords whose defaults are not None (all others default to None)."""
CHATML_STOPS: tuple[str, ...] = ("<|im_start|>", "<tool_response>", "</tool_response>")
"""End-of-answer markers for ChatML templates: a model that starts a new turn (``<|im_start|>``)
or writes a tool result itself (the Hermes ``<tool_response>`` block) has finished its answer;
what follows would be invented conversation, not answer text."""
MARKUP_STOPS: tuple[str, ...] = ("</document>", "<document ", "</documents>", "<documents>")
"""The prompt's own document markup (``templates/documents.jinja``): a model that writes it has
stopped answering and started copying the prompt (SmolLM2-135M closed answers with
``</document>``); the engine holds a possible marker back, so none of it reaches the answer."""


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Hide transformers' weight-loading progress bar while a model loads, then restore it."""
    hf_logging: Any = importlib.import_module("transformers.utils.logging")

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def turn_stops(tokenizer: Any) -> tuple[list[str], list[int]]:
    """Stop strings and ids ending an answer for ChatML templates (none for other templates).

    ``<|im_start|>`` is also a stop id when it is one token: special tokens are dropped from the
    decoded text, so only the id can catch it.
    """
    if "<|im_start|>" not in str(getattr(tokenizer, "chat_template", None) or ""):
        return [], []
    ids = list(tokenizer.encode("<|im_start|>", add_special_tokens=False))
    return list(CHATML_STOPS), ids if len(ids) == 1 else []


def check_model_name(model: str) -> None:
    """Fail fast on a local model name that cannot load: microseconds, no torch, no network.

    The rule is the runtime's (``runtime.model.names``, also used by ``agentcache serve``):
    a bundled short name, an existing folder, or a hub id ``owner/name``.

    Raises:
        ConfigError: Anything else; the message lists the bundled models (and the closest one).
    """
    why = unloadable(model)
    if why is not None:
        raise ConfigError(why)


def unloadable(model: str) -> str | None:
    """Why ``model`` cannot name a loadable model (the runtime's message), or None when it can."""
    # NOTE: imports neither torch nor transformers.
    from runtime.exceptions import ModelLoadError
    from runtime.model.names import check_model_name as check

    try:
        check(model)
    except ModelLoadError as exc:
        return str(exc)
    return None


def document_spans(
    ids: Sequence[int], documents: Sequence[Sequence[int]]
) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` spans of each document's token ids in ``ids``, in order, disjoint.

    A document is looked for after the previous one found; when its whole token sequence is not
    there (its first or last token merged with the surrounding text), its interior (all but the
    edge tokens) is looked for instead. Documents not found, and spans reaching the last prompt
    token (which is always computed), are left out.
    """
    spans: list[tuple[int, int]] = []
    pos = 0
    for doc in documents:
        for needle in (list(doc), list(doc[1:-1]) if len(doc) > 2 else []):
            at = _find(ids, needle, pos) if needle else -1
            if at >= 0 and at + len(needle) < len(ids):
                spans.append((at, at + len(needle)))
                pos = at + len(needle)
                break
    return tuple(spans)


def _find(ids: Sequence[int], needle: list[int], start: int) -> int:
    """First index ``>= start`` where ``needle`` occurs in ``ids``, or -1."""
    first, n = needle[0], len(needle)
    for i in range(start, len(ids) - n + 1):
        if ids[i] == first and list(ids[i : i + n]) == needle:
            return i
    return -1


def import_runtime() -> ModuleType:
    """The ``runtime`` package with the names this backend uses loaded (torch with them).

    NOTE: ``import runtime`` alone needs no torch (its names load lazily), so the names are
    touched here: a missing torch is then this hint, not a ModuleNotFoundError at first use.
    """
    try:
        runtime = importlib.import_module("runtime")
        for name in ("ChunkReuse", "Engine", "SamplingParams"):
            getattr(runtime, name)
        return runtime
    except ImportError as exc:  # torch/transformers missing
        raise BackendUnavailableError(
            f"the local runtime cannot be imported ({exc}); {_HINT}"
        ) from exc


def engine_config(config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    """``config``, or the ``EngineConfig`` of LocalBackend's engine keywords (None: unset).

    Raises:
        ConfigError: ``EngineConfig`` refuses a value, or ``config`` comes with keywords.
    """
    from runtime.config import EngineConfig  # NOTE: plain data, no torch

    given = {k: v for k, v in options.items() if v is not None}
    if config is not None:
        extra = sorted(k for k, v in given.items() if _KEYWORD_DEFAULTS.get(k, ...) != v)
        if extra:
            raise ConfigError(f"give engine options either in config or as keywords, not both: "
                              f"{extra} set beside config")  # fmt: skip
        return config
    try:
        return EngineConfig(**given)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
