"""Full-precision window pages of prompt blocks, kept so that a prefix hit on quantized pages computes
nothing again.

A sequence over KIVI pages (Liu et al. 2024) keeps its newest ``residual`` tokens in full precision:
after ``M`` tokens (whole quantized pages) its codes cover ``[0, M - residual)`` and its window
``[M - residual, M)``. A prefix cache of quantized pages alone leaves a hit that window to compute
again. The window's pages are named here, by the prompt block they hold (the prefix cache's chained
names, ``kvfactory.hashing.block_hashes``), whenever a sequence's write completes with them full; a
later prompt that finds the pages of the ``residual`` tokens before a block boundary, and the
quantized pages before them in the prefix cache, starts from both (``KVCacheManager.create``).

Only the windows seen at a write's end are named (the tokens a prefill chunk encodes never sit in
window pages), so a hit is found where an earlier prompt's chunk ended, as a shared system prompt
computed first does. The pages are referenced here, not copied, and the least recently used are
given back beyond ``capacity`` blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvfactory.storage.blocks import BlockPool


class WindowPages:
    """Window pages by block name: for each name, the pages ``[pages]`` of every layer group's window
    pool holding that block, one reference each."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, list[tuple[BlockPool, torch.Tensor]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, name: bytes, pages: list[tuple[BlockPool, torch.Tensor]]) -> None:
        """Keep ``pages`` (per window pool, its pool and page ids) as block ``name``'s, unless kept."""
        if name in self.entries:
            self.entries.move_to_end(name)
            return
        for pool, ids in pages:
            pool.incref(ids)
        self.entries[name] = pages
        while len(self.entries) > self.capacity:
            self._release(next(iter(self.entries)))

    @property
    def idle_blocks(self) -> int:
        """Pages only this keeps (no sequence holds them)."""
        return sum(int((pool.refcount[ids.numpy()] == 1).sum())
                   for pages in self.entries.values() for pool, ids in pages)

    def find(self, names: Sequence[bytes]) -> list[torch.Tensor] | None:
        """The pages of blocks ``names`` in order, per window pool ``[1, pages]``, if all are kept."""
        if not names or any(name not in self.entries for name in names):
            return None
        for name in names:
            self.entries.move_to_end(name)
        pools = len(self.entries[names[0]])
        return [torch.cat([self.entries[name][i][1] for name in names])[None] for i in range(pools)]

    def clear(self) -> None:
        for name in list(self.entries):
            self._release(name)

    def _release(self, name: bytes) -> None:
        for pool, ids in self.entries.pop(name):
            pool.decref(ids)
