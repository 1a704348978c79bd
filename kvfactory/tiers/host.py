"""Chunks in this process's memory, least recently used evicted first beyond a byte budget."""

from __future__ import annotations

from collections import OrderedDict

from kvfactory.errors import ConfigError
from kvfactory.tiers.base import Tier


class HostTier(Tier):
    """At most ``capacity_bytes`` of values in host memory (LRU). A value larger than the whole
    budget is dropped rather than emptying the tier for it."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ConfigError("capacity_bytes", capacity_bytes, "an integer >= 1")
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            values = [self._items.get(key) for key in keys]
            for key, value in zip(keys, values, strict=True):
                if value is not None:
                    self._items.move_to_end(key)
            return values

    def _put_many(self, items: list[tuple[str, bytes]]) -> None:
        with self._lock:
            for key, value in items:
                if len(value) > self.capacity_bytes:
                    self.stats.dropped += 1
                    continue
                old = self._items.pop(key, None)
                self.used_bytes += len(value) - (0 if old is None else len(old))
                self._items[key] = value
                self._took(value)
                while self.used_bytes > self.capacity_bytes:
                    _, evicted = self._items.popitem(last=False)
                    self.used_bytes -= len(evicted)
                    self.stats.evictions += 1

    def _contains_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self._items for key in keys]

    def _discard_many(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                value = self._items.pop(key, None)
                self.used_bytes -= 0 if value is None else len(value)
