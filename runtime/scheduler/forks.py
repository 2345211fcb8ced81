"""Forks: the other choices of an ``n > 1`` request, admitted and decoded with it as one group.

A request's group is itself and its forks: checked as one when submitted (rows, KV budget),
admitted together (a cancelled fork is released unadmitted), and its forks copy the head's
prompt KV once its prefill is done, so the prompt runs once for every choice. It knows requests,
their KV rows and the prefix cache's pins, never the queue, the loop, the model or sampling.
"""

from __future__ import annotations

from runtime.cache.prefix_cache import PrefixCache
from runtime.exceptions import PromptTooLongError, TooManyChoicesError
from runtime.request.state import Request, RequestStatus

__all__ = ["check_group", "copy_prompt", "live_forks", "running_group"]


def check_group(
    req: Request, *, max_batch_size: int, position_bytes: int, batch_kv_bytes: int
) -> None:
    """Raise unless ``req`` and its forks could ever run together.

    Args:
        req: A request about to be queued (``max_total_len`` positions per choice).
        max_batch_size: Most rows decoded at once.
        position_bytes: KV bytes of one position of one row.
        batch_kv_bytes: Byte budget of the running requests' KV rows.

    Raises:
        TooManyChoicesError: the group has more choices than ``max_batch_size`` rows, or its
            KV rows exceed ``batch_kv_bytes`` where one choice's alone would not.
        PromptTooLongError: one choice's KV row alone exceeds ``batch_kv_bytes``.
    """
    size = 1 + len(req.forks)
    if size > max_batch_size:
        raise TooManyChoicesError(
            f"n={size} choices are decoded together, but this engine decodes at most "
            f"{max_batch_size} row{'s' if max_batch_size != 1 else ''} at once "
            "(max_batch_size); lower n"
        )
    row = req.max_total_len * position_bytes
    if size * row <= batch_kv_bytes:
        return
    message = (
        f"prompt + max_tokens ({req.max_total_len} positions) x {size} choices need "
        f"{size * row} bytes of KV, over batch_kv_bytes={batch_kv_bytes}; "
    )
    # NOTE: n is to blame (a server names the field) only where one choice alone fits.
    if row > batch_kv_bytes:
        raise PromptTooLongError(message + "lower max_tokens, or raise it")
    fit = batch_kv_bytes // row
    raise TooManyChoicesError(message + f"lower n (at most {fit} fit) or max_tokens, or raise it")


def live_forks(req: Request) -> list[Request]:
    """The forks of ``req`` still wanted; cancelled ones are released unadmitted (side effect:
    their status becomes RELEASED and their ``released`` event is set)."""
    live = []
    for fork in req.forks:
        if fork.is_cancelled:
            fork.status = RequestStatus.RELEASED
            fork.released.set()
        else:
            live.append(fork)
    return live


def running_group(req: Request) -> list[Request]:
    """``req`` and its forks that are running (admitted, not released)."""
    return [req, *(f for f in req.forks if f.status is RequestStatus.RUNNING)]


def copy_prompt(req: Request, forks: list[Request], prefix_cache: PrefixCache) -> None:
    """Copy ``req``'s prompt KV (just prefilled) into each fork's row, with its cached length,
    prompt logprobs and chunk usage; pin ``req``'s prefix-cache node once more for each fork."""
    assert req.kv is not None, "fork of a request without a row"
    length = req.kv.length
    for fork in forks:
        assert fork.kv is not None, "fork admitted without a row"
        fork.kv.span(0, length).copy_(req.kv.span(0, length))
        fork.kv.length = length
        fork.cached_len = req.cached_len
        fork.prompt_logprobs = req.prompt_logprobs
        fork.chunk_usage = req.chunk_usage
        fork.node = prefix_cache.acquire(req.node)
