"""Backend on the bundled in-process engine (``runtime.Engine``): the only SDK module importing it.

It renders prompts with the model's chat template and carries token ids across calls: when the
new conversation text extends the previous prompt plus the generated text, only the new
remainder is tokenized and appended to the ids the model actually saw and produced, so the
engine's prefix cache matches the whole earlier conversation. Knows nothing about agents or HTTP.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from agentcache.backends._local_engine import (
    CHATML_STOPS,
    MARKUP_STOPS,
    check_model_name,
    document_spans,
    engine_config,
    import_runtime,
    quiet_loading,
    turn_stops,
    unloadable,
)
from agentcache.backends.base import (
    BaseBackend,
    Capabilities,
    GenerationOptions,
    ModelResponse,
    PromptInput,
    PromptLike,
    StreamEvent,
    as_prompt,
)
from agentcache.exceptions import BackendError, BackendUnavailableError, ConfigError
from agentcache.usage import Usage

if TYPE_CHECKING:
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.outputs import Completion

__all__ = [
    "CHATML_STOPS",
    "MARKUP_STOPS",
    "Carry",
    "ColdRun",
    "LocalBackend",
    "check_model_name",
    "document_spans",
]


class ColdRun(NamedTuple):
    """One prompt run with the prefix cache forced off (see ``measure_cold_ttft``)."""

    ttft_s: float
    """Seconds from submitting the prompt ids to the first generated token."""
    prompt_tokens: int
    """Tokens in the prompt."""
    prefill_tokens_computed: int
    """Prompt tokens that went through the model (all of them, with the cache off)."""


class Carry(NamedTuple):
    """How the last prompt's token ids were formed."""

    carried_tokens: int
    """Leading ids reused from the previous call (prompt + generated), not re-tokenized."""
    prompt_tokens: int
    """All prompt ids."""


class LocalBackend(BaseBackend):
    """Runs prompts on ``runtime.Engine`` in this process, with token-id carry-over.

    Not thread-safe: the carried ids belong to one conversation at a time (create one backend
    per concurrent conversation; they can share one engine).
    """

    name = "local"

    def __init__(
        self,
        model: str = "tiny",
        *,
        engine: Engine | None = None,
        kv_cache_bytes: int | None = None,
        prefix_cache: bool = True,
        cache_salt: str | None = None,
        dtype: str = "float32",
        weights: str = "float32",
        kv_dtype: str = "auto",
        device: str = "cpu",
        chunk_reuse: Literal["exact", "blend"] | None = None,
        recompute_fraction: float = 0.15,
        kv_disk_dir: str | None = None,
        kv_disk_bytes: int | None = None,
        kv_disk_policy: Literal["write-through", "evict"] | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        """Load the model (or use ``engine``).

        Args:
            model: Bundled name (``tiny``), local folder or Hugging Face id (must be cached
                locally when offline).
            engine: An existing ``runtime.Engine`` to share; ``model`` is then only a label.
            kv_cache_bytes: Prefix-cache budget in bytes (engine default when ``None``).
            prefix_cache: ``False`` forces misses (same code path; for comparisons).
            cache_salt: Per-tenant namespace of cached KV; ``None`` is the unsalted one. An
                empty string is refused, as the server refuses it.
            dtype: ``float32``, ``float16`` or ``bfloat16``.
            weights: How a float32 model holds its weights (``serve --weights``): ``float32``
                (the reference), ``bfloat16`` (linear weights rounded to bf16, arithmetic in
                float32), ``float32-packed`` (the weights moved into packed copies that every
                product reads faster: the same memory, the same answers within float32
                rounding), ``q8_0`` or ``q4_1``
                (a quantized model: GGUF's blocks, read directly by decode steps); see
                ``runtime.model.runner.WeightsDtype``.
            kv_dtype: The KV cache's element type (``serve --kv-dtype``): ``auto`` (the
                model's ``dtype``), ``float32``, or ``float16`` (opt-in: half the KV bytes, each
                key and value rounded to fp16, attention computed in float32; a cache hit may then
                answer a near-tied token differently from a miss, see the README's KV cache
                dtype section).
            device: torch device string.
            chunk_reuse: Opt-in reuse of each ``Document``'s KV in any order (the engine's chunk
                store, ``runtime.chunks.assembler``): ``"exact"`` answers as under a block attention
                mask (documents do not see each other), ``"blend"`` approximates the usual
                answer. ``None`` (default): the exact prefix cache only.
            recompute_fraction: Blend only: the share of document tokens recomputed.
            kv_disk_dir: A disk tier below the KV pool (``serve --kv-disk-dir``): cached blocks
                are written there and survive restarts; ``None`` (default): none.
            kv_disk_bytes: Its byte budget (engine default, 8 GiB, when ``None``).
            kv_disk_policy: ``"write-through"`` (None, the default: each new cached block is
                queued for disk at once, and ``close`` writes back what memory holds, so the next
                start is warm) or ``"evict"`` (only blocks evicted from memory reach disk).
            config: Every engine option at once (``runtime.config.EngineConfig``: also the
                eviction policy and the scheduler limits); the engine keywords above (from
                ``kv_cache_bytes`` to ``kv_disk_policy``, ``chunk_reuse`` aside) are then left
                unset.

        Raises:
            ConfigError: ``cache_salt`` is an empty string, an engine option is refused by
                ``EngineConfig`` (``weights`` not one of the five or not float32 ``dtype``'s,
                ``kv_dtype`` not one of the three, or not ``auto`` with a float16 / bfloat16
                ``dtype``,
                ``kv_disk_policy`` neither policy, ``kv_disk_bytes`` without ``kv_disk_dir``),
                ``config`` comes with engine keywords, ``chunk_reuse`` / ``recompute_fraction``
                is out of range, or the model cannot reuse chunks in that mode (no composable
                RoPE, sliding windows; blend: no compact forward).
            BackendUnavailableError: torch/transformers are missing or the model cannot load;
                a name that is neither bundled, a folder nor a hub id ``owner/name`` is refused
                at once, before torch loads or the hub is asked, with ``agentcache serve``'s
                message (it lists the bundled models; ``check_model_name``).
        """
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ConfigError(
                f"cache_salt must be a non-empty str or None (no salt), got {cache_salt!r}"
            )
        options: dict[str, Any] = {"prefix_cache": prefix_cache, "dtype": dtype,
                                   "weights": weights, "kv_dtype": kv_dtype,
                                   "device": device,
                                   "kv_cache_bytes": kv_cache_bytes, "kv_disk_dir": kv_disk_dir,
                                   "kv_disk_bytes": kv_disk_bytes,
                                   "kv_disk_policy": kv_disk_policy}  # fmt: skip
        resolved = engine_config(config, options)
        if chunk_reuse not in (None, "exact", "blend") or not 0.0 <= recompute_fraction <= 1.0:
            raise ConfigError(
                f"chunk_reuse must be None, 'exact' or 'blend' and recompute_fraction in [0, 1], "
                f"got {chunk_reuse!r}, {recompute_fraction!r}"
            )
        # NOTE: an unknown bare name (``nope``) otherwise costs a torch import and about 60 s of
        # hub retries offline before failing; the engine given is used whatever ``model`` says.
        why = unloadable(model) if engine is None else None
        if why is not None:
            raise BackendUnavailableError(why)
        self.chunk_reuse = chunk_reuse
        self.recompute_fraction = recompute_fraction
        runtime = import_runtime()
        self._chunk_plan = runtime.ChunkReuse
        self._sampling_params = runtime.SamplingParams
        self._engine_error: type[Exception] = runtime.RuntimeEngineError
        """The runtime's root exception: what the engine raises for a request it refuses."""
        self._model = model
        owns_engine = engine is None
        if engine is None:
            try:
                with quiet_loading():
                    engine = runtime.Engine.from_pretrained(runtime.resolve_model(model), resolved)
            except (runtime.RuntimeEngineError, OSError, ValueError) as exc:
                raise BackendUnavailableError(f"cannot load local model {model!r}: {exc}") from exc
        self.engine: Engine = engine
        self._owns_engine = owns_engine
        if chunk_reuse is not None:
            self._check_chunk_reuse(chunk_reuse)
        self._stop_strings, self._stop_ids = turn_stops(engine.tokenizer)
        self.cache_salt = cache_salt
        self._prev_ids: list[int] = []
        self._prev_prompt_text = ""
        self._prev_generated: list[int] = []
        self.last_carry = Carry(0, 0)

    def _check_chunk_reuse(self, mode: str) -> None:
        """Refuse ``mode`` now, not at the first request, when the model cannot do it.

        Raises:
            ConfigError: with the runtime's reason (``runtime.chunks.chunk_reuse_blocker``);
                an engine this backend loaded is closed first.
        """
        chunk_reuse: Any = importlib.import_module("runtime.chunks.assembler")
        why = chunk_reuse.chunk_reuse_blocker(self.engine.runner, mode)
        if why is None:
            return
        if self._owns_engine:
            self.engine.close()
        raise ConfigError(f"chunk_reuse={mode!r} is not available for model {self._model!r}: {why}")

    @property
    def capabilities(self) -> Capabilities:
        """Exact prefix cache; Hermes-style tool calls in the generated text."""
        return Capabilities(
            supports_prefix_cache=True,
            reports_cached_tokens=True,
            tool_call_format="hermes",
            is_local=True,
        )

    @property
    def model(self) -> str:
        """The model name or path this backend was created with."""
        return self._model

    def render(self, prompt: PromptInput) -> str:
        """The prompt as text through the model's chat template (generation prompt added).

        Raises:
            BackendError: The model has no chat template or the template rejects the messages.
        """
        tokenizer = self.engine.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise BackendError(f"model {self._model!r} has no chat template")
        prompt = as_prompt(prompt)
        tools = prompt.tool_schemas() or None
        messages: list[dict[str, Any]] = prompt.to_messages()
        from runtime.request.hermes_markup import needs_hermes_markup, with_hermes_markup

        if needs_hermes_markup(str(template), messages, tools):
            # NOTE: a template without tools (SmolLM2's) would drop them and fail on tool turns;
            # the engine's render_chat (so the server) writes them the same way.
            messages, tools = with_hermes_markup(messages, tools or []), None
        try:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # noqa: BLE001 - jinja errors have no stable type
            raise BackendError(f"chat template of {self._model!r} failed: {exc}") from exc
        return str(text)

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids for rendered ``text``, reusing the previous call's ids where they fit.

        Side effect: sets ``last_carry``.
        """
        carried = self._carried_prefix(text)
        if carried is None:
            ids = self._encode(text)
            self.last_carry = Carry(0, len(ids))
            return ids
        carried_ids, carried_len = carried
        ids = carried_ids + self._encode(text[carried_len:])
        self.last_carry = Carry(len(carried_ids), len(ids))
        return ids

    def _carried_prefix(self, text: str) -> tuple[list[int], int] | None:
        """The longest reusable id prefix and the length of text it covers, if any.

        Interval map of the previous call's ids (P = prompt, G = generated):
            ids:  [ P ..................... | G[0:j] ....... | G[j:] (dropped) ]
            text: [ prev_prompt_text ...... | decode(G[:j]) | remainder -> encoded afresh ]
        ``j`` is the largest count whose decoded text still matches the new text.
        """
        if not self._prev_ids or not text.startswith(self._prev_prompt_text):
            return None
        base = len(self._prev_prompt_text)
        prompt_len = len(self._prev_ids) - len(self._prev_generated)
        for j in range(len(self._prev_generated), -1, -1):
            piece = self._decode(self._prev_generated[:j])
            if text.startswith(piece, base):
                return self._prev_ids[: prompt_len + j], base + len(piece)
        return None  # pragma: no cover - j == 0 always matches

    def _encode(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return str(
            self.engine.tokenizer.decode(
                ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def stream(
        self, prompt: PromptInput, options: GenerationOptions | None = None
    ) -> Iterator[StreamEvent]:
        """Stream a completion (contract in ``BaseBackend.stream``).

        Raises:
            BackendError: The engine rejected the request (too long, bad template...).
        """
        options = options or GenerationOptions()
        start = time.perf_counter()
        prompt = as_prompt(prompt)
        text = self.render(prompt)
        ids = self.prompt_ids(text)
        calls_only = options.tool_choice == "required" and bool(prompt.tool_schemas())
        markup = () if calls_only else MARKUP_STOPS
        stop = list(dict.fromkeys([*options.stop, *self._stop_strings, *markup]))
        params = self._sampling_params(
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            stop=stop,
            stop_token_ids=self._stop_ids,
        )
        first_s: float | None = None
        completion: Completion | None = None
        try:
            request = self.engine.make_request(
                ids,
                params,
                cache_salt=self.cache_salt,
                grammar=self._grammar(prompt, options),
                chunk_reuse=self._plan(prompt, ids),
            )
            for delta in self.engine.run(request):
                if first_s is None:
                    first_s = time.perf_counter()
                if delta.text:
                    yield StreamEvent(delta.text)
                completion = delta.completion or completion
        except self._engine_error as exc:
            raise BackendError(f"local engine rejected the request: {exc}") from exc
        assert completion is not None, "the engine's last delta carries the completion"
        self._remember(text, ids, list(completion.token_ids))
        ttft = (first_s or time.perf_counter()) - start
        yield StreamEvent("", self._response(completion, ttft))

    def _grammar(self, prompt: PromptLike, options: GenerationOptions) -> Any:
        """The engine grammar enforcing ``options.tool_choice``, or None (``auto``, no tools).

        ``required``: exactly one Hermes ``<tool_call>`` whose JSON names a declared tool and
        whose arguments follow its schema (``runtime.sampling.tool_grammar``, xgrammar), then the
        end of the turn; ``none``: text without ``<tool_call>``. Compiled grammars are cached by the
        engine, so every later call with the same tools reuses one.
        """
        tools = prompt.tool_schemas()
        if options.tool_choice == "auto" or not tools:
            return None
        tool_grammar: Any = importlib.import_module("runtime.sampling.tool_grammar")
        if options.tool_choice == "required":
            spec = tool_grammar.tool_call_spec(tools, "required", parallel=False)
        else:
            spec = tool_grammar.no_tool_call_spec()
        return self.engine.compile_grammar(spec)

    def _plan(self, prompt: Any, ids: list[int]) -> Any:
        """The engine's ``ChunkReuse`` for the prompt's documents, or None (off, or none found).

        Each document's text is tokenized alone and looked for in ``ids`` (in order, after the
        previous one); where the tokens at its edges merged with the template's, its interior
        is used. A document not found is simply computed as usual.
        """
        if self.chunk_reuse is None:
            return None
        spans = document_spans(
            ids, [self._encode(d.text) for d in getattr(prompt, "documents", ())]
        )
        if not spans:
            return None
        return self._chunk_plan(spans, self.chunk_reuse, self.recompute_fraction)

    def _remember(self, text: str, ids: list[int], generated: list[int]) -> None:
        self._prev_prompt_text = text
        self._prev_generated = generated
        self._prev_ids = ids + generated

    def _response(self, completion: Completion, ttft_s: float) -> ModelResponse:
        chunk = completion.usage.chunk_reuse
        usage = Usage(
            prompt_tokens=completion.usage.prompt_tokens,
            completion_tokens=completion.usage.completion_tokens,
            cached_tokens=completion.usage.cached_tokens,
            ttft_s=ttft_s,
            decode_tokens_per_s=completion.metrics.decode_tokens_per_s,
            chunk_reused_tokens=None if chunk is None else chunk.reused_tokens,
            chunk_reuse_mode=None if chunk is None else chunk.mode,
        )
        return ModelResponse(
            text=completion.text,
            finish_reason=completion.finish_reason,
            usage=usage,
            cost_usd=0.0,
            model=self._model,
        )

    @property
    def last_completion_ids(self) -> list[int]:
        """Generated token ids of the last call (empty before the first call or after ``reset``);
        what a greedy cache-on vs cache-off comparison compares, token for token."""
        return list(self._prev_generated)

    @property
    def last_prompt_ids(self) -> list[int]:
        """Prompt token ids of the last call (empty before the first call or after ``reset``)."""
        return self._prev_ids[: len(self._prev_ids) - len(self._prev_generated)]

    def measure_cold_ttft(self, prompt_ids: list[int] | None = None) -> ColdRun:
        """Time to first token for ``prompt_ids`` with the prefix cache forced off.

        Runs the same engine code path with ``use_prefix_cache=False`` and generates one token, so
        a turn's TTFT can be compared with the same prompt computed from scratch. The timer starts
        at submission; a normal call also renders and tokenizes first, so a ratio of the two
        understates the cache's effect slightly. The carried ids are not changed.

        Args:
            prompt_ids: Token ids to run; default ``last_prompt_ids``.

        Raises:
            BackendError: There is no prompt to run, or the engine rejected it.
        """
        ids = list(prompt_ids if prompt_ids is not None else self.last_prompt_ids)
        if not ids:
            raise BackendError("no prompt to measure: make a call first or pass prompt_ids")
        params = self._sampling_params(max_tokens=1)
        start = time.perf_counter()
        first_s: float | None = None
        completion: Completion | None = None
        try:
            request = self.engine.make_request(
                ids, params, cache_salt=self.cache_salt, use_prefix_cache=False
            )
            for delta in self.engine.run(request):
                first_s = first_s or time.perf_counter()
                completion = delta.completion or completion
        except self._engine_error as exc:
            raise BackendError(f"local engine rejected the request: {exc}") from exc
        assert completion is not None, "the engine's last delta carries the completion"
        computed = int(completion.metrics.prefill_tokens_computed)
        return ColdRun((first_s or time.perf_counter()) - start, len(ids), computed)

    def warm_up(self, num_tokens: int = 32) -> None:
        """Run one short request with the prefix cache forced off, discarding the result.

        One-time start-up costs (compiling the chat template, the engine's scheduler thread,
        first allocations) then do not land on the first real request's TTFT. The prefix cache
        and the carried ids are unchanged.

        Raises:
            BackendError: The engine rejected the request.
        """
        if getattr(self.engine.tokenizer, "chat_template", None):
            self.render([{"role": "user", "content": "warm up"}])
        text = "The quick brown fox jumps over the lazy dog. " * num_tokens
        ids = list(self.engine.tokenizer.encode(text, add_special_tokens=False))[:num_tokens]
        self.measure_cold_ttft(ids)

    def close(self) -> None:
        """Stop the engine this backend loaded (an ``engine=`` passed in is left running)."""
        if self._owns_engine:
            self.engine.close()

    def reset(self) -> None:
        """Forget the carried ids (the engine's prefix cache is kept)."""
        self._prev_ids, self._prev_generated, self._prev_prompt_text = [], [], ""
        self.last_carry = Carry(0, 0)
