"""Prefix sharing: full blocks of prompts, found again by a hash chain over their tokens.

As in vLLM's automatic prefix caching, block ``i`` of a prompt is named by a hash of block ``i - 1``'s
name and its own ``page_size`` tokens, so a name stands for the whole prefix up to it and equal
names mean equal K/V. The index keeps, per name, the block holding those tokens in every layer's
pool and one reference to each, so blocks stay cached after their sequences are freed. Entries are
kept in least-recently-used order; when the pool runs out of blocks it asks ``reclaim`` to drop the
oldest entries no sequence uses any more. Pinned entries (a system prompt) are never dropped.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvfactory.storage.blocks import BlockPool


def block_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The chained names of the full blocks of ``tokens``."""
    names, parent = [], b""
    array = np.asarray(tokens, dtype=np.int64)
    for i in range(len(array) // page_size):
        parent = hashlib.blake2b(parent + array[i * page_size:(i + 1) * page_size].tobytes(),
                                 digest_size=16).digest()
        names.append(parent)
    return names


@dataclass
class CachedBlock:
    """One prompt block's id in each layer's pool (in the order of ``PrefixIndex.pools``)."""

    ids: list[int]
    pinned: bool = False


class PrefixIndex:
    """Cached prompt blocks by chained name, least recently used first."""

    def __init__(self) -> None:
        self.entries: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self.pools: list[BlockPool] = []  # every layer's block pool, set on the first insert
        self.hit_blocks = self.missed_blocks = self.lookups = self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, names: Sequence[bytes]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix of ``names`` (marked as just used)."""
        found = []
        for name in names:
            entry = self.entries.get(name)
            if entry is None:
                break
            self.entries.move_to_end(name)
            found.append(entry)
        self.lookups += 1
        self.hit_blocks += len(found)
        self.missed_blocks += len(names) - len(found)
        return found

    def insert(self, name: bytes, pools: list[BlockPool], ids: list[int]) -> None:
        """Cache block ``ids`` (one per layer pool) under ``name``; the index takes a reference."""
        if name in self.entries:
            return
        self.pools = pools
        for pool, block in zip(pools, ids, strict=True):
            pool.incref(torch.tensor([block]))
        self.entries[name] = CachedBlock(list(ids))

    def pin(self, names: Sequence[bytes]) -> int:
        """Never drop these entries (those cached); how many were pinned."""
        pinned = 0
        for name in names:
            if name in self.entries:
                self.entries[name].pinned = True
                pinned += 1
        return pinned

    def oldest_reclaimable(self) -> bytes | None:
        """The least recently used unpinned entry whose blocks only the index still references."""
        return next((name for name, entry in self.entries.items() if not entry.pinned and all(
            pool.refcount[block] == 1 for pool, block in zip(self.pools, entry.ids, strict=True))), None)

    def drop(self, name: bytes) -> None:
        entry = self.entries.pop(name)
        for pool, block in zip(self.pools, entry.ids, strict=True):
            pool.decref(torch.tensor([block]))
        self.evicted += 1

    def clear(self) -> None:
        for name in list(self.entries):
            self.drop(name)
