"""RequestBuilder: the one validator of a request; a prompt and SamplingParams become a Request.

It tokenizes text, renders chat messages with the model's chat template, checks caller-given
token ids, stop ids, ``logit_bias`` ids and chunk spans against the model's vocabulary and context,
and builds one waiting Request per choice. It does not know the scheduler, the caches' contents
or HTTP (the server maps the errors it raises).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import torch

from runtime.cache.prefix_cache import namespace_of
from runtime.cache.radix_cache import Namespace
from runtime.chunks.assembler import chunk_reuse_blocker
from runtime.chunks.spans import ChunkReuse
from runtime.exceptions import ChunkReuseError, InvalidRequestError, PromptTooLongError
from runtime.model.runner import ModelRunner
from runtime.request.detokenizer import Detokenizer
from runtime.request.hermes_markup import needs_hermes_markup, with_hermes_markup
from runtime.request.spec import Prompt, RequestSpec
from runtime.request.state import Request
from runtime.sampling.grammar import Grammar
from runtime.sampling.params import SEED_MAX, SEED_MIN, SamplingParams
from runtime.sampling.sampler import LogitsProcessor

__all__ = ["Prompt", "RequestBuilder", "choice_seed"]

"""Text (tokenized as is), token ids, or chat messages (rendered with the chat template)."""


class RequestBuilder:
    """Validates and tokenizes prompts of one model into Requests (``Engine.make_request``).

    Not locked: it reads only the tokenizer and the model facts fixed at construction.
    """

    def __init__(
        self, runner: ModelRunner, tokenizer: Any, *, model_id: str, revision: str | None
    ) -> None:
        """Read the model facts (context length, vocabulary size, end-of-sequence ids) once."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        model = runner.model
        self.max_context_len = _context_len(model.config, tokenizer)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        """Token ids the model can run: the rows of its input embedding. NOTE: the one vocabulary
        size of the engine and the server. A tokenizer may be shorter (the embedding padded to a
        multiple of 64/128: those ids decode to nothing) or longer (tokens added without a
        resize: those ids would index past the embedding and fail the whole batch step)."""
        self.eos_ids = _eos_ids(model, tokenizer)
        """Stop ids of every request without ``ignore_eos`` (the generation config's and the
        tokenizer's ``eos_token_id``). To decode a fixed number of tokens, send
        ``SamplingParams(ignore_eos=True)`` rather than changing this set."""
        dtype, kv = (str(d).removeprefix("torch.") for d in (runner.dtype, runner.kv_dtype))
        # NOTE: the KV element type too (an fp16 KV cache's blocks are other bytes)
        self._dtype_name = dtype if kv == dtype else f"{dtype}/kv-{kv}"

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template.

        A template that knows no tools (SmolLM2's) gets ``tools``, tool calls and tool results as
        Hermes text (``hermes_markup``), so they reach the model instead of being dropped.

        Raises:
            InvalidRequestError: no chat template, or the template rejects the messages.
        """
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError(
                f"model {self.model_id!r} has no chat template; pass text or token ids instead"
            )
        try:
            if needs_hermes_markup(str(template), messages, tools):
                messages, tools = with_hermes_markup(messages, tools or []), None
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja errors are not a stable type
            raise InvalidRequestError(f"chat template failed on these messages: {exc}") from exc
        _check_unicode(text, "chat messages")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text prompt, exactly as ``make_request`` tokenizes it.

        Raises:
            InvalidRequestError: ``text`` holds a lone UTF-16 surrogate (not Unicode text).
        """
        _check_unicode(text, "prompt text")
        return list(self.tokenizer.encode(text, add_special_tokens=True)) if text else []

    def namespace(self, cache_salt: str | None) -> Namespace:
        """The prefix-cache namespace of requests with ``cache_salt`` (model, revision, dtype)."""
        return namespace_of(self.model_id, self.revision, self._dtype_name, cache_salt)

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
        ``logits_processors`` edit each sampling step's logits row (with ``n > 1`` every choice
        shares them: give stateless ones, per-choice state belongs in ``grammar``). With
        ``n > 1`` the other choices are in ``request.forks``, choice ``i`` seeded with
        ``choice_seed(params.seed, i)``.

        Raises:
            InvalidRequestError: ``cache_salt`` is empty (it would share the unsalted namespace;
                the server refuses it too), ``n`` < 1, or the prompt/params are invalid (empty
                prompt, token ids outside the vocabulary, no chat template).
            PromptTooLongError: the prompt leaves no room in the context.
            ChunkReuseError: bad chunk spans, or chunk reuse unavailable for this model/mode.
        """
        spec = RequestSpec(prompt, params or SamplingParams(), n, cache_salt, grammar, chunk_reuse)
        return self.build(
            spec,
            use_prefix_cache=use_prefix_cache,
            record_logits=record_logits,
            logits_processors=logits_processors,
        )

    def build(
        self,
        spec: RequestSpec,
        *,
        use_prefix_cache: bool = True,
        record_logits: bool = False,
        logits_processors: Sequence[LogitsProcessor] = (),
    ) -> Request:
        """A waiting Request for ``spec`` (its ``n`` choices as ``forks``), checking only what
        needs the model: the prompt (tokenized or rendered; caller-given ids against the
        vocabulary), the context length and chunk reuse on this model. ``spec``'s own fields
        were checked when it was built (``RequestSpec``).

        Raises:
            InvalidRequestError, PromptTooLongError, ChunkReuseError: as ``make_request``.
        """
        prompt, params, n, grammar, chunk_reuse = (
            spec.prompt, spec.params, spec.n, spec.grammar, spec.chunk_reuse
        )  # fmt: skip
        ids = self._prompt_ids(prompt)
        self._check(ids, params)
        if chunk_reuse is not None:
            self._check_chunks(chunk_reuse, ids, params)
        namespace = self.namespace(spec.cache_salt)
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


def _check_unicode(text: str, what: str) -> None:
    """Refuse a lone surrogate (``"\\ud800"``, e.g. from an unpaired JSON escape): fast
    tokenizers raise a bare ``TypeError`` ("TextEncodeInput must be ...") on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{what} has a lone UTF-16 surrogate {exc.object[exc.start]!r} at character "
            f"{exc.start}, which is not valid Unicode text"
        ) from exc


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


def _processors(
    shared: Sequence[LogitsProcessor], grammar: Grammar | None
) -> list[LogitsProcessor]:
    """One choice's logits processors: the caller's, then a fresh matcher of ``grammar``."""
    return [*shared, *([] if grammar is None else [grammar.matcher()])]


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
