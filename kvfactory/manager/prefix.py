"""Prefix sharing: full blocks of prompts, found again by a hash chain over their tokens.

As in vLLM's automatic prefix caching, block ``i`` of a prompt is named by a hash of block ``i - 1``'s
name and its own ``page_size`` tokens (``kvfactory.hashing.block_hashes``), so a name stands for the
whole prefix up to it and equal names mean equal K/V. Blocks are hashed in one place, when they
fill (``PrefixIndex.add_filled``, called when a sequence's write completes). The index keeps, per
name, the block holding those tokens in every layer's pool and one reference to each, so blocks
stay cached after their sequences are freed.

Cached blocks that no sequence uses any more wait in one eviction-ordered queue, ``free_queue``,
as in vLLM v1's free block queue: an entry joins its tail when its last sequence lets go of it (a
chain's later blocks first, so they are evicted before the blocks they extend), leaves it when a
prefix hit adopts it again, and the head is dropped when the pool needs room (``reclaim``). The
pools report the changes (``BlockPool.watchers``), so no scan finds them. Pinned entries (a system
prompt) never join the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfactory.hashing import block_hashes
from kvfactory.storage.blocks import BlockPool


@dataclass
class CachedBlock:
    """One prompt block's id in each layer's pool (in the order of ``PrefixIndex.pools``), its place
    in its chain and which layers' blocks only the index still references."""

    ids: list[int]
    position: int = 0
    pinned: bool = False
    idle: list[bool] = field(default_factory=list)


class PrefixIndex:
    """Cached prompt blocks by chained name, and the queue of those no sequence uses."""

    def __init__(self) -> None:
        self.entries: dict[bytes, CachedBlock] = {}
        self.free_queue: OrderedDict[bytes, None] = OrderedDict()  # idle entries, next to evict first
        self.pools: list[BlockPool] = []  # every layer's block pool, set on the first insert
        self._names: dict[tuple[int, int], bytes] = {}  # (layer position, block id) -> name
        self.hit_blocks = self.missed_blocks = self.lookups = self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def idle_blocks(self) -> int:
        """Pool blocks only this index holds (one per layer for each idle entry), evicted when the
        pool needs room."""
        return len(self.free_queue) * len(self.pools)

    def match(self, names: Sequence[bytes]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix of ``names`` (counted as hits and misses);
        adopting them takes them out of ``free_queue``."""
        found = []
        for name in names:
            entry = self.entries.get(name)
            if entry is None:
                break
            found.append(entry)
        self.lookups += 1
        self.hit_blocks += len(found)
        self.missed_blocks += len(names) - len(found)
        return found

    def add_filled(self, tokens: Sequence[int], page_size: int, pools: list[BlockPool],
                   blocks: list[torch.Tensor], start: int) -> int:
        """Cache the full blocks of ``tokens`` from block ``start`` on, held in ``blocks`` (per layer pool,
        ``[blocks]``): the fill point. Returns how many full blocks ``tokens`` has."""
        names = block_hashes(tokens, page_size)
        ids = [layer_ids[:len(names)].tolist() for layer_ids in blocks]
        for i in range(start, len(names)):
            self.insert(names[i], pools, [layer_ids[i] for layer_ids in ids], i)
        return len(names)

    def insert(self, name: bytes, pools: list[BlockPool], ids: list[int], position: int = 0) -> None:
        """Cache block ``ids`` (one per layer pool) under ``name``; the index takes a reference."""
        if name in self.entries or any((layer, block) in self._names for layer, block in enumerate(ids)):
            return
        self.pools = pools
        entry = self.entries[name] = CachedBlock(list(ids), position, idle=[False] * len(ids))
        for layer, (pool, block) in enumerate(zip(pools, ids, strict=True)):
            self._names[(layer, block)] = name
            pool.hold_cached([block], self)
        if all(entry.idle):  # filled by a store that let go of it already
            self.free_queue[name] = None

    def blocks_idle(self, pool: BlockPool, blocks: np.ndarray, idle: np.ndarray) -> None:
        """``BlockWatcher``: cached blocks of ``pool`` became idle (only the index holds them) or used."""
        if pool not in self.pools:
            return
        layer = self.pools.index(pool)
        changed = []
        for block, now_idle in zip(blocks.tolist(), idle.tolist(), strict=True):
            name = self._names.get((layer, block))
            entry = None if name is None else self.entries.get(name)
            if entry is not None and entry.idle[layer] != now_idle:
                entry.idle[layer] = now_idle
                changed.append((entry.position, name, entry))
        for _, name, entry in sorted(changed, key=lambda c: -c[0]):  # a chain's tail joins first
            if all(entry.idle) and not entry.pinned:
                self.free_queue[name] = None
                self.free_queue.move_to_end(name)
            else:
                self.free_queue.pop(name, None)

    def pin(self, names: Sequence[bytes]) -> int:
        """Never drop these entries (those cached); how many were pinned."""
        pinned = 0
        for name in names:
            if name in self.entries:
                self.entries[name].pinned = True
                self.free_queue.pop(name, None)
                pinned += 1
        return pinned

    def reclaim(self) -> bool:
        """Drop the head of ``free_queue`` (the pool needs room); False when it is empty."""
        if not self.free_queue:
            return False
        self.drop(next(iter(self.free_queue)))
        return True

    def drop(self, name: bytes) -> None:
        entry = self.entries.pop(name)
        self.free_queue.pop(name, None)
        for layer, (pool, block) in enumerate(zip(self.pools, entry.ids, strict=True)):
            del self._names[(layer, block)]
            pool.release_cached([block])
        self.evicted += 1

    def clear(self) -> None:
        """Drop every entry and stop watching the pools."""
        for name in list(self.entries):
            self.drop(name)
        for pool in self.pools:
            if self in pool.watchers:
                pool.watchers.remove(self)
