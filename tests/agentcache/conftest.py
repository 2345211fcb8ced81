"""Fixtures shared by the SDK tests: a real redis-server on a free loopback port."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from agentcache.cache._redis_server import LocalRedisServer, redis_server_binary

NO_REDIS = "redis-server is not installed here (.ci/run installs it, so CI never skips)"


def _running_redis() -> Iterator[LocalRedisServer]:
    """A started redis-server, stopped when the fixture ends (skips where none is installed)."""
    if redis_server_binary() is None:
        pytest.skip(NO_REDIS)
    server = LocalRedisServer()
    with server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedisServer]:
    """One redis-server for the whole session (no persistence, loopback only)."""
    yield from _running_redis()


@pytest.fixture
def redis_url(redis_server: LocalRedisServer) -> Iterator[str]:
    """The session server's url, emptied before each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def private_redis() -> Iterator[LocalRedisServer]:
    """A redis-server of this test alone, which the test may stop and start again."""
    yield from _running_redis()


@pytest.fixture
def namespace() -> str:
    """A fresh key namespace, so tests never see each other's entries."""
    return f"test-{uuid.uuid4().hex[:12]}"
