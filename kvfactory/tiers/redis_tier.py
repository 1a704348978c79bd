"""Chunks in a Redis (or Valkey) server, shared by every process and machine that reaches it."""

from __future__ import annotations

import logging
import time

import redis

from kvfactory.errors import ConfigError
from kvfactory.tiers.base import Tier

logger = logging.getLogger("kvfactory.tiers")


class RedisTier(Tier):
    """Values in the Redis server at ``url``: a batch of reads is one ``MGET``, a batch of writes one
    pipeline of ``SET`` (with ``ttl_s``, if given), so a prompt's chunks cost one round trip.

    The server's own ``maxmemory`` policy evicts (run it with ``allkeys-lru``); a write it refuses
    (out of memory under ``noeviction``) is dropped. When the server cannot be reached within
    ``timeout_s``, or a reply stalls for ``read_timeout_s`` (a large batch from a busy server takes
    longer than a connection), every read is a miss and every write is dropped for ``retry_s``
    seconds, then the tier tries again: requests recompute meanwhile and reuse comes back with the
    server.
    """

    name = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, ttl_s: float | None = None,
                 timeout_s: float = 1.0, read_timeout_s: float = 5.0, retry_s: float = 1.0) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError("ttl_s", ttl_s, "seconds > 0, or None for no expiry")
        super().__init__()
        self.url, self.retry_s = url, retry_s
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self.client = redis.Redis.from_url(url, socket_timeout=read_timeout_s,
                                             socket_connect_timeout=timeout_s)
        self._down_until = 0.0

    @property
    def reachable(self) -> bool:
        """False while the tier waits out ``retry_s`` after a failure."""
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: Exception) -> None:
        with self._lock:
            self.stats.errors += 1
            self._down_until = time.monotonic() + self.retry_s
        logger.warning("redis tier %s: %s failed (%s); retrying in %.1f s", self.url, what, exc, self.retry_s)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        if not self.reachable:
            return [None] * len(keys)
        try:
            return self.client.mget(keys)
        except redis.RedisError as exc:
            self._failed("a read", exc)
            return [None] * len(keys)

    def _put_many(self, items: list[tuple[str, bytes]]) -> None:
        if not self.reachable:
            with self._lock:
                self.stats.dropped += len(items)
            return
        pipe = self.client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value, px=self.ttl_ms)
        try:
            results = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            self._failed("a write", exc)
            with self._lock:
                self.stats.dropped += len(items)
            return
        with self._lock:
            for (_, value), result in zip(items, results, strict=True):
                if isinstance(result, Exception):  # e.g. OOM under maxmemory-policy noeviction
                    self.stats.dropped += 1
                else:
                    self._took(value)

    def _discard_many(self, keys: list[str]) -> None:
        if not self.reachable:
            return
        try:
            self.client.delete(*keys)
        except redis.RedisError as exc:
            self._failed("a delete", exc)

    def _contains_many(self, keys: list[str]) -> list[bool]:
        if not self.reachable:
            return [False] * len(keys)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        try:
            return [bool(n) for n in pipe.execute()]
        except redis.RedisError as exc:
            self._failed("a lookup", exc)
            return [False] * len(keys)
