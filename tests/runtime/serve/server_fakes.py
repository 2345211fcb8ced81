"""A scripted stand-in for ``runtime.Engine`` so server tests run without a model.

Characters are tokens; the output is a fixed list of text pieces; ``cached_tokens`` is the longest
common prefix with an earlier prompt of the same ``cache_salt`` (so tenant isolation is visible).
It counts open streams, the fake's equivalent of pinned blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from runtime.exceptions import EngineBusyError, InvalidRequestError, PromptTooLongError
from runtime.outputs import CacheStats, Completion, FinishReason, Metrics, StreamDelta, Usage
from runtime.request.spec import RequestSpec
from runtime.sampling.grammar import Grammar, GrammarSpec
from runtime.sampling.params import SamplingParams
from runtime.scheduler.config import SchedulerStats

HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %} ... <tool_call> ..."


def _token(item: object) -> int:
    """One prompt item of a spec the server submits: token ids (it renders chat messages)."""
    assert isinstance(item, int), f"expected a token id, got {item!r}"
    return item


class CharTokenizer:
    """One token per character (code point), with a Hermes-style template marker."""

    chat_template = HERMES_TEMPLATE

    def __len__(self) -> int:
        return 0x110000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)  # NOTE: no special tokens

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]


class ScriptedEngine:
    """Streams ``script`` pieces (one per token) for every request."""

    model_id = "fake-model"
    vocab_size = 0x110000

    def __init__(
        self,
        script: list[str] | None = None,
        *,
        max_context_len: int = 400,
        step_s: float = 0.0,
        fail_at: int | None = None,
        engine_limit: int | None = None,
        max_open: int | None = None,
    ) -> None:
        """``fail_at``: raise RuntimeError before that piece (0 = when the stream opens).

        ``engine_limit``: positions ``stream`` accepts (default ``max_context_len``); lower, it
        stands for limits the server cannot see (the real engine's batch KV budget).
        ``max_open``: with that many streams open, ``stream`` raises ``EngineBusyError`` (the
        real engine's full scheduler queue).
        """
        self.max_open = max_open
        self.script = script if script is not None else ["Hello", ",", " world", "!"]
        self.max_context_len = max_context_len
        self.engine_limit = max_context_len if engine_limit is None else engine_limit
        self.step_s = step_s
        self.fail_at = fail_at
        self.tokenizer = CharTokenizer()
        self.seen: list[tuple[str | None, list[int]]] = []
        self.salts: list[str | None] = []
        self.params: list[SamplingParams] = []
        self.grammars: list[Grammar | None] = []
        self.num_open = 0
        self.num_closed_early = 0
        self._lock = threading.Lock()
        self._queried = 0
        self._hits = 0
        self._computed = 0
        self._generated = 0

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        if any("RAISE" in str(m.get("content")) for m in messages):
            raise InvalidRequestError("template rejects RAISE")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        text = f"tools={tools!r}" + text if tools else text
        return self.tokenizer.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Iterator[StreamDelta]:
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # NOTE: the checks runtime.Engine makes at its edge (the server relies on them).
        if not ids:
            raise InvalidRequestError("prompt is empty; give at least one token")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids are outside [0, {self.vocab_size})")
        if len(ids) >= self.max_context_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_context_len}"
            )
        if len(ids) + params.max_tokens > self.engine_limit:
            raise PromptTooLongError(f"{len(ids)} + {params.max_tokens} > {self.engine_limit}")
        if self.fail_at == 0:
            raise RuntimeError("engine exploded")
        if self.max_open is not None and self.num_open >= self.max_open:
            raise EngineBusyError(f"engine busy: {self.num_open} streams open")
        self.salts.append(cache_salt)
        self.params.append(params)
        return self._run(ids, params, cache_salt)

    def submit(self, spec: RequestSpec) -> list[Iterator[StreamDelta]]:
        """``n`` scripted streams of one prompt (a grammar is recorded; the script ignores it)."""
        self.grammars.append(spec.grammar)
        prompt = spec.prompt if isinstance(spec.prompt, str) else [_token(t) for t in spec.prompt]
        return [self.stream(prompt, spec.params, cache_salt=spec.cache_salt) for _ in range(spec.n)]

    def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """A placeholder holding ``spec`` (never matched: the fake does not decode)."""
        return Grammar(spec, vocab_size=0)

    def _cached_len(self, ids: list[int], salt: str | None) -> int:
        best = 0
        for other_salt, other in self.seen:
            if other_salt != salt:
                continue
            n = 0
            while n < min(len(ids), len(other)) - 1 and ids[n] == other[n]:
                n += 1
            best = max(best, n)
        return best

    def _run(
        self, ids: list[int], params: SamplingParams, salt: str | None
    ) -> Iterator[StreamDelta]:
        t0 = time.perf_counter()
        with self._lock:
            self.num_open += 1
            cached = self._cached_len(ids, salt)
            self.seen.append((salt, ids))
            self._queried += len(ids)
            self._hits += cached
            self._computed += len(ids) - cached
        finished = False
        try:
            pieces = self.script[: params.max_tokens]
            for i, piece in enumerate(pieces[:-1]):
                time.sleep(self.step_s)
                if i == self.fail_at:
                    raise RuntimeError("engine exploded mid-stream")
                with self._lock:
                    self._generated += 1
                yield StreamDelta([i], piece)
            reason: FinishReason = "length" if len(self.script) > params.max_tokens else "stop"
            completion = Completion(
                token_ids=list(range(len(pieces))),
                text="".join(pieces),
                finish_reason=reason,
                usage=Usage(len(ids), cached, len(pieces)),
                metrics=Metrics(time.perf_counter() - t0, 100.0, len(ids) - cached),
            )
            finished = True
            with self._lock:
                self._generated += 1
            yield StreamDelta([len(pieces) - 1], pieces[-1], reason, completion)
        finally:
            with self._lock:
                self.num_open -= 1
                self.num_closed_early += 0 if finished else 1

    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(self.num_open, 0, 0, 0, 1, self._computed, self._generated)

    def flush_cache(self, *, include_disk: bool = False) -> int:
        with self._lock:
            num_freed, self.seen = len(self.seen), []
        return num_freed

    def flush_namespace(self, cache_salt: str | None) -> int:
        with self._lock:
            kept = [(salt, ids) for salt, ids in self.seen if salt != cache_salt]
            num_freed, self.seen = len(self.seen) - len(kept), kept
        return num_freed

    def cache_stats(self) -> CacheStats:
        return CacheStats(
            queried_tokens=self._queried,
            hit_tokens=self._hits,
            bytes_used=0,
            bytes_total=1024,
            num_blocks_used=0,
            num_blocks_total=8,
            num_evictions=0,
            is_enabled=True,
            disabled_reason=None,
        )
