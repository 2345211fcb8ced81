"""Sampling parameters (validated, frozen) and the sampler that turns logits into a token id.

The sampler sees one row of logits at a time; it knows nothing about the cache or the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.exceptions import InvalidRequestError

__all__ = ["SEED_MAX", "SEED_MIN", "SamplingParams", "sample"]

SEED_MIN = -(1 << 63)
"""Smallest accepted ``seed``: the signed 64-bit range, as OpenAI's API documents for ``seed``."""
SEED_MAX = (1 << 63) - 1
"""Largest accepted ``seed`` (torch's generator takes at most 64 bits)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Raises:
        InvalidRequestError: on construction, for out-of-range values.
    """

    max_tokens: int = 256
    """Most tokens to generate (>= 1); generation also stops when the context is full."""
    temperature: float = 0.0
    """0.0 means greedy (argmax); otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
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
        if not self.temperature >= 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
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

    @property
    def is_greedy(self) -> bool:
        """True when temperature is 0 (argmax decoding)."""
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token id.

    Args:
        logits: ``[vocab]`` float logits of the last position.
        params: the request's sampling parameters.
        generator: the request's random generator (unused when greedy).

    Returns:
        The chosen token id.
    """
    if params.is_greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # NOTE: keep a token while the mass before it is < top_p, so the top token always stays.
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
