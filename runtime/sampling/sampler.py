"""Batched sampler: one decode step's raw logits ``[n, vocab]`` -> one token (+ logprobs) per row.

Each row is a request's view (``SamplerRow``): its params, random generator, token history and
per-row logits processors. Penalties, ``logit_bias``, ``min_tokens``, temperature, ``min_p``,
top-k and top-p run as tensor ops over the whole batch; a row that cannot be sampled becomes a
``SamplingError`` for that row alone. It knows nothing about the cache, the scheduler or HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from runtime.exceptions import SamplingError
from runtime.outputs import TokenLogprob
from runtime.sampling.params import MIN_TEMPERATURE, SamplingParams

__all__ = [
    "LogitsProcessor",
    "Sampled",
    "SamplerRow",
    "TokenCounts",
    "logprobs_of",
    "process_logits",
    "prompt_logprobs",
    "sample_batch",
    "sampling_probs",
]


class LogitsProcessor(Protocol):
    """A per-request edit of its logits row before sampling (grammar masks, custom biases).

    Called once per sampled token, in the scheduler thread, with the request's generated ids so
    far and its ``[vocab]`` float32 logits row, which it edits in place (e.g. sets disallowed ids
    to ``-inf``). It runs before ``logit_bias``, ``min_tokens`` and the penalties (vLLM v1 applies
    its structured-output bitmask before the sampler too). An exception it raises, or a row left
    with no finite logit, fails this request alone with ``SamplingError``.
    """

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> None: ...


@dataclass(slots=True)
class TokenCounts:
    """A request's token statistics for the penalties, updated incrementally (O(new tokens))."""

    output: torch.Tensor
    """``[vocab]`` float32: how often each id was generated (frequency/presence penalties)."""
    seen: torch.Tensor
    """``[vocab]`` bool: id occurs in the prompt or the output (repetition penalty)."""
    num_counted: int = 0
    """Generated ids already added to ``output``."""

    @classmethod
    def of(cls, prompt_ids: Sequence[int], vocab_size: int, device: torch.device) -> TokenCounts:
        """Counts of a request that has generated nothing yet."""
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [vocab]
        ids = [t for t in prompt_ids if t < vocab_size]
        seen[torch.tensor(ids, dtype=torch.long, device=device)] = True
        return cls(torch.zeros(vocab_size, dtype=torch.float32, device=device), seen)

    def sync(self, output_ids: Sequence[int]) -> None:
        """Add the ids generated since the last call."""
        new = [t for t in output_ids[self.num_counted :] if t < self.output.numel()]
        if new:
            index = torch.tensor(new, dtype=torch.long, device=self.output.device)
            self.output.index_add_(0, index, torch.ones(len(new), device=self.output.device))
            self.seen[index] = True
        self.num_counted = len(output_ids)


class SamplerRow(Protocol):
    """What the sampler reads (and the one cache it writes) of a request; ``Request`` is one."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int]
    """Ids that end generation: masked while fewer than ``params.min_tokens`` were generated."""
    logits_processors: list[LogitsProcessor]
    token_counts: TokenCounts | None
    """Created by the sampler on the first step that needs penalties."""


class Sampled(NamedTuple):
    """One row's pick: the token id and, when the request asked, its logprobs."""

    token_id: int
    logprob: TokenLogprob | None


def sample_batch(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> list[Sampled | SamplingError]:
    """Pick one token per row of ``logits``.

    Order (vLLM v1's ``Sampler.forward``): per-row logits processors, ``logit_bias`` and
    ``min_tokens`` masks, then penalties; greedy rows take the argmax of the result; sampled rows
    apply temperature, ``min_p``, top-k, top-p and draw from their own generator. Logprobs are of
    the raw model distribution (``log_softmax`` of ``logits`` before any processing), vLLM's
    default ``raw_logprobs`` and what OpenAI reports.

    Numerical safety: every accepted value is safe. A temperature in ``(0, MIN_TEMPERATURE)`` is
    clamped to ``MIN_TEMPERATURE`` = 0.01 (the rule of vLLM's ``SamplingParams.__post_init__``,
    whose ``_MAX_TEMP`` = 1e-2 guards against "nan or inf in tensors"); 0 stays greedy. Logits are
    also shifted by their row maximum before dividing, so the top token's score is exactly 0 and
    softmax never sees ``inf - inf``; top-p keeps the top token however small ``top_p`` is. A
    ``repetition_penalty`` that would scale a row's logits past float32's range (HF and vLLM
    accept any value > 0 and then compute inf or NaN) is limited for that row to the nearest
    value that keeps them finite (``_repetition_penalties``).

    Args:
        logits: ``[n, vocab]`` raw logits of the last position of each row (any float dtype).
        rows: the ``n`` requests, in row order.

    Returns:
        ``n`` entries in row order: a ``Sampled``, or the ``SamplingError`` that ends that row
        (its logits held NaN or +inf, every token was masked, or a processor raised).
    """
    raw = logits.float()  # [n, vocab]
    scores, errors = _edited(raw, rows)
    # NOTE: one reduction gives both each row's argmax (the first index of the maximum, as
    # ``torch.argmax``) and its health (``_bad_rows``' rule): a second pass over the
    # vocabulary cost a greedy step ~0.1 ms on SmolLM2-135M (49,152 ids).
    top = scores.max(dim=-1)  # values, indices: [n] each
    tokens: list[int] = top.indices.tolist()
    for i, value in enumerate(top.values.tolist()):
        if not math.isfinite(value):
            errors.setdefault(i, _bad_row_error(raw[i], scores[i]))
    _draw(scores, rows, tokens, errors)
    logprobs = _raw_logprobs(raw, rows, tokens, errors)
    return [
        errors[i] if i in errors else Sampled(tokens[i], logprobs.get(i)) for i in range(len(rows))
    ]


def process_logits(
    logits: torch.Tensor, rows: Sequence[SamplerRow]
) -> tuple[torch.Tensor, dict[int, SamplingError]]:
    """The logits greedy decoding takes the argmax of: processors, bias, masks, penalties.

    Args:
        logits: ``[n, vocab]`` raw logits (not modified).
        rows: the ``n`` requests; their ``token_counts`` are created or brought up to date.

    Returns:
        ``[n, vocab]`` float32 processed logits, and the rows that cannot be sampled.
    """
    scores, errors = _edited(logits, rows)
    for i in _bad_rows(scores):
        errors.setdefault(i, _bad_row_error(logits[i], scores[i]))
    return scores, errors


def _edited(
    logits: torch.Tensor, rows: Sequence[SamplerRow]
) -> tuple[torch.Tensor, dict[int, SamplingError]]:
    """``process_logits`` but for the health check: processed ``[n, vocab]`` float32 logits
    (``logits`` itself when no row edits them) and the rows whose processor raised."""
    scores = logits.float()  # [n, vocab]
    errors: dict[int, SamplingError] = {}
    if any(_edits_in_place(row) for row in rows):
        scores = scores.clone() if scores is logits else scores  # NOTE: never edit the input
        _run_processors(scores, rows, errors)
        _apply_bias_and_min_tokens(scores, rows)
    return _apply_penalties(scores, rows), errors


def sampling_probs(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, min_p, top-k, top-p.

    Args:
        scores: ``[k, vocab]`` processed logits (``process_logits``) of rows with finite maxima.
        params: the ``k`` rows' parameters (temperature > 0).

    Returns:
        ``[k, vocab]`` probabilities, each row summing to 1.
    """
    temps = _column([max(p.temperature, MIN_TEMPERATURE) for p in params], scores)
    # NOTE: shift first: the row maximum becomes exactly 0, so x / t stays finite at the top.
    shifted = (scores - scores.max(dim=-1, keepdim=True).values) / temps
    probs = _top_k_top_p_min_p(shifted, params)
    return probs / probs.sum(dim=-1, keepdim=True)


def logprobs_of(
    logprobs: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[TokenLogprob]:
    """Logprob entries of ``token_ids`` (one per row of ``logprobs``) with their top alternatives.

    Args:
        logprobs: ``[k, vocab]`` log-probabilities.
        token_ids: ``k`` chosen ids.
        num_top: alternatives per entry (0 = none), most likely first.
    """
    index = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, index.unsqueeze(1)).squeeze(1).tolist()
    top_vals: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if num_top:
        top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprob(tok, lp, tuple(zip(ids, vals, strict=True)))
        for tok, lp, ids, vals in zip(token_ids, chosen, top_ids, top_vals, strict=True)
    ]


def prompt_logprobs(
    logits: torch.Tensor, next_ids: Sequence[int], num_top: int
) -> list[TokenLogprob]:
    """Logprobs of the prompt ids each position predicts (raw model distribution).

    Args:
        logits: ``[k, vocab]`` raw logits of ``k`` consecutive prompt positions.
        next_ids: the ``k`` prompt ids that follow those positions.
        num_top: alternatives per entry.
    """
    return logprobs_of(torch.log_softmax(logits.float(), dim=-1), next_ids, num_top)


def _run_processors(
    scores: torch.Tensor, rows: Sequence[SamplerRow], errors: dict[int, SamplingError]
) -> None:
    for i, row in enumerate(rows):
        try:
            for processor in row.logits_processors:
                processor(row.output_ids, scores[i])
        except Exception as exc:  # noqa: BLE001 - a processor's failure ends its row only
            errors[i] = SamplingError(f"a logits processor of this request failed: {exc!r}")


def _apply_bias_and_min_tokens(scores: torch.Tensor, rows: Sequence[SamplerRow]) -> None:
    """``logit_bias`` added, stop ids set to -inf while ``min_tokens`` is not reached."""
    vocab = scores.shape[-1]
    bias_at: list[tuple[int, int]] = []
    bias: list[float] = []
    masked: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        for tok, value in row.params.logit_bias.items():
            if tok < vocab:
                bias_at.append((i, tok))
                bias.append(value)
        if len(row.output_ids) < row.params.min_tokens:
            masked.extend((i, tok) for tok in row.stop_ids if tok < vocab)
    if bias_at:
        r, c = zip(*bias_at, strict=True)
        values = torch.tensor(bias, dtype=scores.dtype, device=scores.device)
        scores.index_put_((_ids(r, scores), _ids(c, scores)), values, accumulate=True)
    if masked:
        r, c = zip(*masked, strict=True)
        scores[_ids(r, scores), _ids(c, scores)] = float("-inf")


def _apply_penalties(scores: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
    """Repetition (HF/vLLM: divide positive, multiply negative logits of ids in prompt or
    output), then frequency and presence (OpenAI: subtract per output occurrence / once)."""
    active = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    if not active:
        return scores
    vocab = scores.shape[-1]
    for i in active:
        row = rows[i]
        if row.token_counts is None:
            row.token_counts = TokenCounts.of(row.prompt_ids, vocab, scores.device)
        row.token_counts.sync(row.output_ids)
    picked = [rows[i] for i in active]
    counts = torch.stack([r.token_counts.output for r in picked if r.token_counts])  # [k, vocab]
    seen = torch.stack([r.token_counts.seen for r in picked if r.token_counts])  # [k, vocab]
    freq = _column([r.params.frequency_penalty for r in picked], scores)
    pres = _column([r.params.presence_penalty for r in picked], scores)
    part = scores[active]  # [k, vocab]
    rep = _repetition_penalties([r.params.repetition_penalty for r in picked], part)  # [k, 1]
    repeated = torch.where(part > 0, part / rep, part * rep)
    part = torch.where(seen, repeated, part)
    part = part - freq * counts - pres * (counts > 0).float()
    scores = scores.clone()
    scores[active] = part
    return scores


_F32 = torch.finfo(torch.float32)
_ROUNDING_ROOM = 2.0**-20
"""Relative margin for float32's rounding of the penalty and of the scaled logit (2^-24 each)."""


def _repetition_penalties(values: Sequence[float], scores: torch.Tensor) -> torch.Tensor:
    """``[k, 1]`` penalties for rows ``scores`` (``[k, vocab]``), each kept where its row stays
    finite.

    A penalty p divides a row's positive scores and multiplies its negative ones, so with m the
    row's largest finite ``|score|`` every result is finite for p in ``[m / F, F / m]`` (F =
    float32's largest value). HF's ``RepetitionPenaltyLogitsProcessor`` and vLLM's
    ``SamplingParams`` accept any p > 0 (vLLM: "repetition_penalty must be greater than zero")
    and return +inf (then NaN) outside that interval. Inside it p is used as given, so the
    scores are HF's and vLLM's; outside, the nearest end is used: the order of the scores is
    the same, and the seen token with the largest positive logit (p small) or the unseen tokens
    (p large) already take all the probability mass that float32 can express, as they do in
    the limit. It also keeps p itself a positive float32 (a value below 1.2e-38 or above 3.4e38
    would round to 0 or inf, and ``0 * inf`` is NaN).
    """
    if all(value == 1.0 for value in values):
        return _column(values, scores)
    finite = torch.where(torch.isfinite(scores), scores.abs(), 0.0)  # [k, vocab]
    largest = finite.amax(dim=-1, keepdim=True).double()  # [k, 1]
    low = (largest / _F32.max * (1 + _ROUNDING_ROOM)).clamp(min=_F32.tiny)
    high = (_F32.max / largest * (1 - _ROUNDING_ROOM)).clamp(max=_F32.max)  # m = 0: F
    wanted = torch.tensor(values, dtype=torch.float64, device=scores.device).unsqueeze(1)
    return torch.maximum(torch.minimum(wanted, high), low).to(scores.dtype)


def _edits_in_place(row: SamplerRow) -> bool:
    params = row.params
    return bool(
        row.logits_processors or params.logit_bias or len(row.output_ids) < params.min_tokens
    )


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _bad_rows(scores: torch.Tensor) -> list[int]:
    """Rows with NaN or +inf anywhere, or without any finite score (one reduction: a row's
    max is NaN if any entry is, +inf if any is, and -inf only if all are)."""
    bad = ~torch.isfinite(scores.max(dim=-1).values)  # [n]
    return [int(i) for i in torch.nonzero(bad).flatten().tolist()]


def _bad_row_error(raw: torch.Tensor, scores: torch.Tensor) -> SamplingError:
    if bool(torch.isnan(raw).any() or torch.isposinf(raw).any()):
        return SamplingError("the model produced non-finite logits (NaN or +inf) for this request")
    if bool(torch.isnan(scores).any() or torch.isposinf(scores).any()):
        return SamplingError("logits processing produced NaN or +inf for this request")
    return SamplingError("every token was masked for this request (no allowed token left)")


def _draw(
    scores: torch.Tensor,
    rows: Sequence[SamplerRow],
    tokens: list[int],
    errors: dict[int, SamplingError],
) -> None:
    """Replace ``tokens[i]`` by a draw for every healthy non-greedy row."""
    picked = [i for i, row in enumerate(rows) if not row.params.is_greedy and i not in errors]
    if not picked:
        return
    # NOTE: drawn on the CPU, where every request's generator lives.
    probs = sampling_probs(scores[picked], [rows[i].params for i in picked]).cpu()  # [k, vocab]
    for j, i in enumerate(picked):
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=rows[i].generator).item())


def _top_k_top_p_min_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Unnormalized probabilities ``[k, vocab]`` after min_p, top-k and top-p (in that order).

    The candidates are sorted only when top-k or top-p is on, and only the top ``max(top_k)``
    (``torch.topk``) when every row has a top-k: a full sort of the vocabulary dominates.
    """
    probs = torch.softmax(scores, dim=-1)  # [k, vocab]
    if any(p.min_p for p in params):
        min_p = _column([p.min_p for p in params], probs)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    if all(p.top_p == 1.0 and not p.top_k for p in params):
        return probs
    vocab = probs.shape[-1]
    if all(p.top_k for p in params):
        width = min(max(p.top_k for p in params), vocab)
        sorted_probs, order = torch.topk(probs, width, dim=-1)  # [k, width], descending
    else:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [k, vocab]
    top_k = _column([p.top_k if p.top_k else vocab for p in params], probs)
    top_p = _column([p.top_p for p in params], probs)
    rank = torch.arange(sorted_probs.shape[-1], device=probs.device).unsqueeze(0)  # [1, width]
    sorted_probs = sorted_probs.masked_fill(rank >= top_k, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    # NOTE: keep a token while the mass before it is < top_p; the top token always stays (a
    # top_p below float32's range rounds to 0 here, so it is kept explicitly).
    keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < top_p
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)


def _raw_logprobs(
    raw: torch.Tensor,
    rows: Sequence[SamplerRow],
    tokens: list[int],
    errors: dict[int, SamplingError],
) -> dict[int, TokenLogprob]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None and i not in errors]
    if not wanted:
        return {}
    logprobs = torch.log_softmax(raw[wanted], dim=-1)  # [k, vocab]
    num_top = max(rows[i].params.logprobs or 0 for i in wanted)
    entries = logprobs_of(logprobs, [tokens[i] for i in wanted], num_top)
    return {
        i: entry._replace(top=entry.top[: rows[i].params.logprobs or 0])
        for i, entry in zip(wanted, entries, strict=True)
    }


def _ids(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)  # [k, 1]
