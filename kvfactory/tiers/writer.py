"""Writes to a tier off the caller's thread, so that storing a prompt's chunks (encoding them and
sending tens of MB to Redis) leaves the step that computed them, as LMCache's asynchronous saves do.

A batch is queued with the bytes it holds and a function that makes its values on the writer's
thread (the encoding too runs there). At most ``max_pending_bytes`` wait at once: a batch beyond
them is dropped and counted, never waited for, and the chunks it held are computed again by the
next request that needs them. Queued batches are written before the process exits (the writer's
thread is joined at interpreter shutdown); ``flush`` waits for them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvfactory.tiers.base import Tier

logger = logging.getLogger("kvfactory.tiers")

MAX_PENDING_BYTES = 1 << 30


class BackgroundWriter:
    """One thread writing batches to ``tier`` in the order they were queued."""

    def __init__(self, tier: Tier, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.tier, self.max_pending_bytes = tier, max_pending_bytes
        self.pending_bytes = 0
        self.dropped = 0  # values of batches dropped for want of room in the queue
        self.written = 0  # values handed to the tier
        self._lock = threading.Lock()
        self._futures: set[Future] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfactory-tier-writer")

    def submit(self, values: int, nbytes: int, make: Callable[[], list[tuple[str, bytes]]]) -> bool:
        """Queue a batch of ``values`` values holding about ``nbytes`` bytes, made by ``make()`` on the
        writer's thread; False (the batch dropped and counted) when it does not fit in the queue."""
        with self._lock:
            if self.pending_bytes and self.pending_bytes + nbytes > self.max_pending_bytes:
                self.dropped += values
                return False
            self.pending_bytes += nbytes
            future = self._executor.submit(self._write, nbytes, make)
            self._futures.add(future)
        future.add_done_callback(self._done)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch queued so far is written; False if ``timeout`` seconds passed first."""
        with self._lock:
            futures = set(self._futures)
        return not wait(futures, timeout=timeout).not_done

    def _write(self, nbytes: int, make: Callable[[], list[tuple[str, bytes]]]) -> None:
        try:
            items = make()
            self.tier.put_many(items)
            self.written += len(items)
        except Exception:  # a batch that cannot be written is a later miss, never a failed request
            logger.exception("tier writer: a batch of chunks could not be written")
        finally:
            with self._lock:
                self.pending_bytes -= nbytes

    def _done(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)
