"""Sampling parameters: what a request asks of the sampler, validated and frozen.

The batched sampler that applies them lives in ``runtime.sampling.sampler``; this module holds only
the values and their ranges (OpenAI's where OpenAI defines one, vLLM's otherwise). It knows nothing
about tensors, the cache or the tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.exceptions import InvalidRequestError

__all__ = [
    "LOGIT_BIAS_MAX",
    "MAX_LOGPROBS",
    "MIN_TEMPERATURE",
    "PENALTY_MAX",
    "SEED_MAX",
    "SEED_MIN",
    "SamplingParams",
]

SEED_MIN = -(1 << 63)
"""Smallest accepted ``seed``: the signed 64-bit range, as OpenAI's API documents for ``seed``."""
SEED_MAX = (1 << 63) - 1
"""Largest accepted ``seed`` (torch's generator takes at most 64 bits)."""
MIN_TEMPERATURE = 1e-2
"""A temperature in ``(0, MIN_TEMPERATURE)`` samples as this (vLLM's ``_MAX_TEMP`` rule)."""
PENALTY_MAX = 2.0
"""Presence and frequency penalties lie in ``[-PENALTY_MAX, PENALTY_MAX]`` (OpenAI's range)."""
LOGIT_BIAS_MAX = 100.0
"""``logit_bias`` values lie in ``[-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]`` (OpenAI)."""
MAX_LOGPROBS = 20
"""Most alternatives per token in ``logprobs`` / ``prompt_logprobs`` (OpenAI's ``top_logprobs``)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Raises:
        InvalidRequestError: on construction, for out-of-range values.
    """

    max_tokens: int = 256
    """Most tokens to generate (>= 1); generation also stops when the context is full."""
    temperature: float = 0.0
    """0.0 means greedy (argmax); otherwise logits are divided by it before sampling (finite,
    >= 0; values in ``(0, MIN_TEMPERATURE)`` sample as ``MIN_TEMPERATURE``, vLLM's rule)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; the most likely token is always kept."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    min_p: float = 0.0
    """In [0, 1]: drop tokens whose probability is below ``min_p`` x the top token's (vLLM)."""
    presence_penalty: float = 0.0
    """In [-2, 2]: subtracted once from the logit of every id already generated (OpenAI)."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: subtracted per occurrence from the logit of every generated id (OpenAI)."""
    repetition_penalty: float = 1.0
    """> 0; ids in the prompt or output get positive logits divided, negative ones multiplied
    by it (HF ``RepetitionPenaltyLogitsProcessor`` / vLLM semantics); 1.0 disables. Any value
    is safe: where it would scale a logit past float32's range, the sampler uses the nearest
    value that does not (the same tokens win: ``runtime.sampling.sampler``)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> value in [-100, 100] added to its logit before sampling (OpenAI)."""
    min_tokens: int = 0
    """Stop ids (EOS, ``stop_token_ids``) are masked until this many tokens were generated,
    and stop strings are not checked before (vLLM); at most ``max_tokens``."""
    logprobs: int | None = None
    """None: no logprobs. k in [0, 20]: each generated token's logprob of the raw model
    distribution and the k most likely alternatives."""
    prompt_logprobs: int | None = None
    """None: none. k in [0, 20]: the logprob of every prompt token after the first (raw model
    distribution) and k alternatives. Every prompt position must then be computed, so such a
    request skips the prefix cache (vLLM does the same): its ``cached_tokens`` is 0."""
    seed: int | None = None
    """Seed of this request's random generator (sampling only); None draws one.

    A signed 64-bit int in ``[SEED_MIN, SEED_MAX]``. Negative seeds are accepted (OpenAI's range)
    and used as their two's-complement 64-bit value, as ``torch.Generator.manual_seed`` does, so
    each seed in the range names a distinct generator state."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends when one appears; it is cut from the text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end generation (the model's EOS ids do too unless ``ignore_eos``)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS ids (benchmarks, tests); ``stop_token_ids`` and
    ``stop`` still end generation."""

    def __post_init__(self) -> None:
        max_tokens = self.max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise InvalidRequestError(
                f"temperature must be finite and >= 0, got {self.temperature!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self._check_processing()
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise InvalidRequestError(
                f"seed must be an int in [{SEED_MIN}, {SEED_MAX}] (signed 64-bit), "
                f"got {self.seed!r}"
            )
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError(
                f"stop must be a list of non-empty strings, got {self.stop!r}"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )

    def _check_processing(self) -> None:
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -PENALTY_MAX, PENALTY_MAX)
        _check_range("frequency_penalty", self.frequency_penalty, -PENALTY_MAX, PENALTY_MAX)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise InvalidRequestError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty!r}"
            )
        for tok, value in self.logit_bias.items():
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            _check_range(f"logit_bias[{tok}]", value, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX)
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise InvalidRequestError(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and not (_is_int(count) and 0 <= count <= MAX_LOGPROBS):
                raise InvalidRequestError(
                    f"{name} must be an int in [0, {MAX_LOGPROBS}], got {count!r}"
                )

    @property
    def is_greedy(self) -> bool:
        """True when temperature is 0 (argmax decoding)."""
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not (isinstance(value, int | float) and low <= value <= high):
        raise InvalidRequestError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
