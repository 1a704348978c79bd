"""Chunks read from a tier layer part by layer part on a thread of their own, so that a forward
starts on its first layers while the later ones are still on their way (the compute and I/O
pipelining of LMCache: Cheng et al., 2025, arXiv:2510.09665).

Each chunk is stored as parts (``ChunkKey.part``), one per range of ``layer_parts``. A load reads
every chunk's first part in one batch, checks and decodes it, hands it to its caller's ``place``,
and marks those layers ready; then the next part. ``wait(layer)`` returns once the part holding
``layer`` is placed (or has failed), so each layer's attention waits for its own K/V only.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from kvfactory.tiers.base import Tier
from kvfactory.tiers.chunk import ChunkError, ChunkKey, decode_chunk

logger = logging.getLogger("kvfactory.tiers")
BATCH = 8  # parts per read: a batch's buffers are freed before the next is read, and reused
Place = Callable[[ChunkKey, int, torch.Tensor, torch.Tensor], None]  # chunk, first layer, keys, values


class LayerwiseLoad:
    """The parts ``parts`` (layer ranges, first to last) of the chunks ``keys`` read from ``tier`` on
    ``executor``; ``place(key, first, keys, values)`` receives each decoded part, its K/V
    ``[layers, kv_heads, tokens, head_dim]`` (read-only views for identity chunks). A chunk with a
    missing or corrupted part is in ``failed`` (its corrupted parts discarded from ``tier``) and its
    later parts are not read. ``stages`` holds the seconds spent per stage (transfer, parse,
    checksum, decode, copy) and ``seconds`` the load's wall time once it is done."""

    def __init__(self, tier: Tier, keys: list[ChunkKey], parts: list[tuple[int, int]], place: Place,
                 executor: Executor) -> None:
        self.tier, self.keys, self.parts, self.place = tier, list(keys), list(parts), place
        self.failed: dict[ChunkKey, ChunkError] = {}
        self.stages: dict[str, float] = {"transfer": 0.0, "copy": 0.0}
        self.bytes = 0
        self.seconds = 0.0
        self._starts = [first for first, _ in self.parts]
        self._ready = [threading.Event() for _ in self.parts]
        self._future = executor.submit(self._run)

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        """Block until the part holding ``layer`` is placed or has failed (False if ``timeout``
        seconds passed first)."""
        return self._ready[bisect.bisect_right(self._starts, layer) - 1].wait(timeout)

    def join(self) -> None:
        """Block until every part is placed or has failed."""
        self._future.result()

    def _run(self) -> None:
        began = time.perf_counter()
        try:
            for (first, end), ready in zip(self.parts, self._ready, strict=True):
                self._read_part(first, end)
                ready.set()
        except Exception as exc:  # a fault of the loader, not of a chunk: every chunk is recomputed
            logger.exception("layer-wise load failed")
            for key in self.keys:
                self.failed.setdefault(key, ChunkError(f"load failed ({exc})"))
        finally:
            for ready in self._ready:  # never leave a forward waiting
                ready.set()
            self.seconds = time.perf_counter() - began

    def _read_part(self, first: int, end: int) -> None:
        live = [key for key in self.keys if key not in self.failed]
        for start in range(0, len(live), BATCH):
            self._read_batch(live[start:start + BATCH], first, end)

    def _read_batch(self, live: list[ChunkKey], first: int, end: int) -> None:
        names = [key.part(first, end) for key in live]
        began = time.perf_counter()
        values = self.tier.get_many([str(name) for name in names])
        self.stages["transfer"] += time.perf_counter() - began
        for key, name, data in zip(live, names, values, strict=True):
            try:
                if data is None:
                    raise ChunkError(f"chunk {key.prefix[:12]} layers {first}-{end}: no longer in the tiers")
                keys, values_ = decode_chunk(data, name, self.stages)
            except ChunkError as exc:
                if data is not None:  # corrupted: forget it, so that a later request stores it anew
                    self.tier.discard_many([str(name)])
                self.failed[key] = exc
                continue
            self.bytes += len(data)
            copying = time.perf_counter()
            self.place(key, first, keys, values_)
            self.stages["copy"] += time.perf_counter() - copying
