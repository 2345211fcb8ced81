"""Cache keys for tool and retrieval results: SHA-256 over canonical, length-framed parts.

Every key starts with a versioned kind tag and the cache's namespace, so tool and retrieval
entries, and different cache objects sharing one store, never collide. Keys are hex digests from
``agentcache.canonical.stable_hash`` (never Python's ``hash()``). Knows nothing about stores.
"""

from __future__ import annotations

import inspect
import unicodedata
from collections.abc import Callable, Iterable
from typing import Any

from agentcache.canonical import canonical_json, stable_hash, to_canonical
from agentcache.exceptions import CanonicalizationError

__all__ = [
    "arguments_json",
    "index_fingerprint",
    "normalize_query",
    "retrieval_key",
    "signature_fingerprint",
    "tool_key",
]

_TOOL_TAG = "agentcache.tool.v2"
_RETRIEVAL_TAG = "agentcache.retrieval.v1"
_INDEX_TAG = "agentcache.index.v1"


def arguments_json(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any], *, what: str
) -> str:
    """Canonical JSON of a call's arguments, bound by name with defaults applied.

    ``f(1, b=2)`` and ``f(a=1, b=2)`` give the same text; ``*args`` become a list and
    ``**kwargs`` an object under their parameter names. Tuples and lists render alike (the
    canonical rule), so ``f((1, 2))`` and ``f([1, 2])`` share an entry.

    Raises:
        TypeError: the arguments do not fit the signature (as calling the function would).
        CanonicalizationError: an argument has no canonical JSON form; the message names it.
    """
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    canonical: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        try:
            canonical[name] = to_canonical(value, name)
        except CanonicalizationError as exc:
            raise CanonicalizationError(
                f"{what}: argument {name!r} cannot be part of a cache key: {exc}"
            ) from exc
    return canonical_json(canonical)


def signature_fingerprint(fn: Callable[..., Any]) -> str:
    """Hash of a function's qualified name and signature text (names, kinds, defaults, hints).

    Used as the tool version when none is given: changing the parameters invalidates old entries,
    but changing only the body does not; pass an explicit ``version`` for that.
    """
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return stable_hash("agentcache.signature.v1", name, str(inspect.signature(fn)))[:16]


def tool_key(
    namespace: str, name: str, version: str, args_json: str, scope_json: str, state_json: str = "[]"
) -> str:
    """Key of one tool call: tag, namespace, name, version, arguments, scope, state versions."""
    return stable_hash(_TOOL_TAG, namespace, name, version, args_json, scope_json, state_json)


def normalize_query(query: str, *, casefold: bool = False) -> str:
    """Query text as it enters a retrieval key.

    NFC-normalized, whitespace runs (any Unicode whitespace) collapsed to one space and stripped at
    both ends. Case is kept unless ``casefold`` is set, because embedding retrievers are
    case-sensitive; casefold only for retrievers that lowercase anyway (such as BM25 with a
    lowercasing tokenizer).
    """
    text = " ".join(unicodedata.normalize("NFC", query).split())
    return text.casefold() if casefold else text


def retrieval_key(
    namespace: str,
    retriever_id: str,
    index_fingerprint: str,
    query: str,
    k: int,
    filters_json: str,
    scope_json: str,
) -> str:
    """Key of one retrieval: tag, namespace, retriever, index, query, k, filters, scope."""
    return stable_hash(
        _RETRIEVAL_TAG,
        namespace,
        retriever_id,
        index_fingerprint,
        query,
        str(k),
        filters_json,
        scope_json,
    )


def index_fingerprint(chunks: Iterable[tuple[str, str]], **chunking_settings: Any) -> str:
    """Stable hash of a corpus as indexed: chunk ids and texts, in order, plus chunking settings.

    Order matters because retrievers break score ties by position; sort chunks by id (the RAG
    loader does) for a fingerprint that does not depend on file-system listing order. Texts are
    hashed exactly as given: any byte change re-keys every retrieval over the index.

    Args:
        chunks: ``(chunk_id, text)`` pairs.
        **chunking_settings: Anything that changes how the corpus was split or indexed (chunk size,
            overlap, tokenizer, embedder name); rendered as canonical JSON.

    Returns:
        A 64-character SHA-256 hex digest.

    Raises:
        CanonicalizationError: a setting has no canonical JSON form.
        TypeError: a chunk is not a pair of strings.
    """
    running = stable_hash(_INDEX_TAG, canonical_json(chunking_settings))
    for position, chunk in enumerate(chunks):
        chunk_id, text = chunk
        if not isinstance(chunk_id, str) or not isinstance(text, str):
            raise TypeError(f"chunk #{position} must be (id: str, text: str), got {chunk!r:.80}")
        running = stable_hash(running, chunk_id, text)
    return running
