"""Bearer keys of the server: API keys (each its own tenant), the admin key, who may call what.

Keys are compared in constant time and never appear in error messages or logs (only their position
in the list or file). It knows request headers and the OpenAI error shape; how a key becomes a
prefix-cache namespace is ``tenant_salt`` (a hash of key and salt); reading key files is the CLI's
(``cli.read_key_file``, which must not import torch as this module does).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import Literal

from starlette.requests import Request

from runtime.serve.api_error import ApiError

__all__ = ["KeyRing", "ResetScope", "tenant_salt"]


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _is_one_of(key: str | None, keys: Sequence[bytes]) -> bool:
    # NOTE: compare against every key (no early exit) so timing does not tell which one matched.
    if key is None:
        return False
    raw = key.encode()
    return sum(hmac.compare_digest(raw, k) for k in keys) > 0


ResetScope = Literal["all", "tenant"]
"""What a cache reset drops: every namespace (``"all"``) or the caller's own (``"tenant"``)."""


class KeyRing:
    """Who may call what, from the ``Authorization: Bearer <key>`` header.

    - ``/v1`` routes and ``/tokenize``: open without API keys; with keys, one of them.
    - ``/metrics`` (every tenant's traffic) and the global cache reset (every tenant's prefixes):
      the admin key alone when one is set (an API key gets 403); with API keys but no admin key
      nobody (403 naming ``--admin-key``: a tenant must not see or flush the others); with no
      key at all, open (a loopback server has no caller to tell apart).
    - A tenant's cache reset: with API keys, each key may reset its own namespace.

    Args:
        api_keys: the tenants' keys (may be empty).
        admin_keys: keys that open ``/metrics`` and the global reset (``--admin-key``, and
            ``--metrics-key``, its older name with the same rights); may be empty.
        on_refused: called once per refused request (the server counts them).

    Raises:
        ValueError: a key that is empty or contains whitespace (named by position only).
    """

    def __init__(
        self,
        api_keys: Sequence[str],
        *,
        admin_keys: Sequence[str] = (),
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        for i, key in enumerate([*api_keys, *admin_keys]):
            if not key or any(c.isspace() for c in key):
                raise ValueError(f"key #{i + 1} is empty or contains whitespace")
        self._api = [key.encode() for key in api_keys]
        self._admin = [key.encode() for key in admin_keys]
        self._on_refused = on_refused

    @property
    def has_api_keys(self) -> bool:
        """True when ``/v1`` calls need a key."""
        return bool(self._api)

    def check_api(self, request: Request) -> str | None:
        """The caller's API key (None when keys are off and none was sent).

        Raises:
            ApiError: 401 when keys are configured and the bearer token is none of them.
        """
        key = _bearer(request)
        if self._api and not _is_one_of(key, self._api):
            self._refuse()
        return key

    def check_metrics(self, request: Request) -> None:
        """Allow ``/metrics`` to the admin key; open only when no key is configured at all.

        Raises:
            ApiError: 403 when the caller sent an API key (a valid key, just not one for
                this: 401 would say it is wrong), saying why and naming ``--admin-key``; 401
                when the bearer token is no key at all.
        """
        if self._is_admin(request):
            return
        self._refuse_global("read /metrics (it shows every tenant's traffic)", request)

    def check_reset(self, request: Request) -> tuple[ResetScope, str | None]:
        """Who resets what: ``("all", None)`` for the admin key (or a server with no key at
        all), ``("tenant", api_key)`` for an API key (its own namespace only).

        Raises:
            ApiError: 401 for a bearer token that is no key; 403 for a caller without the admin
                key on a server that has one but no API keys (there is no tenant to reset).
        """
        if self._is_admin(request):
            return "all", None
        key = _bearer(request)
        if self._api and _is_one_of(key, self._api):
            return "tenant", key
        self._refuse_global("reset every tenant's cache", request)
        raise AssertionError("unreachable")

    def _is_admin(self, request: Request) -> bool:
        if not self._api and not self._admin:
            return True
        return _is_one_of(_bearer(request), self._admin)

    def _refuse_global(self, what: str, request: Request) -> None:
        if not _is_one_of(_bearer(request), [*self._api, *self._admin]):
            self._refuse()
        if self._admin:
            self._forbid(f"only the admin key may {what}; use the key given to --admin-key")
        self._forbid(
            f"with API keys (tenants) set, only an admin key may {what}, and this server has "
            "none: start `agentcache serve` with --admin-key KEY"
        )

    def _forbid(self, message: str) -> None:
        self._on_refused()
        raise ApiError(403, message, type="permission_error", code="insufficient_permissions")

    def _refuse(self) -> None:
        self._on_refused()
        raise ApiError(
            401, "invalid or missing API key", type="authentication_error", code="invalid_api_key"
        )


_SALT_DOMAIN = b"agentcache.runtime.tenant.v1"


def tenant_salt(api_key: str | None, cache_salt: str | None) -> str | None:
    """The engine's ``cache_salt`` for a request: a hash of the caller's key and its salt.

    The key and the client's ``cache_salt`` are framed (length-prefixed) and hashed together
    with SHA-256, so the same ``cache_salt`` sent with two keys gives two namespaces, and no key
    can name another key's namespace. Returns None (the shared namespace) when both are None.
    """
    if api_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(_SALT_DOMAIN)
    for part in (api_key, cache_salt):
        raw = b"\xff" if part is None else b"\x00" + part.encode()
        digest.update(len(raw).to_bytes(8, "big") + raw)
    return digest.hexdigest()
