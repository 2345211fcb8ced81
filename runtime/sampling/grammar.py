"""Grammar-constrained decoding: compile JSON schemas / structural tags once, mask logits per row.

``GrammarCompiler`` (one per engine, built lazily from its tokenizer) turns a ``GrammarSpec`` into
an immutable ``Grammar``; each sequence gets its own ``GrammarMatcher``, a logits processor
(``runtime.sampling.sampler.LogitsProcessor``) that masks its row and advances on its tokens. The
grammar engine is xgrammar (CPU, Hugging Face tokenizers), imported only when a constrained request
arrives. It knows nothing about HTTP, chat templates, the prefix cache or the batch.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.exceptions import InvalidRequestError, RuntimeEngineError

__all__ = [
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "JsonSchemaSpec",
    "StructuralTagSpec",
]


class GrammarError(RuntimeEngineError):
    """A constrained row cannot go on (the sampled token broke the grammar); it fails alone."""


@dataclass(frozen=True, slots=True)
class JsonSchemaSpec:
    """Output is one JSON value matching ``schema`` (compact: ``", "`` and ``": "`` separators).

    ``schema=None`` means any JSON object (OpenAI's ``json_object`` mode).
    """

    schema: str | None = None
    """The JSON Schema as JSON text (hashable, so compiled grammars are cached by spec)."""
    strict: bool = True
    """No properties or items beyond those the schema declares (OpenAI ``strict``)."""


@dataclass(frozen=True, slots=True)
class StructuralTagSpec:
    """An xgrammar structural tag (free text, tagged JSON sections, excluded strings) as JSON."""

    tag: str


GrammarSpec = JsonSchemaSpec | StructuralTagSpec


class Grammar:
    """A compiled grammar: immutable, shared by every row (and every ``n`` choice) that uses it."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self._compiled = compiled
        self.vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (one per generated sequence)."""
        import xgrammar as xgr

        return GrammarMatcher(xgr.GrammarMatcher(self._compiled), self.vocab_size)


class GrammarMatcher:
    """The grammar state of one sequence, as a ``runtime.sampling.sampler.LogitsProcessor``.

    Each call first advances past the tokens generated since the last call (the sampler calls it
    once per step with the whole output so far), then masks the row. Once the grammar accepted a
    stop token only that token stays allowed (it ends the request unless ``ignore_eos``). Not
    thread-safe; the scheduler loop is its only user.
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._matcher = matcher
        self._xgr = xgr
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self._num_accepted = 0
        self._last = -1

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> None:
        """Advance past new ``output_ids``, then set forbidden ids of ``logits`` to ``-inf``.

        Args:
            output_ids: every id generated so far by this sequence.
            logits: ``[vocab]`` float32 logits row, edited in place.

        Raises:
            GrammarError: a generated token is not allowed by the grammar (the row fails alone).
        """
        for token in output_ids[self._num_accepted :]:
            if not self._matcher.accept_token(token):
                raise GrammarError(f"token {token} does not continue the requested grammar")
            self._num_accepted += 1
            self._last = token
        if self._matcher.is_terminated():
            keep = logits[self._last].clone()
            logits.fill_(float("-inf"))
            logits[self._last] = keep
            return
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits.unsqueeze(0), self._bitmask.to(logits.device))


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe, caches compiled grammars by spec.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed ``len(tokenizer)``).
        stop_ids: token ids that end generation; the grammar allows them only where it may end.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, stop_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._cache: dict[GrammarSpec, Grammar] = {}
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of ``spec`` (cached; the first call also indexes the vocabulary).

        Raises:
            InvalidRequestError: the schema or structural tag is invalid or unsupported; the
                message is ``"<json_schema|json_object|structural_tag>: <reason>"``.
        """
        with self._lock:
            found = self._cache.get(spec)
            if found is not None:
                return found
            compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, spec)
        except (ValueError, RuntimeError, TypeError) as exc:
            raise InvalidRequestError(f"{_kind(spec)}: {_message(exc)}") from exc
        grammar = Grammar(compiled, self._vocab_size)
        with self._lock:
            if len(self._cache) >= _MAX_CACHED:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = grammar
        return grammar

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
            )
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


_MAX_CACHED = 256
"""Compiled grammars kept per engine (oldest dropped first)."""


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
"""xgrammar's C++ log prefix on its errors: ``[11:36:30] /project/cpp/file.cc:5082: ``."""


def _message(exc: Exception) -> str:
    """The reason alone, without xgrammar's timestamp and source location; lower-cased start."""
    text = _LOG_PREFIX.sub("", str(exc).strip())
    return text[:1].lower() + text[1:] if text else type(exc).__name__


def _kind(spec: GrammarSpec) -> str:
    if isinstance(spec, JsonSchemaSpec):
        return "json_schema" if spec.schema is not None else "json_object"
    return "structural_tag"


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if isinstance(spec, JsonSchemaSpec):
        schema = spec.schema if spec.schema is not None else '{"type": "object"}'
        # NOTE: compact separators, no free whitespace: an unbounded-whitespace grammar lets a
        # weak model loop on newlines until max_tokens (xgrammar warns about exactly that).
        return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=spec.strict)
    return compiler.compile_structural_tag(spec.tag)
