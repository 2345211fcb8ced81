"""RequestSpec: the one typed record a caller (the server, the SDK) hands the engine per prompt.

Plain data without torch: the prompt, its sampling params, ``n`` choices, the tenant's
``cache_salt``, a compiled grammar and the chunk-reuse spans. Its own fields are checked once,
here, when it is built (the server builds it after validating the HTTP body); the engine then
checks only what needs the model (token ids against the vocabulary, the context length, chunk
reuse on this model) and never re-checks these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.chunks.spans import ChunkReuse
from runtime.exceptions import InvalidRequestError
from runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    from runtime.sampling.grammar import Grammar

__all__ = ["Prompt", "RequestSpec"]

Prompt = str | Sequence[int] | list[dict[str, Any]]
"""Text, token ids, or chat messages (rendered with the model's chat template)."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One prompt to generate ``n`` choices of (``Engine.submit``).

    Raises:
        InvalidRequestError: on construction, for ``n`` < 1, an empty ``cache_salt`` (it would
            share the unsalted namespace; the server refuses it too) or params that are not
            ``SamplingParams``.
    """

    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    """Choices sampled from one prefill (choice ``i`` seeded ``choice_seed(params.seed, i)``)."""
    cache_salt: str | None = None
    """The tenant's namespace of cached KV (None: the unsalted one)."""
    grammar: Grammar | None = None
    """A compiled constraint every choice decodes under (``Engine.compile_grammar``)."""
    chunk_reuse: ChunkReuse | None = None
    """Document spans whose KV comes from the chunk store (``runtime.chunks``)."""

    def __post_init__(self) -> None:
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError(
                f"cache_salt must be a non-empty str or None (no salt), got {salt!r}"
            )
        n = self.n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an int >= 1, got {n!r}")
        if not isinstance(self.params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {self.params!r}")
