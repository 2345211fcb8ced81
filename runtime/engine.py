"""Engine: the public entry of the local runtime (generate, stream, chat rendering, cache control).

It owns the model runner, the request builder (the one validator of a request), the KV stores
(prefix cache, disk tier, chunk store), the scheduler (whose loop thread batches every running
request) and one lock; ``stream`` submits a request and yields the deltas the loop posts.
It does not know HTTP or the SDK.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.cache.prefix_cache import PrefixCache
from runtime.chunks.assembler import ChunkAssembler
from runtime.chunks.spans import ChunkReuse
from runtime.config import (
    DEFAULT_CHUNK_CACHE_BYTES,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_KV_DISK_BYTES,
    DEFAULT_KV_DISK_FLUSH_S,
    EngineConfig,
)
from runtime.exceptions import InvalidRequestError
from runtime.kv_stores import KVStores
from runtime.model.openmp import release_thread_workers
from runtime.model.runner import ModelRunner, WeightsDtype, load_model
from runtime.outputs import CacheStats, Completion, StreamDelta
from runtime.request.builder import RequestBuilder
from runtime.request.spec import Prompt, RequestSpec
from runtime.request.state import Request
from runtime.sampling.grammar import Grammar, GrammarCompiler, GrammarSpec
from runtime.sampling.params import SamplingParams
from runtime.sampling.sampler import LogitsProcessor
from runtime.scheduler.config import SchedulerStats
from runtime.scheduler.loop import Scheduler
from runtime.stream import RequestStream

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CHUNK_CACHE_BYTES",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_KV_DISK_BYTES",
    "DEFAULT_KV_DISK_FLUSH_S",
    "Engine",
    "Prompt",
]

logger = logging.getLogger(__name__)


class Engine:
    """A causal LM with continuous batching and an exact cross-request prefix cache.

    Thread-safe: ``generate``/``stream`` may run from many threads; one loop thread (started on
    the first request, stopped by ``close``) prefills and batch-decodes them.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig | None = None,
        *,
        model_id: str,
        weight_blocks: Mapping[str, torch.Tensor] | None = None,
        **options: Any,
    ) -> None:
        """Wrap an already loaded model; prefer ``from_pretrained``.

        NOTE: on the compact forward the model's projection and LM-head weights become
        transposed views of input-major storage (``runtime.model.compact_llama``; one copy of each
        weight). Its HF forward still gives the same logits, but ``model.save_pretrained``
        needs ``state_dict={k: v.contiguous() for k, v in model.state_dict().items()}``.
        ``weights="bfloat16"`` rounds the model's linear weights in place (see
        ``EngineConfig.weights``), as do ``"q8_0"`` / ``"q4_1"`` to GGUF's blocks;
        ``weight_blocks`` (module name -> uint8 blocks, ``runtime.model.gguf_blocks``) are a GGUF
        file's own blocks for those, kept as they are.

        Args:
            model: a loaded transformers causal LM.
            tokenizer: its tokenizer.
            config: every engine option (``EngineConfig()`` when None); ``dtype``, ``device``
                and ``revision`` describe how ``model`` was loaded.
            model_id: the model's name; part of every cache namespace.
            weight_blocks: a GGUF file's quantized blocks by module name, or None.
            **options: ``EngineConfig`` fields replacing ``config``'s (the keyword form).

        Raises:
            TypeError: an option that is not an ``EngineConfig`` field.
            ValueError: an option out of range (``EngineConfig``), ``forward="compact"`` on a
                model outside the compact family, ``weights`` other than ``"float32"`` on
                a model that is not float32, or ``kv_dtype="float16"`` off the compact forward.
            ModelLoadError: when the model exposes no usable per-layer KV cache.
            OSError: ``kv_disk_dir`` cannot be created or read.
        """
        config = (config or EngineConfig()).replace(**options)
        self.config = config
        """The options this engine runs with (frozen; what loading found lives on the engine)."""
        self.runner = ModelRunner(
            model,
            forward=config.forward,
            weights=config.weights,
            blocks=weight_blocks,
            kv_dtype=config.kv_dtype,
        )
        logger.info("forward path for %r: %s (%s)", model_id, self.runner.path,
                    self.runner.path_reason or "supported")  # fmt: skip
        self.request_builder = RequestBuilder(
            self.runner, tokenizer, model_id=model_id, revision=config.revision
        )
        """Validates and tokenizes every request (``make_request``); holds the model facts."""
        self.debug_integrity = config.debug_integrity
        self._lock = threading.Lock()
        self.kv_stores = KVStores(self.runner, config, model_id=model_id)
        self.prefix_cache = self.kv_stores.prefix_cache
        self.chunk_store = self.kv_stores.chunk_store
        """Document chunks' KV for requests that ask for chunk reuse (``runtime.chunks``)."""
        if self.runner.batch_blocker is not None:
            logger.warning("batch size 1 for %r: %s", model_id, self.runner.batch_blocker)
        self.scheduler = Scheduler(
            self.runner,
            self.prefix_cache,
            self._lock,
            config.scheduler,
            debug_integrity=config.debug_integrity,
            chunks=ChunkAssembler(self.runner, self.chunk_store),
        )
        self.grammars = GrammarCompiler(
            tokenizer, vocab_size=self.vocab_size, stop_ids=self.eos_ids
        )
        """Compiles ``GrammarSpec``s for constrained decoding (xgrammar loads on first use)."""
        # NOTE: holds the scheduler, not the engine, so an unreferenced engine is collected.
        self._finalizer = weakref.finalize(
            self, _shutdown, self.scheduler, self.prefix_cache, self._lock, config.disk_flush_s
        )
        # NOTE: loading ran parallel regions here; their OpenMP workers would stay and throttle
        # the scheduler thread's (runtime.model.openmp). A server's loading thread then holds none.
        release_thread_workers()

    @classmethod
    def from_pretrained(
        cls, model: str, config: EngineConfig | None = None, **options: Any
    ) -> Engine:
        """Load a model and its tokenizer (local path, bundled name, or hub id).

        Args:
            model: local directory, name known to ``runtime.models.resolve_model``, ``.gguf``
                file or hub id.
            config: every engine option (``EngineConfig``: dtype, weights, forward, block size,
                KV budgets, prefix cache, eviction policy, disk tier, chunk store, scheduler
                limits); ``EngineConfig()`` when None.
            **options: ``EngineConfig`` fields replacing ``config``'s (the keyword form:
                ``from_pretrained("tiny", kv_cache_bytes=1 << 20)``).

        Raises:
            TypeError: an option that is not an ``EngineConfig`` field.
            ModelLoadError: the model or tokenizer cannot be loaded.
            ValueError, OSError: as ``Engine()``.
        """
        config = (config or EngineConfig()).replace(**options)
        lm, tokenizer = load_model(
            str(model), dtype=config.dtype, device=config.device, revision=config.revision
        )
        blocks = None
        weights = config.weights
        if weights in ("q8_0", "q4_1") and str(model).endswith(".gguf") and Path(model).is_file():
            from runtime.model.gguf_blocks import gguf_blocks

            blocks = gguf_blocks(model, weights)
        return cls(lm, tokenizer, config, model_id=str(model), weight_blocks=blocks)

    @property
    def weights(self) -> WeightsDtype:
        """How the model holds its weights (``WeightsDtype``; ``"q4_1"``: a quantized model)."""
        return self.runner.weights

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type as loading resolved ``EngineConfig.kv_dtype``:
        ``"float16"`` (keys and values rounded to fp16 when written) or the model's dtype."""
        return str(self.runner.kv_dtype).removeprefix("torch.")

    @property
    def forward_path(self) -> str:
        """``"compact"`` or ``"transformers"``: which forward runs this model (``runner.path``)."""
        return self.runner.path

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a transformers tokenizer)."""
        return self.request_builder.tokenizer

    @property
    def model_id(self) -> str:
        """The model's name as given (path, bundled name or hub id); part of every namespace."""
        return self.request_builder.model_id

    @property
    def revision(self) -> str | None:
        """The hub revision loaded (None: the default branch or a local folder)."""
        return self.request_builder.revision

    @property
    def max_context_len(self) -> int:
        """Positions the model can attend to; a prompt must leave room for one new token."""
        return self.request_builder.max_context_len

    @property
    def vocab_size(self) -> int:
        """Token ids the model can run: its input embedding's rows (``RequestBuilder``)."""
        return self.request_builder.vocab_size

    @property
    def eos_ids(self) -> frozenset[int]:
        """End-of-sequence ids that stop a request without ``ignore_eos`` (read-only: the grammar
        compiler took them at construction; ``SamplingParams(ignore_eos=True)`` decodes a fixed
        number of tokens)."""
        return self.request_builder.eos_ids

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
        return self.request_builder.render_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text prompt, exactly as ``generate``/``stream`` tokenize it."""
        return self.request_builder.tokenize(text)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        chunk_reuse: ChunkReuse | None = None,
    ) -> Completion:
        """Generate a completion (blocking); ``chunk_reuse`` as in ``make_request``.

        Only the Completion is handed over (``Request.is_streamed`` False): the scheduler posts
        no per-token delta, so this thread is not woken once a token.

        Raises:
            InvalidRequestError: empty prompt, bad token ids, unknown stop ids, bad chunk spans.
            PromptTooLongError: the prompt leaves no room in the context.
        """
        req = self.make_request(prompt, params, cache_salt=cache_salt, chunk_reuse=chunk_reuse)
        req.is_streamed = False
        return _last_completion(self.run(req))

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
        ``runtime.sampling.sampler.LogitsProcessor``); one that raises ends this request alone.

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
            InvalidRequestError, PromptTooLongError: as ``generate``; also ``n`` < 1.
            TooManyChoicesError: more choices than the scheduler decodes at once, or than fit
                its batch KV budget.
            EngineBusyError: the scheduler's queue is full.
        """
        spec = RequestSpec(prompt, params or SamplingParams(), n, cache_salt, grammar, chunk_reuse)
        return self.submit(spec)

    def submit(self, spec: RequestSpec) -> list[RequestStream]:
        """Generate ``spec.n`` choices of ``spec.prompt`` from one prefill; one stream per choice
        (``stream_choices``'s record form: what the server sends).

        Raises:
            InvalidRequestError, PromptTooLongError, ChunkReuseError: what needs the model
                (the prompt's ids, its length, chunk reuse here); ``spec``'s own fields were
                checked when it was built.
            EngineBusyError: the scheduler's queue is full.
        """
        return self.run_choices(self.request_builder.build(spec))

    def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """Compile (or fetch from the cache) the grammar of a constrained request.

        Raises:
            InvalidRequestError: the schema or structural tag is invalid or unsupported.
        """
        return self.grammars.compile(spec)

    def cache_stats(self) -> CacheStats:
        """Prefix cache counters and occupancy, with the chunk store's (``chunk_store``)."""
        with self._lock:
            return self.kv_stores.stats()

    def flush_cache(self, *, include_disk: bool = False) -> int:
        """Drop every cached block not pinned by a running request; returns prefix blocks freed.

        With a disk tier the dropped blocks spill to it (as any eviction does), unless
        ``include_disk``, which also deletes every block file. The chunk store's documents are
        dropped too (a cache reset leaves no stored KV behind).
        """
        with self._lock:
            return self.kv_stores.flush(include_disk=include_disk)

    def flush_namespace(self, cache_salt: str | None) -> int:
        """Drop the cached blocks and chunks of one namespace (the requests sent with
        ``cache_salt``; None: the unsalted one), in memory and on the disk tier, queued writes
        included; blocks pinned by a running request stay in memory. Other namespaces keep
        theirs. Returns the prefix blocks freed from memory.

        Raises:
            InvalidRequestError: ``cache_salt`` is an empty string.
        """
        if cache_salt is not None and not cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty str or None (no salt)")
        namespace = self.request_builder.namespace(cache_salt)
        with self._lock:
            return self.kv_stores.flush_namespace(namespace)

    def drain_disk(self) -> None:
        """Wait until every queued disk-tier write is on disk (no-op without a disk tier)."""
        self.kv_stores.drain_disk()

    def check_integrity(self) -> None:
        """Assert the pool and tree agree: free + evictable + in-use == total blocks."""
        with self._lock:
            self.kv_stores.check_integrity()
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
            InvalidRequestError, PromptTooLongError, ChunkReuseError: as
                ``RequestBuilder.make_request`` (empty ``cache_salt``, bad prompt or params).
        """
        return self.request_builder.make_request(
            prompt,
            params,
            cache_salt=cache_salt,
            use_prefix_cache=use_prefix_cache,
            record_logits=record_logits,
            logits_processors=logits_processors,
            n=n,
            grammar=grammar,
            chunk_reuse=chunk_reuse,
        )

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

        Queued disk-tier writes are finished first, for at most ``kv_disk_flush_s``.
        Idempotent; also runs at interpreter exit and when the engine is garbage collected.
        """
        self._finalizer()


def _shutdown(
    scheduler: Scheduler, prefix_cache: PrefixCache, lock: threading.Lock, flush_s: float
) -> None:
    """Stop the loop, then write what is queued for the disk tier and (write-through) every
    block memory holds that it lacks, within ``flush_s`` seconds in all, so a clean restart
    finds the cache as it was."""
    scheduler.close()
    disk = prefix_cache.disk
    if disk is not None:
        deadline = time.monotonic() + flush_s
        if prefix_cache.disk_policy == "write-through":
            with lock:
                prefix_cache.persist(flush_s)
        dropped = disk.close(max(0.0, deadline - time.monotonic()))
        if dropped:
            logger.warning("disk tier: %d queued block writes dropped after %.1f s", dropped,
                           flush_s)  # fmt: skip


def _last_completion(deltas: Iterator[StreamDelta]) -> Completion:
    for delta in deltas:
        if delta.completion is not None:
            return delta.completion
    raise AssertionError("stream ended without a completion")
