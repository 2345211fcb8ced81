"""Checks of ``agentcache demo``'s options that run before anything slow (corpus, torch, model).

Each check is a file-system or string test taking milliseconds; it raises ``ConfigError`` with
one line that names the option and the fix. Knows nothing about how the demo uses the values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal, cast

from agentcache import env
from agentcache.backends.local import check_model_name
from agentcache.cache.disk import file_on_path
from agentcache.exceptions import ConfigError

__all__ = ["base_url_of", "cache_dir_of", "check_options", "chunk_reuse_of"]


def check_options(args: argparse.Namespace) -> None:
    """Reject unusable options before anything is loaded.

    Raises:
        ConfigError: ``--max-tokens`` below 1, ``--docs`` without questions on a non-terminal
            stdin, an empty ``--question``, a cache directory that cannot be created, or a
            local model name that is neither bundled, a folder nor a hub id, or
            ``--chunk-reuse`` or ``--weights`` with an endpoint (``--base-url`` /
            ``AGENTCACHE_BASE_URL``).
    """
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if any(not question.strip() for question in args.question or []):
        raise ConfigError("--question needs a non-empty text")
    if args.docs and not (args.question or args.interactive or sys.stdin.isatty()):
        raise ConfigError(
            "with --docs, give your questions: --question TEXT (repeatable) or --interactive"
        )
    base_url = base_url_of(args)
    mode = chunk_reuse_of(args)
    if mode is not None and base_url:
        # NOTE: spans are token offsets the local backend finds in its own rendering; the SDK's
        # HTTP backends do not send them (the server's `chunk_reuse` field takes them raw).
        raise ConfigError(
            f"--chunk-reuse {mode} needs the local engine, but the demo would use the endpoint "
            f"{base_url!r}: drop --chunk-reuse, or drop --base-url and unset AGENTCACHE_BASE_URL"
        )
    weights = getattr(args, "weights", None)
    if weights is not None and base_url:
        raise ConfigError(
            f"--weights {weights} needs the local engine, but the demo would use the endpoint "
            f"{base_url!r}: drop --weights, or drop --base-url and unset AGENTCACHE_BASE_URL"
        )
    cache_dir_of(args)
    if not base_url:
        check_model_name(args.model or "smollm2-135m")  # NOTE: demo.DEFAULT_MODEL


def base_url_of(args: argparse.Namespace) -> str | None:
    """``--base-url``, else ``AGENTCACHE_BASE_URL``, else None (the local engine)."""
    return args.base_url or env.base_url()


def chunk_reuse_of(args: argparse.Namespace) -> Literal["exact", "blend"] | None:
    """``--chunk-reuse`` (``"exact"`` or ``"blend"``), or None when off (the default).

    Raises:
        ConfigError: Any other value (the CLI passes the text as given, so this is its error).
    """
    mode = getattr(args, "chunk_reuse", None)
    if mode not in (None, "exact", "blend"):
        raise ConfigError(f"--chunk-reuse must be exact or blend, got {mode!r}")
    return cast('Literal["exact", "blend"] | None', mode)


def cache_dir_of(args: argparse.Namespace) -> Path:
    """The tool/retrieval cache folder, created if needed.

    Raises:
        ConfigError: The path (or a folder above it) is a file, or it cannot be created.
    """
    folder = Path(args.cache_dir).expanduser() if args.cache_dir else env.cache_dir()
    blocker = file_on_path(folder)
    if blocker is not None:
        raise ConfigError(f"cache directory {str(folder)!r}: {str(blocker)!r} is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create cache directory {str(folder)!r}: {exc.strerror or exc}; "
            "pass --cache-dir DIR or set AGENTCACHE_CACHE_DIR"
        ) from exc
    return folder
