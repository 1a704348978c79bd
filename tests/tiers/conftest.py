"""A Redis server per test module (``redis_server``), flushed before each test that uses it."""

from __future__ import annotations

import pytest
from redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    if redis_server.process is None:
        redis_server.start()
    redis_server.flush()
    return redis_server.url
