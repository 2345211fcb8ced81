"""``agentcache.wrap(client)``: the proxy's rewriting in-process, for apps that want no extra hop.

Wraps an ``openai.OpenAI`` / ``openai.AsyncOpenAI`` client (``chat.completions.create``) or an
``anthropic.Anthropic`` / ``anthropic.AsyncAnthropic`` client (``messages.create``): the call's
body is rewritten exactly as ``agentcache proxy`` would, the session's prefix breaks are recorded,
and the client's own return types come back unchanged. Every other attribute is the client's.
It imports neither SDK: clients are recognised by the resources they have.
"""

from __future__ import annotations

import inspect
from typing import Any

from agentcache.proxy.rewrite import Provider, RewriteOptions, rewrite
from agentcache.proxy.sessions import SessionLog, derive_session_id
from agentcache.proxy.usage_tap import UsageBook
from agentcache.usage import Usage
from agentcache.usage_mapping import usage_from_anthropic, usage_from_openai

__all__ = ["WrappedClient", "wrap"]

# NOTE: keyword arguments of the clients' create() that are transport options, not body fields.
_TRANSPORT_KWARGS = frozenset({"extra_headers", "extra_query", "extra_body", "timeout"})


class _Recorder:
    """What one wrapped client remembers: sessions, breaks and usage totals."""

    def __init__(self, provider: Provider, options: RewriteOptions, session: str | None) -> None:
        self.provider = provider
        self.options = options
        self.session = session
        self.sessions = SessionLog()
        self.book = UsageBook()

    def prepare(self, kwargs: dict[str, Any], api_key: str | None) -> dict[str, Any]:
        body = {k: v for k, v in kwargs.items() if k not in _TRANSPORT_KWARGS}
        session = self.session or derive_session_id(body, api_key)
        sent = rewrite(body, self.provider, session_id=session, options=self.options).body
        self.sessions.observe(session, body, sent)
        return {**{k: v for k, v in kwargs.items() if k in _TRANSPORT_KWARGS}, **sent}

    def account(self, model: str, result: Any) -> None:
        dump = getattr(result, "model_dump", None)
        if not callable(dump):
            return  # a stream: its usage arrives chunk by chunk and is not collected here
        payload = dump()
        mapper = usage_from_anthropic if self.provider == "anthropic" else usage_from_openai
        usage: Usage | None = mapper(payload) if isinstance(payload.get("usage"), dict) else None
        self.book.record(model, usage)


class _Create:
    """Stands in for a resource (``chat.completions`` or ``messages``) with a rewriting create."""

    def __init__(self, resource: Any, recorder: _Recorder, api_key: str | None) -> None:
        self._resource = resource
        self._recorder = recorder
        self._api_key = api_key
        self._is_async = inspect.iscoroutinefunction(resource.create)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resource, name)

    def create(self, **kwargs: Any) -> Any:
        """The client's ``create`` on the rewritten body; returns what the client returns."""
        sent = self._recorder.prepare(kwargs, self._api_key)
        model = str(sent.get("model") or "")
        if self._is_async:
            return self._acreate(sent, model)
        result = self._resource.create(**sent)
        self._recorder.account(model, result)
        return result

    async def _acreate(self, sent: dict[str, Any], model: str) -> Any:
        result = await self._resource.create(**sent)
        self._recorder.account(model, result)
        return result


class _Chat:
    def __init__(self, chat: Any, completions: _Create) -> None:
        self._chat = chat
        self.completions = completions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._chat, name)


class WrappedClient:
    """A client whose request bodies are made cache-friendly; everything else is the client's."""

    def __init__(self, client: Any, recorder: _Recorder) -> None:
        self._client = client
        self._recorder = recorder
        key = getattr(client, "api_key", None)
        key = key if isinstance(key, str) else None
        if recorder.provider == "openai":
            self.chat = _Chat(client.chat, _Create(client.chat.completions, recorder, key))
        else:
            self.messages = _Create(client.messages, recorder, key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def cache_report(self) -> dict[str, Any]:
        """Requests seen, prefix breaks by reason with recent records, and usage per model."""
        models = {
            model: {
                "requests": t.requests,
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "hit_rate": t.hit_rate,
                "cost_usd": t.cost_usd,
                "saved_usd": t.saved_usd,
            }
            for model, t in self._recorder.book.snapshot().items()
        }
        return {**self._recorder.sessions.report(), "models": models}


def wrap(
    client: Any, *, session: str | None = None, options: RewriteOptions | None = None
) -> WrappedClient:
    """Wrap an OpenAI or Anthropic client (sync or async) so its requests are cache-friendly.

    Args:
        client: ``openai.OpenAI``/``AsyncOpenAI`` or ``anthropic.Anthropic``/``AsyncAnthropic``.
        session: Session id for the break log and OpenAI's ``prompt_cache_key``; default: derived
            from the API key, model and tool names (``derive_session_id``).
        options: What the rewrite may change (default: everything, as the proxy).

    Raises:
        TypeError: ``client`` has neither ``chat.completions.create`` nor ``messages.create``.
    """
    options = options or RewriteOptions()
    completions = getattr(getattr(client, "chat", None), "completions", None)
    if callable(getattr(completions, "create", None)):
        return WrappedClient(client, _Recorder("openai", options, session))
    if callable(getattr(getattr(client, "messages", None), "create", None)):
        return WrappedClient(client, _Recorder("anthropic", options, session))
    raise TypeError(
        f"cannot wrap {type(client).__name__!r}: expected an openai or anthropic client "
        "(with chat.completions.create or messages.create)"
    )
