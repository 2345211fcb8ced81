"""Engine: the public entry of the local runtime (generate, stream, chat rendering, cache control).

It owns the model runner, the request builder (the one validator of a request), the KV stores
(prefix cache, disk tier, chunk store), the scheduler (whose loop thread batches every running
request) and one lock; ``stream`` submits a request and yields the deltas the loop posts.
It does not know HTTP or the SDK.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.cache.disk_tier import DISK_POLICIES, DiskPolicy
from runtime.cache.prefix_cache import PrefixCache
from runtime.chunks.assembler import ChunkAssembler
from runtime.chunks.spans import ChunkReuse
from runtime.exceptions import InvalidRequestError
from runtime.kv_stores import KVStores
from runtime.model_runner import ForwardPath, ModelRunner, WeightsDtype, load_model
from runtime.openmp import release_thread_workers
from runtime.outputs import CacheStats, Completion, StreamDelta
from runtime.request.builder import Prompt, RequestBuilder
from runtime.request.state import Request
from runtime.sampling.grammar import Grammar, GrammarCompiler, GrammarSpec
from runtime.sampling.params import SamplingParams
from runtime.sampling.sampler import LogitsProcessor
from runtime.scheduler.config import SchedulerConfig, SchedulerStats
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

DEFAULT_KV_CACHE_BYTES = 1 << 30
"""Prefix cache budget when none is given: 1 GiB of KV blocks."""
DEFAULT_CHUNK_CACHE_BYTES = 256 << 20
"""Chunk store budget when none is given: 256 MiB (pages are touched only as chunks arrive)."""
DEFAULT_KV_DISK_BYTES = 8 << 30
"""Disk tier budget when ``kv_disk_dir`` is given without ``kv_disk_bytes``: 8 GiB of files."""
DEFAULT_KV_DISK_FLUSH_S = 5.0
"""Most seconds ``close`` spends writing queued disk-tier blocks (a graceful shutdown)."""


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
        weights: WeightsDtype = "float32",
        kv_disk_policy: DiskPolicy = "write-through",
        kv_disk_flush_s: float = DEFAULT_KV_DISK_FLUSH_S,
        weight_blocks: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Wrap an already loaded model; prefer ``from_pretrained``.

        NOTE: on the compact forward the model's projection and LM-head weights become
        transposed views of input-major storage (``runtime.compact_llama``; one copy of each
        weight). Its HF forward still gives the same logits, but ``model.save_pretrained``
        needs ``state_dict={k: v.contiguous() for k, v in model.state_dict().items()}``.
        ``weights="bfloat16"`` rounds the model's linear weights in place (see
        ``from_pretrained``), as do ``"q8_0"`` / ``"q4_1"`` to GGUF's blocks;
        ``weight_blocks`` (module name -> uint8 blocks, ``runtime.gguf_blocks``) are a GGUF
        file's own blocks for those, kept as they are.

        Raises:
            ValueError: for a non-positive block_size, negative kv_cache_bytes, kv_disk_bytes
                or kv_disk_flush_s, an unknown kv_disk_policy,
                ``forward="compact"`` on a model outside the compact family, or
                ``weights`` other than ``"float32"`` on a model that is not float32.
            ModelLoadError: when the model exposes no usable per-layer KV cache.
            OSError: ``kv_disk_dir`` cannot be created or read.
        """
        if block_size < 1 or min(kv_cache_bytes, kv_disk_bytes, chunk_cache_bytes) < 0:
            raise ValueError(
                f"need block_size >= 1 and kv_cache_bytes, kv_disk_bytes, chunk_cache_bytes "
                f">= 0, got {block_size!r}, {kv_cache_bytes!r}, {kv_disk_bytes!r}, "
                f"{chunk_cache_bytes!r}"
            )
        if kv_disk_policy not in DISK_POLICIES or not kv_disk_flush_s >= 0:
            raise ValueError(
                f"kv_disk_policy must be one of {DISK_POLICIES} and kv_disk_flush_s >= 0, got "
                f"{kv_disk_policy!r}, {kv_disk_flush_s!r}"
            )
        self.runner = ModelRunner(model, forward=forward, weights=weights, blocks=weight_blocks)
        logger.info("forward path for %r: %s (%s)", model_id, self.runner.path,
                    self.runner.path_reason or "supported")  # fmt: skip
        self.request_builder = RequestBuilder(
            self.runner, tokenizer, model_id=model_id, revision=revision
        )
        """Validates and tokenizes every request (``make_request``); holds the model facts."""
        self.debug_integrity = debug_integrity
        self._lock = threading.Lock()
        self.kv_stores = KVStores(
            self.runner,
            model_id=model_id,
            block_size=block_size,
            kv_cache_bytes=kv_cache_bytes,
            prefix_cache=prefix_cache,
            kv_disk_dir=kv_disk_dir,
            kv_disk_bytes=kv_disk_bytes,
            chunk_cache_bytes=chunk_cache_bytes,
            kv_disk_policy=kv_disk_policy,
        )
        self.prefix_cache = self.kv_stores.prefix_cache
        self.chunk_store = self.kv_stores.chunk_store
        """Document chunks' KV for requests that ask for chunk reuse (``runtime.chunks``)."""
        if self.runner.batch_blocker is not None:
            logger.warning("batch size 1 for %r: %s", model_id, self.runner.batch_blocker)
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
        self._finalizer = weakref.finalize(
            self, _shutdown, self.scheduler, self.prefix_cache, self._lock, kv_disk_flush_s
        )
        # NOTE: loading ran parallel regions here; their OpenMP workers would stay and throttle
        # the scheduler thread's (runtime.openmp). A server's loading thread then holds none.
        release_thread_workers()

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
        weights: WeightsDtype = "float32",
        kv_disk_policy: DiskPolicy = "write-through",
        kv_disk_flush_s: float = DEFAULT_KV_DISK_FLUSH_S,
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
                Blocks written there survive restarts; files are named by model, revision,
                dtype, tenant salt and a weights fingerprint, so another model or dtype never
                reuses them.
            kv_disk_bytes: byte budget of ``kv_disk_dir`` (block files, headers included).
            kv_disk_policy: ``"write-through"`` (each new whole block is queued for disk as it
                is cached, deduplicated by block hash, in the background; a full queue drops the
                write, never the request) or ``"evict"`` (blocks reach disk only when evicted,
                so a clean restart finds only what memory pressure pushed out).
            kv_disk_flush_s: most seconds ``close`` (a graceful shutdown: SIGTERM, Ctrl-C)
                spends writing the blocks still queued; the rest are dropped.
            chunk_cache_bytes: byte budget of the chunk store (document chunks' KV, used only
                by requests with ``chunk_reuse``).
            weights: ``"float32"`` (the reference) or ``"bfloat16"``: a float32 model's linear
                weights (LM head included) rounded to bfloat16 while activations, the KV cache
                and arithmetic stay float32. On the compact forward with the native kernels,
                decode steps then read packed bf16 copies, half the weight bytes (the fp32
                weights are kept for prefill: 1.5x the weight memory). Answers equal float32 on
                the rounded weights within float32 rounding; against the unrounded model they
                differ by the rounding (see the README's figures).
                ``"float32-packed"``: the weights as loaded plus, on the compact forward with
                the native kernels, a packed fp32 copy of each linear weight (2x the weight
                memory) that products of up to 64 rows (decode steps, a hit's few new tokens)
                stream instead of MKL's (about 1.1x at one row, 1.6-1.8x at 8-16; see the
                README's figures); the same answers as ``"float32"`` within float32 rounding.
                With the scalar kernels (``AGENTCACHE_KERNEL_ISA=scalar``) no copy is kept.
                ``"q8_0"`` / ``"q4_1"``: a quantized model (another model than the fp32 one,
                labelled so): every linear weight rounded to GGUF's Q8_0 / Q4_1 blocks (LM head
                and tied embedding Q8_0) and, on the compact forward with vectorized native
                kernels, the blocks kept for decode steps (8.5 / 5 bits a weight read instead
                of 32). From a ``.gguf`` file whose tensors are in that format the file's own
                blocks are kept (``runtime.gguf_blocks``), not quantized again.

        Raises:
            ModelLoadError: the model or tokenizer cannot be loaded.
            ValueError, OSError: as ``Engine()``.
        """
        lm, tokenizer = load_model(str(model), dtype=dtype, device=device, revision=revision)
        blocks = None
        if weights in ("q8_0", "q4_1") and str(model).endswith(".gguf") and Path(model).is_file():
            from runtime.gguf_blocks import gguf_blocks

            blocks = gguf_blocks(model, weights)
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
            weights=weights,
            kv_disk_policy=kv_disk_policy,
            kv_disk_flush_s=kv_disk_flush_s,
            weight_blocks=blocks,
        )

    @property
    def weights(self) -> WeightsDtype:
        """How the model holds its weights (``WeightsDtype``; ``"q4_1"``: a quantized model)."""
        return self.runner.weights

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
