"""The tier interface: chunk bytes under string keys, read, written and discarded in batches.

A tier stores opaque values (chunks of K/V, ``kvfactory.tiers.chunk``) under keys that name the
model, the layout, the codec and the chunk's prefix (``ChunkKey``). Reads and writes take batches,
so a remote tier answers a whole prompt's chunks in one round trip. A tier never fails a request:
a missing, evicted or unreachable value is a miss, and a write it cannot take is dropped and
counted (``TierStats``), so its caller recomputes.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass


@dataclass
class TierStats:
    """What a tier did since it was made: lookups found and not, bytes moved, writes it took and
    dropped, values it evicted for room, and failures of its backend (Redis unreachable, a full
    disk)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    dropped: int = 0
    evictions: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Tier(ABC):
    """Values by key; subclasses implement the batched ``_get_many`` / ``_put_many`` /
    ``_contains_many``, and the counting is done here once. Safe to call from several threads."""

    name: str

    def __init__(self) -> None:
        self.stats = TierStats()
        self._lock = threading.RLock()

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The value of each key, None where the tier holds none (or could not be read)."""
        if not keys:
            return []
        values = self._get_many(keys)
        with self._lock:
            found = [v for v in values if v is not None]
            self.stats.hits += len(found)
            self.stats.misses += len(values) - len(found)
            self.stats.bytes_read += sum(len(v) for v in found)
        return values

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """Store each value under its key (a key already held is replaced)."""
        if items:
            self._put_many(items)

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Whether the tier holds each key, without reading the values."""
        return self._contains_many(keys) if keys else []

    def discard_many(self, keys: list[str]) -> None:
        """Forget each key (one found corrupted, so that the next request recomputes and stores it
        anew); keys the tier does not hold are ignored."""
        if keys:
            self._discard_many(keys)

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def put(self, key: str, value: bytes) -> None:
        self.put_many([(key, value)])

    def _took(self, value: bytes) -> None:
        """Count one write the tier took (subclasses call it under their own lock or the tier's)."""
        self.stats.writes += 1
        self.stats.bytes_written += len(value)

    @abstractmethod
    def _get_many(self, keys: list[str]) -> list[bytes | None]: ...

    @abstractmethod
    def _put_many(self, items: list[tuple[str, bytes]]) -> None: ...

    @abstractmethod
    def _contains_many(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def _discard_many(self, keys: list[str]) -> None: ...
