"""Engine: the public entry of the local runtime (generate, stream, chat rendering, cache control).

It owns the model runner, the prefix cache, the scheduler (whose loop thread batches every
running request) and one lock; ``stream`` submits a request and yields the deltas the loop posts.
It does not know HTTP or the SDK.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from runtime._detokenizer import Detokenizer
from runtime.cache.chunk_store import ChunkStore
from runtime.cache.disk_tier import DiskTier
from runtime.cache.kv_pool import KVPool
from runtime.cache.prefix_cache import PrefixCache, namespace_of
from runtime.chunk_reuse import ChunkAssembler, ChunkReuse, chunk_reuse_blocker
from runtime.exceptions import ChunkReuseError, InvalidRequestError, PromptTooLongError
from runtime.grammar import Grammar, GrammarCompiler, GrammarSpec
from runtime.model_runner import (
    ForwardPath,
    ModelRunner,
    load_model,
    reuse_blocker,
    weights_fingerprint,
)
from runtime.outputs import CacheStats, Completion, StreamDelta
from runtime.request import Request
from runtime.request_stream import RequestStream
from runtime.sampler import LogitsProcessor
from runtime.sampling import SEED_MAX, SEED_MIN, SamplingParams
from runtime.scheduler import Scheduler
from runtime.scheduler_config import SchedulerConfig, SchedulerStats

__all__ = [
    "DEFAULT_CHUNK_CACHE_BYTES",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_KV_DISK_BYTES",
    "Engine",
    "Prompt",
]

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30
"""Prefix cache budget when none is given: 1 GiB of KV blocks."""
DEFAULT_CHUNK_CACHE_BYTES = 256 << 20
"""Chunk store budget when none is given: 256 MiB (pages are touched only as chunks arrive)."""
DEFAULT_KV_DISK_BYTES = 8 << 30
"""Disk tier budget when ``kv_disk_dir`` is given without ``kv_disk_bytes``: 8 GiB of files."""

Prompt = str | Sequence[int] | list[dict[str, Any]]
"""Text (tokenized as is), token ids, or chat messages (rendered with the chat template)."""


class Engine:
    """A causal LM with continuous batching and an exact cross-request prefix cache.

    Thread-safe: ``generate``/``stream`` may run from many threads; one loop thread (started on
    the first request, stopped by ``close``) prefills and batch-decodes them.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_id: str,
        revision: str | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = 16,
        prefix_cache: bool = True,
        debug_integrity: bool = False,
        scheduler: SchedulerConfig | None = None,
        forward: ForwardPath = "auto",
        kv_disk_dir: str | os.PathLike[str] | None = None,
        kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES,
        chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES,
    ) -> None:
        """Wrap an already loaded model; prefer ``from_pretrained``.

        Raises:
            ValueError: for a non-positive block_size, negative kv_cache_bytes or kv_disk_bytes,
                or ``forward="compact"`` on a model outside the compact family.
            ModelLoadError: when the model exposes no usable per-layer KV cache.
            OSError: ``kv_disk_dir`` cannot be created or read.
        """
        if block_size < 1 or min(kv_cache_bytes, kv_disk_bytes, chunk_cache_bytes) < 0:
            raise ValueError(
                f"need block_size >= 1 and kv_cache_bytes, kv_disk_bytes, chunk_cache_bytes "
                f">= 0, got {block_size!r}, {kv_cache_bytes!r}, {kv_disk_bytes!r}, "
                f"{chunk_cache_bytes!r}"
            )
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        self.runner = ModelRunner(model, forward=forward)
        logger.info("forward path for %r: %s (%s)", model_id, self.runner.path,
                    self.runner.path_reason or "supported")  # fmt: skip
        self.max_context_len = _context_len(model.config, tokenizer)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        """Token ids the model can run: the rows of its input embedding. NOTE: the one vocabulary
        size of the engine and the server. A tokenizer may be shorter (the embedding padded to a
        multiple of 64/128: those ids decode to nothing) or longer (tokens added without a
        resize: those ids would index past the embedding and fail the whole batch step)."""
        self.eos_ids = _eos_ids(model, tokenizer)
        self.debug_integrity = debug_integrity
        self._dtype_name = str(self.runner.dtype).removeprefix("torch.")
        self._lock = threading.Lock()
        self.prefix_cache = self._make_prefix_cache(kv_cache_bytes, block_size, prefix_cache)
        if kv_disk_dir is not None and self.prefix_cache.is_enabled:
            self.prefix_cache.disk = self._make_disk_tier(kv_disk_dir, kv_disk_bytes)
        if self.runner.batch_blocker is not None:
            logger.warning("batch size 1 for %r: %s", model_id, self.runner.batch_blocker)
        self.chunk_store = ChunkStore(self._make_pool(chunk_cache_bytes, block_size))
        """Document chunks' KV for requests that ask for chunk reuse (``runtime.chunk_reuse``)."""
        self.scheduler = Scheduler(
            self.runner,
            self.prefix_cache,
            self._lock,
            scheduler or SchedulerConfig(),
            debug_integrity=debug_integrity,
            chunks=ChunkAssembler(self.runner, self.chunk_store),
        )
        self.grammars = GrammarCompiler(
            tokenizer, vocab_size=self.vocab_size, stop_ids=self.eos_ids
        )
        """Compiles ``GrammarSpec``s for constrained decoding (xgrammar loads on first use)."""
        # NOTE: holds the scheduler, not the engine, so an unreferenced engine is collected.
        self._finalizer = weakref.finalize(self, _shutdown, self.scheduler, self.prefix_cache.disk)

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        *,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = 16,
        prefix_cache: bool = True,
        dtype: str = "float32",
        device: str = "cpu",
        revision: str | None = None,
        scheduler: SchedulerConfig | None = None,
        forward: ForwardPath = "auto",
        kv_disk_dir: str | os.PathLike[str] | None = None,
        kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES,
        chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES,
    ) -> Engine:
        """Load a model and its tokenizer (local path, bundled name, or hub id).

        Args:
            model: local directory, name known to ``runtime.models.resolve_model``, or hub id.
            kv_cache_bytes: byte budget of the prefix cache's KV pool.
            block_size: tokens per cached block (prefixes are reused in whole blocks).
            prefix_cache: False = force-miss (same code path, no reuse).
            dtype: ``"float32" | "float16" | "bfloat16"``.
            device: torch device string.
            scheduler: batching, ordering and admission limits (defaults: ``SchedulerConfig()``).
            forward: ``"auto"`` (the compact Llama-family forward where it applies, else the
                model's own), ``"compact"`` or ``"transformers"`` (the reference); see
                ``forward_path``.
            kv_disk_dir: directory of the disk tier below the KV pool (None: no disk tier).
                Evicted blocks spill there and survive restarts; files are named by model,
                revision, dtype, tenant salt and a weights fingerprint, so another model or
                dtype never reuses them.
            kv_disk_bytes: byte budget of ``kv_disk_dir`` (block files, headers included).
            chunk_cache_bytes: byte budget of the chunk store (document chunks' KV, used only
                by requests with ``chunk_reuse``).

        Raises:
            ModelLoadError: the model or tokenizer cannot be loaded.
            ValueError, OSError: as ``Engine()``.
        """
        lm, tokenizer = load_model(str(model), dtype=dtype, device=device, revision=revision)
        return cls(
            lm,
            tokenizer,
            model_id=str(model),
            revision=revision,
            kv_cache_bytes=kv_cache_bytes,
            block_size=block_size,
            prefix_cache=prefix_cache,
            scheduler=scheduler,
            forward=forward,
            kv_disk_dir=kv_disk_dir,
            kv_disk_bytes=kv_disk_bytes,
            chunk_cache_bytes=chunk_cache_bytes,
        )

    @property
    def forward_path(self) -> str:
        """``"compact"`` or ``"transformers"``: which forward runs this model (``runner.path``)."""
        return self.runner.path

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template.

        Raises:
            InvalidRequestError: no chat template, or the template rejects the messages.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                f"model {self.model_id!r} has no chat template; pass text or token ids instead"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja errors are not a stable type
            raise InvalidRequestError(f"chat template failed on these messages: {exc}") from exc
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text prompt, exactly as ``generate``/``stream`` tokenize it."""
        return list(self.tokenizer.encode(text, add_special_tokens=True)) if text else []

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        chunk_reuse: ChunkReuse | None = None,
    ) -> Completion:
        """Generate a completion (blocking); ``chunk_reuse`` as in ``make_request``.

        Raises:
            InvalidRequestError: empty prompt, bad token ids, unknown stop ids, bad chunk spans.
            PromptTooLongError: the prompt leaves no room in the context.
        """
        return _last_completion(
            self.stream(prompt, params, cache_salt=cache_salt, chunk_reuse=chunk_reuse)
        )

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        chunk_reuse: ChunkReuse | None = None,
    ) -> RequestStream:
        """Generate incrementally; the last delta carries ``finish_reason`` and the Completion.

        The prompt is validated now (errors raise here, not on first ``next``). Closing the
        iterator early (``.close()``) cancels the request and releases everything it pinned.
        Iterating yields one delta per token; ``RequestStream.poll`` reads without blocking.
        ``logits_processors`` edit this request's logits row before each sampling step (see
        ``runtime.sampler.LogitsProcessor``); one that raises ends this request alone.

        Raises:
            InvalidRequestError, PromptTooLongError: as ``generate``.
            EngineBusyError: (on first ``next``) the scheduler's queue is full.
            SamplingError: (from ``next``) this request's logits could not be sampled.
        """
        req = self.make_request(
            prompt,
            params,
            cache_salt=cache_salt,
            logits_processors=logits_processors,
            chunk_reuse=chunk_reuse,
        )
        return self.run(req)

    def stream_choices(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        n: int = 1,
        cache_salt: str | None = None,
        grammar: Grammar | None = None,
        chunk_reuse: ChunkReuse | None = None,
    ) -> list[RequestStream]:
        """Generate ``n`` choices of one prompt from ONE prefill; one stream per choice.

        The prompt's KV is computed once (or read from the prefix cache once); every other
        choice copies it into its own row and samples its own tokens. Choice ``i`` samples with
        seed ``params.seed + i`` (wrapped into the signed 64-bit range), so choice 0 matches a
        single request with the same seed; without a seed each choice draws its own. With
        ``grammar`` every choice is constrained by it (its own matcher); ``chunk_reuse`` as in
        ``make_request``. The request is submitted now: closing one stream cancels that choice
        only.

        Raises:
            InvalidRequestError, PromptTooLongError: as ``generate``; also ``n`` < 1 or more
                choices than the scheduler decodes at once.
            EngineBusyError: the scheduler's queue is full.
        """
        head = self.make_request(
            prompt, params, cache_salt=cache_salt, n=n, grammar=grammar, chunk_reuse=chunk_reuse
        )
        return self.run_choices(head)

    def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """Compile (or fetch from the cache) the grammar of a constrained request.

        Raises:
            InvalidRequestError: the schema or structural tag is invalid or unsupported.
        """
        return self.grammars.compile(spec)

    def cache_stats(self) -> CacheStats:
        """Prefix cache counters and occupancy, with the chunk store's (``chunk_store``)."""
        pc = self.prefix_cache
        with self._lock:
            used, disk = pc.radix.num_blocks, pc.disk
            return CacheStats(
                queried_tokens=pc.queried_tokens,
                hit_tokens=pc.hit_tokens,
                disk_hit_tokens=pc.disk_hit_tokens,
                disk=None if disk is None else disk.snapshot(),
                bytes_used=used * pc.pool.block_bytes,
                bytes_total=pc.pool.bytes_total,
                num_blocks_used=used,
                num_blocks_total=pc.pool.num_blocks,
                num_evictions=pc.num_evictions,
                is_enabled=pc.is_enabled,
                disabled_reason=pc.disabled_reason,
                num_blocks_pinned=pc.radix.num_in_use_blocks,
                chunk_store=self.chunk_store.snapshot(),
            )

    def flush_cache(self, *, include_disk: bool = False) -> int:
        """Drop every cached block not pinned by a running request; returns prefix blocks freed.

        With a disk tier the dropped blocks spill to it (as any eviction does), unless
        ``include_disk``, which also deletes every block file. The chunk store's documents are
        dropped too (a cache reset leaves no stored KV behind).
        """
        with self._lock:
            self.chunk_store.flush()
            return self.prefix_cache.flush(include_disk=include_disk)

    def drain_disk(self) -> None:
        """Wait until every queued disk-tier write is on disk (no-op without a disk tier)."""
        if self.prefix_cache.disk is not None:
            self.prefix_cache.disk.drain()

    def check_integrity(self) -> None:
        """Assert the pool and tree agree: free + evictable + in-use == total blocks."""
        with self._lock:
            self.prefix_cache.check_integrity()
            self.chunk_store.check_integrity()
            self.scheduler.check_integrity()

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        use_prefix_cache: bool = True,
        record_logits: bool = False,
        logits_processors: Sequence[LogitsProcessor] = (),
        n: int = 1,
        grammar: Grammar | None = None,
        chunk_reuse: ChunkReuse | None = None,
    ) -> Request:
        """Validate and tokenize a prompt into a waiting Request (nothing is pinned yet).

        ``use_prefix_cache=False`` forces a miss for this request; ``record_logits`` keeps the
        raw ``[vocab]`` logits of every step in ``request.logits_log`` (exactness tests);
        ``logits_processors`` as in ``stream`` (with ``n > 1`` every choice shares them: give
        stateless ones, per-choice state belongs in ``grammar``). With ``n > 1`` the other
        choices are in ``request.forks`` (see ``stream_choices``).

        Raises:
            InvalidRequestError: ``cache_salt`` is empty (it would share the unsalted namespace;
                the server refuses it too), or the prompt/params are invalid.
        """
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError(
                f"cache_salt must be a non-empty str or None (no salt), got {cache_salt!r}"
            )
        params = params or SamplingParams()
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an int >= 1, got {n!r}")
        ids = self._prompt_ids(prompt)
        self._check(ids, params)
        if chunk_reuse is not None:
            self._check_chunks(chunk_reuse, ids, params)
        namespace = namespace_of(self.model_id, self.revision, self._dtype_name, cache_salt)
        choices = [
            Request(
                prompt_ids=ids,
                params=params,
                namespace=namespace,
                max_total_len=min(self.max_context_len, len(ids) + params.max_tokens),
                stop_ids=frozenset(params.stop_token_ids)
                | (frozenset() if params.ignore_eos else self.eos_ids),
                detokenizer=Detokenizer(
                    self.tokenizer, list(params.stop), min_tokens=params.min_tokens
                ),
                generator=torch.Generator(device="cpu").manual_seed(choice_seed(params.seed, i)),
                # NOTE: prompt logprobs need every prompt position's logits: skip the cache.
                use_prefix_cache=use_prefix_cache and params.prompt_logprobs is None,
                logits_log=[] if record_logits else None,
                logits_processors=_processors(logits_processors, grammar),
                is_fork=i > 0,
                chunk_plan=chunk_reuse,
            )
            for i in range(n)
        ]
        choices[0].forks = choices[1:]
        return choices[0]

    def run(self, request: Request) -> RequestStream:
        """Drive a request made by ``make_request`` to completion (what ``stream`` returns).

        For a request with forks use ``run_choices`` (this stream would read choice 0 only).
        """
        return RequestStream(request, self.scheduler)

    def run_choices(self, request: Request) -> list[RequestStream]:
        """Submit a request made by ``make_request`` now; one stream per choice (``n``).

        Raises:
            EngineBusyError, InvalidRequestError, PromptTooLongError: as ``Scheduler.submit``.
        """
        self.scheduler.submit(request)
        return [
            RequestStream(member, self.scheduler, is_submitted=True)
            for member in (request, *request.forks)
        ]

    def scheduler_stats(self) -> SchedulerStats:
        """Running and waiting requests, pinned prefix blocks and batch KV bytes now."""
        with self._lock:
            return self.scheduler.stats()

    def close(self) -> None:
        """Stop the scheduler loop; queued and running requests fail with RuntimeEngineError.

        Queued disk-tier writes are finished first. Idempotent; also runs at interpreter exit
        and when the engine is garbage collected.
        """
        self._finalizer()

    # --- input checks: the one place a request is validated (the server maps the errors) ---

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt``; only ids given by the caller are checked id by id."""
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            return self.render_chat(items)  # type: ignore[arg-type]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise InvalidRequestError("prompt must be text, a list of token ids or chat messages")
        bad = [t for t in items if not 0 <= t < self.vocab_size]  # type: ignore[operator]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]!r} are outside the vocabulary [0, {self.vocab_size})"
            )
        return [int(t) for t in items if isinstance(t, int)]

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty; give at least one token")
        for name, tokens in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias)),
        ):
            unknown = [t for t in tokens if t >= self.vocab_size]
            if unknown:
                raise InvalidRequestError(
                    f"{name} token ids {unknown[:5]!r} are not in the vocabulary "
                    f"(size {self.vocab_size})"
                )
        if len(ids) >= self.max_context_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_context_len}; "
                "shorten it so at least one token can be generated"
            )

    def _check_chunks(self, plan: ChunkReuse, ids: list[int], params: SamplingParams) -> None:
        plan.check(len(ids))
        why = chunk_reuse_blocker(self.runner, plan.mode)
        if why is not None:
            raise ChunkReuseError(
                f"chunk reuse ({plan.mode!r}) is not available for model {self.model_id!r}: {why}"
            )
        if params.prompt_logprobs is not None:
            raise ChunkReuseError("prompt_logprobs cannot be combined with chunk reuse")

    def _make_pool(self, budget: int, block_size: int) -> KVPool:
        shape = self.runner.kv_shape
        return KVPool(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=block_size,
            budget_bytes=budget,
            dtype=self.runner.dtype,
            device=self.runner.device,
        )

    def _make_prefix_cache(self, budget: int, block_size: int, enabled: bool) -> PrefixCache:
        pool = self._make_pool(budget if enabled else 0, block_size)
        reason = None if enabled else "prefix_cache=False (force-miss)"
        blocker = reuse_blocker(self.runner.model.config)
        if enabled and blocker is not None:
            logger.warning("prefix cache disabled for %r: %s", self.model_id, blocker)
            reason, enabled = blocker, False
        return PrefixCache(pool, is_enabled=enabled, disabled_reason=reason)

    def _make_disk_tier(self, path: str | os.PathLike[str], budget: int) -> DiskTier:
        pool = self.prefix_cache.pool
        layout = f"{pool.block_shape}|{self.runner.dtype}"
        fingerprint = f"{weights_fingerprint(self.runner.model)}|{layout}"
        return DiskTier(path, budget_bytes=budget, fingerprint=fingerprint,
                        block_shape=pool.block_shape, dtype=self.runner.dtype)  # fmt: skip


def _shutdown(scheduler: Scheduler, disk: DiskTier | None) -> None:
    scheduler.close()
    if disk is not None:
        disk.close()


def _processors(
    shared: Sequence[LogitsProcessor], grammar: Grammar | None
) -> list[LogitsProcessor]:
    """One choice's logits processors: the caller's, then a fresh matcher of ``grammar``."""
    return [*shared, *([] if grammar is None else [grammar.matcher()])]


def choice_seed(seed: int | None, choice: int) -> int:
    """The generator seed of choice ``choice`` of a request with ``seed`` (None draws one).

    ``seed + choice`` wrapped into ``[SEED_MIN, SEED_MAX]`` (torch then takes a negative seed as
    its two's complement), so choice 0 samples exactly as a single request with ``seed`` does.

    NOTE: an unseeded choice draws from ``secrets``, not ``torch.seed()``: that reseeds torch's
    global generator (the caller's reproducibility) and queues CUDA's lazy seed with a formatted
    stack, ~13 ms of GIL-holding work per request in a 16-client ``bench load`` (py-spy).
    """
    if seed is None:
        return secrets.randbits(63)
    return (seed + choice - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN


def _last_completion(deltas: Iterator[StreamDelta]) -> Completion:
    for delta in deltas:
        if delta.completion is not None:
            return delta.completion
    raise AssertionError("stream ended without a completion")


def _context_len(config: Any, tokenizer: Any) -> int:
    text = config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < 10**7 else 2048


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
