"""Bearer keys of the server: API keys (each its own tenant), the metrics key, the admin rule.

Keys are compared in constant time and never appear in error messages or logs (only their
position in the list or file). It knows request headers and the OpenAI error shape; how a key
becomes a prefix-cache namespace is ``app.tenant_salt``'s business; reading key files is the
CLI's (``cli.read_key_file``, which must not import torch as this module does).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence

from starlette.requests import Request

from runtime.serve.api_error import ApiError

__all__ = ["KeyRing"]


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


class KeyRing:
    """Who may call what, from the ``Authorization: Bearer <key>`` header.

    - ``/v1`` routes and ``/tokenize``: open without API keys; with keys, one of them.
    - ``/metrics``: the metrics key when one is set (API keys are then not enough, since the
      metrics show every tenant's counts); else any API key when keys are set; else open.
    - admin routes (cache reset, which drops every tenant's cached prefixes): the metrics key
      when one is set (an API key is then refused with 403: a tenant may not empty the others'
      cache); else any API key when keys are set; else open.

    Args:
        api_keys: the tenants' keys (may be empty).
        metrics_key: a separate key for ``/metrics`` and the admin routes, or None.
        on_refused: called once per refused request (the server counts them).

    Raises:
        ValueError: a key that is empty or contains whitespace (named by position only).
    """

    def __init__(
        self,
        api_keys: Sequence[str],
        *,
        metrics_key: str | None = None,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        for i, key in enumerate([*api_keys, *([metrics_key] if metrics_key is not None else [])]):
            if not key or any(c.isspace() for c in key):
                raise ValueError(f"key #{i + 1} is empty or contains whitespace")
        self._api = [key.encode() for key in api_keys]
        self._metrics = [metrics_key.encode()] if metrics_key is not None else []
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
        """Allow ``/metrics`` to the metrics key, else as ``/v1`` routes.

        Raises:
            ApiError: 403 when a metrics key is set and the caller sent an API key instead
                (a valid key, just not this one: 401 would say it is wrong); 401 when the
                bearer token is no key the rule accepts.
        """
        key = _bearer(request)
        allowed = self._metrics or self._api
        if not allowed or _is_one_of(key, allowed):
            return
        if self._metrics and _is_one_of(key, self._api):
            self._forbid("an API key may not read /metrics (it shows every tenant's counts)")
        self._refuse()

    def check_admin(self, request: Request) -> None:
        """Allow the admin routes (cache reset) to the metrics key, else as ``/v1`` routes.

        Raises:
            ApiError: 403 when a metrics key is set and the caller sent an API key instead;
                401 when the bearer token is no key the rule accepts.
        """
        key = _bearer(request)
        if not self._metrics:
            if self._api and not _is_one_of(key, self._api):
                self._refuse()
            return
        if _is_one_of(key, self._metrics):
            return
        if _is_one_of(key, self._api):
            self._forbid(
                "an API key may not reset the server's cache (it holds every tenant's prefixes)"
            )
        self._refuse()

    def _forbid(self, what: str) -> None:
        self._on_refused()
        raise ApiError(
            403,
            f"{what}; use the metrics key (--metrics-key)",
            type="permission_error",
            code="insufficient_permissions",
        )

    def _refuse(self) -> None:
        self._on_refused()
        raise ApiError(
            401, "invalid or missing API key", type="authentication_error", code="invalid_api_key"
        )
