"""One forward at a time over the memory that a factory's caches share.

Caches of one factory share mutable memory: a paged pool's free lists, refcounts and blocks, and the
read workspaces that quantized and sparse reads decode into. Two threads running forwards on such
caches at once would interleave those writes and read each other's buffers. A ``ForwardLock``
serialises them: a forward takes it at its first layer's write and gives it back when the decoder
returns (``kvfactory.cache``'s decoder hook, which runs on errors too); another thread's forward
waits. The same thread may take it again at will (a forward that never signalled its end keeps it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ForwardLock:
    """A lock owned by one thread at a time, taken again freely by its owner."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def enter(self) -> bool:
        """Take the lock for this thread (waiting for another owner); False if it held it already."""
        me = threading.get_ident()
        if self._owner == me:
            return False
        self._lock.acquire()
        self._owner = me
        return True

    def exit(self) -> None:
        """Give the lock back if this thread holds it."""
        if self._owner == threading.get_ident():
            self._owner = None
            self._lock.release()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for a block (a low-level write or a reset), unless this thread holds it already."""
        took = self.enter()
        try:
            yield
        finally:
            if took:
                self.exit()
