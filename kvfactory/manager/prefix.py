"""Prefix sharing: full blocks of prompts, found again by a hash chain over their tokens.

As in vLLM's automatic prefix caching, block ``i`` of a prompt is named by a hash of block ``i - 1``'s
name and its own ``page_size`` tokens (``kvfactory.hashing.block_hashes``), so a name stands for the
whole prefix up to it and equal names mean equal K/V. Blocks are hashed in one place, when they
fill (``PrefixIndex.add_filled``, called when a sequence's write completes). The index keeps, per
name, the block holding those tokens in every layer group's pool and one reference to each, so blocks
stay cached after their sequences are freed.

Models with sliding-window layers (Gemma 3, Mistral) are cached as vLLM's hybrid allocator does:
layers are grouped by window (full attention is one group), and a hit of ``k`` blocks needs the
full-attention layers' blocks ``0 .. k - 1`` and each sliding group's blocks over the last window
before token ``k * page_size`` only. A sliding group's blocks of an entry can be given back alone.

Cached blocks that no sequence uses any more wait in eviction-ordered queues, as in vLLM v1's free
block queue: an entry joins ``free_queue`` when its last sequence lets go of it (a chain's later
blocks first, so they are evicted before the blocks they extend), leaves it when a prefix hit
adopts it again, and the head is dropped when the pool needs room (``reclaim``). A sliding group
whose blocks only the index holds while sequences still use the entry's full-attention blocks
waits in ``window_queue``, given back first. The pools report the changes (``BlockPool.watchers``),
so no scan finds them. Pinned entries (a system prompt) never join a queue.
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
    """One prompt block's id in each layer group's pool (in the order of ``PrefixIndex.pools``; ``-1``
    where a sliding group's block is not held), its place in its chain and which pools' blocks only
    the index still references."""

    ids: list[int]
    position: int = 0
    pinned: bool = False
    idle: list[bool] = field(default_factory=list)


class PrefixIndex:
    """Cached prompt blocks by chained name, and the queues of those no sequence uses.

    ``windows`` gives each block pool's sliding window (None: full attention), in pool order (a pool
    per layer group: ``KVCacheFactory.groups``);
    ``page_size`` is the tokens per block."""

    def __init__(self, windows: Sequence[int | None], page_size: int) -> None:
        self.entries: dict[bytes, CachedBlock] = {}
        self.free_queue: OrderedDict[bytes, None] = OrderedDict()  # idle entries, next to evict first
        self.window_queue: OrderedDict[tuple[bytes, int], None] = OrderedDict()  # idle sliding groups
        self.pools: list[BlockPool] = []  # every layer group's block pool, set on the first insert
        self.page_size = page_size
        self.windows = sorted({w for w in windows if w is not None})  # group g + 1: windows[g]
        group = {None: 0} | {w: g + 1 for g, w in enumerate(self.windows)}
        self.groups = [[i for i, w in enumerate(windows) if group[w] == g]
                       for g in range(len(self.windows) + 1)]  # pool positions of each window group
        self._names: dict[tuple[int, int], bytes] = {}  # (pool position, block id) -> name
        self.hit_blocks = self.missed_blocks = self.lookups = self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def idle_blocks(self) -> int:
        """Pool blocks only this index holds (those of idle entries and idle sliding groups), given
        back when the pool needs room."""
        if not self.windows:  # every entry holds a block in every pool
            return len(self.free_queue) * len(self.pools)
        whole = sum(sum(i >= 0 for i in self.entries[name].ids) for name in self.free_queue)
        return whole + sum(len(self.groups[g]) for _, g in self.window_queue)

    def match(self, names: Sequence[bytes]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix of ``names`` that every layer can start from
        (sliding groups: their last window; counted as hits and misses); adopting them takes them out
        of the queues."""
        found = []
        for name in names:
            entry = self.entries.get(name)
            if entry is None or not self._held(entry, 0):
                break
            found.append(entry)
        usable, page = len(found), self.page_size
        for g, window in enumerate(self.windows, start=1):
            missing = -1  # per block: the last block up to it whose group ``g`` is not held
            last = []
            for i, entry in enumerate(found):
                missing = missing if self._held(entry, g) else i
                last.append(missing)
            while usable and last[usable - 1] >= max(0, usable * page - window + 1) // page:
                usable -= 1
        self.lookups += 1
        self.hit_blocks += usable
        self.missed_blocks += len(names) - usable
        return found[:usable]

    def add_filled(self, tokens: Sequence[int], pools: list[BlockPool], blocks: list[torch.Tensor],
                   start: int) -> list[bytes]:
        """Cache the full blocks of ``tokens`` from block ``start`` on, held in ``blocks`` (per block pool,
        ``[blocks]`` from block 0, ``-1`` where not held): the fill point. Returns the names of every full
        block of ``tokens`` that ``blocks`` cover."""
        names = block_hashes(tokens, self.page_size)
        names = names[:min(len(layer_ids) for layer_ids in blocks)]
        ids = [layer_ids[:len(names)].tolist() for layer_ids in blocks]
        for i in range(start, len(names)):
            self.insert(names[i], pools, [layer_ids[i] for layer_ids in ids], i)
        return names

    def insert(self, name: bytes, pools: list[BlockPool], ids: list[int], position: int = 0) -> None:
        """Cache block ``ids`` (one per block pool, ``-1`` where not held) under ``name``, or the groups
        an entry of that name lacks; the index takes a reference to each block it keeps. Blocks of
        full-attention layers must all be held."""
        self.pools = pools
        entry = self.entries.get(name)
        if entry is None:
            if any(ids[layer] < 0 for layer in self.groups[0]):
                return
            entry = CachedBlock([-1] * len(ids), position, idle=[True] * len(ids))
        added = False
        for group in self.groups:
            if not group or any(entry.ids[layer] >= 0 or ids[layer] < 0 or (layer, ids[layer]) in self._names
                                for layer in group):
                continue
            self.entries[name] = entry
            added = True
            for layer in group:
                entry.ids[layer], entry.idle[layer] = ids[layer], False
                self._names[(layer, ids[layer])] = name
                pools[layer].hold_cached([ids[layer]], self)
        if added:
            self._queue(name, entry)

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
            self._queue(name, entry)

    def _queue(self, name: bytes, entry: CachedBlock) -> None:
        """Put the entry, or its sliding groups, in the queue their idleness says, or take them out."""
        whole = all(entry.idle) and not entry.pinned
        if whole:
            self.free_queue[name] = None
            self.free_queue.move_to_end(name)
        else:
            self.free_queue.pop(name, None)
        for g in range(1, len(self.groups)):
            unit = (name, g)
            if not whole and not entry.pinned and self._held(entry, g) and all(
                    entry.idle[layer] for layer in self.groups[g]):
                self.window_queue[unit] = None
                self.window_queue.move_to_end(unit)
            else:
                self.window_queue.pop(unit, None)

    def _held(self, entry: CachedBlock, group: int) -> bool:
        return all(entry.ids[layer] >= 0 for layer in self.groups[group])

    def pin(self, names: Sequence[bytes]) -> int:
        """Never drop these entries (those cached); how many were pinned."""
        pinned = 0
        for name in names:
            if name in self.entries:
                self.entries[name].pinned = True
                self._queue(name, self.entries[name])
                pinned += 1
        return pinned

    def reclaim(self) -> bool:
        """Give back the head of ``window_queue``, else of ``free_queue`` (the pool needs room); False
        when both are empty."""
        if self.window_queue:
            name, group = next(iter(self.window_queue))
            self._release(name, self.groups[group])
            self.window_queue.pop((name, group))  # an entry left without blocks stays a link of its chain
            return True
        if not self.free_queue:
            return False
        self.drop(next(iter(self.free_queue)))
        return True

    def drop(self, name: bytes) -> None:
        entry = self.entries.pop(name)
        self.free_queue.pop(name, None)
        for g in range(1, len(self.groups)):
            self.window_queue.pop((name, g), None)
        self._release(name, range(len(entry.ids)), entry)
        self.evicted += 1

    def _release(self, name: bytes, layers: Sequence[int], entry: CachedBlock | None = None) -> None:
        """Drop the index's reference to the entry's blocks of ``layers`` (those it holds)."""
        entry = entry or self.entries[name]
        for layer in layers:
            block = entry.ids[layer]
            if block >= 0:
                del self._names[(layer, block)]
                self.pools[layer].release_cached([block])
                entry.ids[layer], entry.idle[layer] = -1, True

    def clear(self) -> None:
        """Drop every entry and stop watching the pools."""
        for name in list(self.entries):
            self.drop(name)
        for pool in self.pools:
            if self in pool.watchers:
                pool.watchers.remove(self)
