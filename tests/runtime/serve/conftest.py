"""Fixtures of the server's end-to-end tests: the bundled ``tiny`` model served over loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from runtime.engine import Engine
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread

Served = tuple[Engine, OpenAI]
"""An engine and an ``openai`` client of its server."""


@pytest.fixture(scope="module")
def tiny_served() -> Iterator[Served]:
    """The ``tiny`` engine (8 MiB prefix cache) and an ``openai`` client of its server.

    One per test module; the client never retries, so a refused request fails the test at once.
    """
    engine = Engine.from_pretrained("tiny", kv_cache_bytes=8 << 20)
    with ServerThread(create_app(engine)) as url:
        yield engine, OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)
    engine.close()
