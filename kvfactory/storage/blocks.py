"""Block pools and block tables: the memory under paged storage.

A ``BlockPool`` holds one kind of fixed-size block for one layer: named tensors laid out
``[kv_heads, num_blocks, units_per_block, ...]`` (plain K/V: a unit is a token; packed K/V: a
unit is a codec unit, ``kvfactory.codecs``), with a free list (least recently freed first) and
refcounts. Blocks a prefix cache references are marked ``cached``; the pool tells its
``watchers`` (``BlockWatcher``) whenever such a block becomes idle (only the prefix cache holds it)
or is used again, so the prefix cache keeps its idle blocks in one eviction-ordered queue without
scanning (``kvfactory.manager.prefix``). A ``PagedPool`` holds every block pool its caches use,
by kind and layer. A ``BlockTable`` is one store's block ids per batch row over one block pool:
it grows, writes and reads them, shares blocks between rows and copies a shared block before
writing into it, as in vLLM's block manager and nano-vllm's ``block_manager.py``.

Block kinds: ``kv`` (plain paged K/V), ``packed`` (quantized pages: codec codes, scales and zero
points) and ``window`` (the full-precision window of recent tokens in front of quantized pages).
Pool sizes (``pool_tokens`` / ``pool_blocks`` / ``pool_bytes``) bound the ``kv`` and ``packed``
blocks, where the tokens are; ``window`` blocks hold at most the codec's residual window plus one
unit per sequence row, so they grow on demand.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from kvfactory.errors import CacheFullError, ConfigError, ShapeError
from kvfactory.storage.base import MemoryReport
from kvfactory.storage.forward_lock import ForwardLock
from kvfactory.storage.workspace import ReadWorkspace

BLOCK_KINDS = ("kv", "packed", "window")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
BOUNDED_KINDS = ("kv", "packed")  # the kinds that pool_tokens / pool_blocks / pool_bytes size


@dataclass(frozen=True)
class PoolSpec:
    """One block pool's layout: ``tensors`` holds ``(name, (kv_heads, units_per_block, *rest), dtype)``."""

    kind: str
    layer_idx: int
    page_size: int  # tokens per block
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    device: torch.device

    @property
    def block_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.tensors)

    @classmethod
    def for_kv(cls, kind: str, layer_idx: int, page_size: int, key: torch.Tensor,
               value: torch.Tensor) -> PoolSpec:
        """Plain K/V blocks shaped like ``key`` / ``value`` ``[batch, kv_heads, tokens, head_dim]``."""
        return cls(kind, layer_idx, page_size, (
            ("k", (key.shape[1], page_size, key.shape[3]), key.dtype),
            ("v", (value.shape[1], page_size, value.shape[3]), value.dtype)), key.device)


class BlockWatcher(Protocol):
    """What a prefix cache hears from the pools of the blocks it references (``BlockPool.watchers``)."""

    def blocks_idle(self, pool: BlockPool, blocks: np.ndarray, idle: np.ndarray) -> None:
        """``cached`` blocks whose references just changed: ``idle[i]``, block ``blocks[i]``'s only
        reference is the prefix cache's own (a watcher ignores the blocks it does not cache)."""


def _block_ids(ids: torch.Tensor) -> np.ndarray:
    """Block ids as a flat numpy array, outside any active torch dispatch mode: a block table's
    finalizer may run while ``torch.compile`` traces under a fake-tensor mode, which refuses ops on
    these real tensors and would leave the blocks held."""
    with _disable_current_modes():
        return ids.flatten().cpu().numpy()


class BlockPool:
    """Fixed-size blocks of one kind and layer, with a free list and refcounts.

    ``num_blocks=None`` makes the pool growable: it starts with the first request and grows by
    a quarter (at least what is asked) when a request does not fit.
    """

    def __init__(self, spec: PoolSpec, num_blocks: int | None):
        self.spec, self.layer_idx, self.page_size = spec, spec.layer_idx, spec.page_size
        self.growable = num_blocks is None
        initial = num_blocks if num_blocks is not None else 0
        with torch.inference_mode(False):  # the pool outlives any one inference_mode block
            self.tensors = {name: torch.empty((shape[0], initial, *shape[1:]), dtype=dtype,
                                              device=spec.device) for name, shape, dtype in spec.tensors}
        self.refcount = np.zeros(initial, dtype=np.int32)
        self.any_shared = False  # some block has refcount > 1: writes must check copy-on-write
        self.free: deque[int] = deque(range(initial))
        self.cached = np.zeros(initial, dtype=bool)  # blocks a prefix cache references (``hold_cached``)
        self.watchers: list[BlockWatcher] = []  # the prefix caches holding some of its blocks

    @property
    def k(self) -> torch.Tensor:
        return self.tensors["k"]

    @property
    def v(self) -> torch.Tensor:
        return self.tensors["v"]

    @property
    def num_blocks(self) -> int:
        return self.refcount.size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every tensor together."""
        return self.spec.block_bytes

    def check(self, needed: int) -> None:
        """Raise ``CacheFullError`` if ``needed`` blocks cannot be handed out (fixed pools only)."""
        if needed > len(self.free) and not self.growable:
            raise CacheFullError(self.layer_idx, needed, len(self.free), self.num_blocks, self.page_size)

    def allocate(self, n: int) -> torch.Tensor:
        """Take ``n`` free blocks (least recently freed first), refcount 1 each."""
        self.check(n)
        if n > len(self.free):
            self._grow(self.num_blocks + n - len(self.free))
        ids = [self.free.popleft() for _ in range(n)]
        self.refcount[ids] = 1
        return torch.tensor(ids, dtype=torch.long)

    def _grow(self, at_least: int) -> None:
        old = self.num_blocks
        new = max(old + old // 4, at_least)
        with torch.inference_mode(False):
            for name, t in self.tensors.items():
                grown = t.new_empty((t.shape[0], new, *t.shape[2:]))
                grown[:, :old] = t
                self.tensors[name] = grown
        self.refcount = np.concatenate([self.refcount, np.zeros(new - old, dtype=np.int32)])
        self.cached = np.concatenate([self.cached, np.zeros(new - old, dtype=bool)])
        self.free.extend(range(old, new))

    def incref(self, ids: torch.Tensor) -> None:
        ids = _block_ids(ids)
        np.add.at(self.refcount, ids, 1)
        self.any_shared = bool((self.refcount > 1).any())
        self._report(ids)

    def decref(self, ids: torch.Tensor) -> None:
        ids = _block_ids(ids)
        if ids.size == 0:
            return
        np.add.at(self.refcount, ids, -1)
        # the distinct ids, by sorting: np.unique may import numpy.ma, and a block table's finalizer
        # run by the garbage collector during that import would recurse into it
        ordered = np.sort(ids)
        touched = ordered[np.append(True, ordered[1:] != ordered[:-1])]
        if (self.refcount[touched] < 0).any():
            raise RuntimeError(f"layer {self.layer_idx}: block freed more often than referenced")
        self.free.extend(touched[self.refcount[touched] == 0].tolist())
        self.any_shared = bool((self.refcount > 1).any())
        self._report(touched)

    def hold_cached(self, blocks: list[int], watcher: BlockWatcher) -> None:
        """The prefix cache takes a reference to ``blocks`` (filled by a sequence that holds them) and
        hears from now on when they become idle or are used again."""
        ids = np.asarray(blocks, dtype=np.int64)
        if watcher not in self.watchers:
            self.watchers.append(watcher)
        self.cached[ids] = True
        self.incref(torch.from_numpy(ids))

    def release_cached(self, blocks: list[int]) -> None:
        """The prefix cache drops its reference to ``blocks`` (freed once no sequence holds them)."""
        ids = np.asarray(blocks, dtype=np.int64)
        self.cached[ids] = False
        self.decref(torch.from_numpy(ids))

    def _report(self, touched: np.ndarray) -> None:
        """Tell the watchers about the cached blocks among ``touched`` whose references changed."""
        if not self.watchers or not touched.size:
            return
        blocks = touched[self.cached[touched]]
        if blocks.size:
            idle = self.refcount[blocks] == 1
            for watcher in self.watchers:
                watcher.blocks_idle(self, blocks, idle)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy block contents ``src[i] -> dst[i]`` (copy-on-write)."""
        for t in self.tensors.values():
            raw(t)[:, dst] = raw(t)[:, src]

    def memory_report(self) -> MemoryReport:
        used_blocks = self.num_blocks - len(self.free)
        return MemoryReport(allocated=sum(t.nbytes for t in self.tensors.values()),
                            used=used_blocks * self.block_bytes, tokens=used_blocks * self.page_size)


class PagedPool:
    """Block pools for every layer (and block kind) of a model; many caches (sequences) share one.

    Size it with exactly one of ``tokens``, ``blocks`` or ``bytes`` (per layer for tokens and
    blocks, in total for bytes); with none, each layer pool grows on demand. ``blocks`` counts
    blocks of ``page_size`` tokens; quantized pages, whose blocks may hold more tokens, get the
    same number of tokens.
    """

    def __init__(self, page_size: int = 16, *, tokens: int | None = None, blocks: int | None = None,
                 bytes: int | None = None, num_layers: int = 1):
        given = {k: v for k, v in (("pool_tokens", tokens), ("pool_blocks", blocks), ("pool_bytes", bytes))
                 if v is not None}
        if len(given) > 1:
            raise ConfigError(", ".join(given), tuple(given.values()), "at most one of pool_tokens, "
                              "pool_blocks, pool_bytes")
        self.page_size, self.num_layers = page_size, num_layers
        self._size_key = next(iter(given), None)
        self._tokens = blocks * page_size if blocks is not None else tokens
        self._bytes = bytes
        self.pools: dict[tuple[str, int], BlockPool] = {}
        self.reclaimers: list[Callable[[], bool]] = []  # each frees some blocks if it can: True if it did
        self._workspace = ReadWorkspace()
        self.forward_lock = ForwardLock()  # one forward at a time over these blocks (``forward_lock.py``)
        self.layout: tuple[int, int] | None = None  # (kv_heads, head_dim) of the model (``expect_layout``)

    def expect_layout(self, kv_heads: int, head_dim: int) -> None:
        """Fix the K/V shape every write must have, from the model config (``KVCacheFactory``): a write
        of another shape raises ``ShapeError`` and changes nothing. A dtype or device follows the
        first writer and may change once a block pool holds nothing (after ``free``)."""
        if self.layout not in (None, (kv_heads, head_dim)):
            raise ConfigError("pool", f"kv_heads={self.layout[0]}, head_dim={self.layout[1]}",
                              f"a pool of the model's layout kv_heads={kv_heads}, head_dim={head_dim}")
        self.layout = (kv_heads, head_dim)
        self._check_size(2 * kv_heads * head_dim)

    def _check_size(self, token_bytes: int) -> None:
        """Refuse a size no pool of this layout can have, now rather than at the allocator: fewer bytes
        than one block per layer, or more tokens than this machine's memory holds (``token_bytes``
        per token and layer at one byte per element, the least any codec stores but int4/int2)."""
        key, given = self._size_key, {"pool_tokens": self._tokens, "pool_bytes": self._bytes}
        if key == "pool_blocks":
            given["pool_blocks"] = self._tokens // self.page_size
        least_block = token_bytes * self.page_size * self.num_layers // 4  # int2 packs 4 per byte
        if self._bytes is not None and self._bytes < least_block:
            raise ConfigError("pool_bytes", self._bytes, f">= {least_block} bytes: one "
                              f"{self.page_size}-token block for each of {self.num_layers} layers")
        limit = memory_bytes()
        if self._tokens is not None and self._tokens * token_bytes * self.num_layers // 4 > limit:
            raise ConfigError(key, given[key], f"a pool that fits this machine's {limit:,} bytes of memory "
                              f"({self._tokens:,} tokens x {self.num_layers} layers take at least "
                              f"{self._tokens * token_bytes * self.num_layers // 4:,} bytes)")

    def _check_spec(self, spec: PoolSpec) -> BlockPool | None:
        """The block pool ``spec`` writes into (None: not allocated yet, or emptied and dropped to take
        ``spec``'s dtype and device); ``ShapeError`` for a spec that fits neither the model nor it."""
        if self.layout is not None:
            kv_heads, head_dim = self.layout
            plain = spec.kind != "packed"  # packed codes have codec-specific trailing shapes
            if any(shape[0] != kv_heads or plain and shape[-1] != head_dim for _, shape, _ in spec.tensors):
                raise ShapeError(f"layer {spec.layer_idx}: {spec.kind} blocks of {describe(spec)} do not fit "
                                 f"the model's kv_heads={kv_heads}, head_dim={head_dim}")
        key = (spec.kind, spec.layer_idx)
        pool = self.pools.get(key)
        if pool is None or pool.spec == spec:
            return pool
        if not pool.refcount.any():
            del self.pools[key]
            return None
        raise ShapeError(f"layer {spec.layer_idx}: {spec.kind} blocks of {describe(spec)} do not fit the "
                         f"pool's {describe(pool.spec)}, which holds blocks in use")

    def block_pools(self, kind: str | None = "kv") -> list[BlockPool]:
        """The block pools of ``kind`` (None: every kind), by kind and layer."""
        return [self.pools[key] for key in sorted(self.pools) if kind in (None, key[0])]

    @property
    def layers(self) -> dict[int, BlockPool]:
        """The plain K/V block pool of each layer that has one."""
        return {layer: pool for (kind, layer), pool in self.pools.items() if kind == "kv"}

    def workspace(self, slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A reusable buffer for multi-row reads, shared by every layer and cache of this pool."""
        return self._workspace.buffer(slot, shape, like)

    def block_pool(self, spec: PoolSpec) -> BlockPool:
        """The pool of ``spec``'s kind and layer, allocated on first use (``_check_spec``)."""
        pool = self._check_spec(spec)
        if pool is None:
            pool = BlockPool(spec, self.capacity(spec))
            self.pools[(spec.kind, spec.layer_idx)] = pool
        return pool

    def capacity(self, spec: PoolSpec) -> int | None:
        """Blocks of ``spec`` per layer (``None``: growable); ``pool_bytes`` is split evenly over layers."""
        if spec.kind not in BOUNDED_KINDS:
            return None
        if self._bytes is not None:
            blocks = self._bytes // (spec.block_bytes * self.num_layers)
            if blocks < 1:
                raise ConfigError("pool_bytes", self._bytes, f">= {spec.block_bytes * self.num_layers} (one "
                                  f"block in every layer)")
            return blocks
        return None if self._tokens is None else math.ceil(self._tokens / spec.page_size)

    def check(self, requests: list[tuple[PoolSpec, int]]) -> None:
        """Raise ``CacheFullError`` unless every pool can hand out the blocks requested of it (requests
        of one pool summed), after
        asking the ``reclaimers`` (e.g. a prefix cache dropping unused blocks) for room while any
        frees something.

        A pool that is not allocated yet is judged by the size it will get.
        """
        while True:
            try:
                return self._check(requests)
            except CacheFullError:
                if not any(reclaim() for reclaim in self.reclaimers):
                    raise

    def _check(self, requests: list[tuple[PoolSpec, int]]) -> None:
        totals: dict[PoolSpec, int] = {}  # several caches' requests of one pool add up
        for spec, needed in requests:
            totals[spec] = totals.get(spec, 0) + needed
        for spec, needed in totals.items():
            pool = self._check_spec(spec)
            if pool is not None:
                pool.check(needed)
                continue
            capacity = self.capacity(spec)
            if capacity is not None and needed > capacity:
                raise CacheFullError(spec.layer_idx, needed, capacity, capacity, spec.page_size)

    def check_capacity(self, requests: list[tuple[PoolSpec, int]]) -> None:
        """Raise ``CacheFullError`` if the requests exceed what the pools hold even when empty (a request
        that could never be served, whatever finishes first)."""
        totals: dict[PoolSpec, int] = {}
        for spec, needed in requests:
            totals[spec] = totals.get(spec, 0) + needed
        for spec, needed in totals.items():
            pool = self.pools.get((spec.kind, spec.layer_idx))
            capacity = self.capacity(spec) if pool is None or pool.growable else pool.num_blocks
            if capacity is not None and needed > capacity:
                raise CacheFullError(spec.layer_idx, needed, capacity, capacity, spec.page_size)

    def memory_report(self) -> MemoryReport:
        """All block pools plus the read workspace (allocated, never counted as used)."""
        report = sum((p.memory_report() for p in self.pools.values()), MemoryReport())
        return MemoryReport(report.allocated + self._workspace.nbytes, report.used, report.tokens)

    def free_blocks(self) -> dict[int, int]:
        """Free plain K/V blocks per layer."""
        return {i: len(p.free) for i, p in self.layers.items()}


def first_equal_rows(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """For each batch row, the first row whose tensors are all equal to its own ``[batch]``, or None
    when every row differs (compared whole only where the last token's values already agree)."""
    values = list(tensors.values())
    batch = values[0].shape[0]
    signature = values[0][:, :, -1].flatten(1)
    first = torch.arange(batch)
    for row in range(1, batch):
        for earlier in range(row):
            if first[earlier] == earlier and torch.equal(signature[row], signature[earlier]) \
                    and all(torch.equal(x[row], x[earlier]) for x in values):
                first[row] = earlier
                break
    return None if bool((first == torch.arange(batch)).all()) else first


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bytes when it is FP8, whose index copies torch does not implement on CPU."""
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def memory_bytes() -> int:
    """The most memory a pool can take here: host RAM or, if larger, the biggest CUDA device's."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    devices = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return max([host, *devices])


def describe(spec: PoolSpec) -> str:
    """``spec``'s tensors as ``name [shape] dtype`` for error messages."""
    return ", ".join(f"{name} {list(shape)} {dtype}" for name, shape, dtype in spec.tensors)


class BlockTable:
    """Block ids ``[batch, blocks]`` of one store over one block pool, holding tokens
    ``[start, start + length)`` of each row's blocks; released to the pool by ``release``.

    ``run_start`` is the first id when a single row's blocks are consecutive in the pool, so a
    read can return a view instead of copying (the common single-sequence case).
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._ids: torch.Tensor | None = None
        self.pool: BlockPool | None = None
        self.run_start: int | None = None
        self.start = self.length = 0

    @property
    def ids(self) -> torch.Tensor | None:
        return self._ids

    @ids.setter
    def ids(self, ids: torch.Tensor | None) -> None:
        self._ids, self.run_start = ids, None
        if ids is not None and ids.shape[0] == 1 and ids.shape[1] > 0:
            first = int(ids[0, 0])
            if int(ids[0, -1]) - first == ids.shape[1] - 1 and bool((ids[0].diff() == 1).all()):
                self.run_start = first

    @property
    def batch_size(self) -> int:
        return 0 if self._ids is None else self._ids.shape[0]

    def release(self) -> None:
        """Give every block back; the table is empty afterwards."""
        if self._ids is not None and self.pool is not None:
            self.pool.decref(self._ids)
        self.ids = None
        self.start = self.length = 0

    def adopt(self, block_pool: BlockPool, ids: torch.Tensor, start: int, length: int) -> None:
        """Hold tokens ``[start, start + length)`` of blocks ``ids [batch, blocks]`` already filled
        elsewhere (a fork, a cached prefix): referenced, not copied; a write into a shared block
        copies it first."""
        self.release()
        block_pool.incref(ids)
        self.pool = block_pool
        self.ids = ids.clone()
        self.start, self.length = start, length

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def growth(self, new_tokens: int) -> int:
        """New blocks each row needs to hold ``new_tokens`` more tokens."""
        have = 0 if self._ids is None else self._ids.shape[1]
        return max(self.blocks_for(self.start + self.length + new_tokens) - have, 0)

    def cow_rows(self) -> torch.Tensor | None:
        """Rows whose block receiving the next write is shared and must be copied first."""
        fill = self.start + self.length
        if self._ids is None or fill % self.page_size == 0 or not self.pool.any_shared:
            return None
        col = self._ids[:, fill // self.page_size]
        shared = (self.pool.refcount[col.numpy()] > 1).nonzero()[0]
        return torch.from_numpy(shared) if shared.size else None

    def blocks_needed(self, new_tokens: int, batch: int) -> int:
        cow = self.cow_rows()
        return batch * self.growth(new_tokens) + (0 if cow is None else cow.numel())

    def append(self, block_pool: BlockPool, tensors: dict[str, torch.Tensor], tokens: int) -> None:
        """Write ``tokens`` more tokens: ``tensors[name]`` is ``[batch, kv_heads, units, *rest]`` in
        ``name``'s units. Nothing is written unless every block the append needs can be handed out."""
        batch = next(iter(tensors.values())).shape[0]
        if self._ids is None and batch > 1 and block_pool.spec.kind == "kv":
            first = first_equal_rows(tensors)
            if first is not None:  # rows repeat earlier ones (num_return_sequences): write each once, share
                distinct = first.unique()
                rows = {name: x[distinct.to(x.device)] for name, x in tensors.items()}
                self.append(block_pool, rows, tokens)
                self.select_rows(torch.searchsorted(distinct, first))
                return
        if self._ids is None:
            self.pool = block_pool
            self.ids = torch.empty((batch, 0), dtype=torch.long)
        elif batch != self._ids.shape[0]:
            raise ShapeError(f"layer {block_pool.layer_idx}: batch {batch} appended to a store of batch "
                             f"{self._ids.shape[0]}")
        self._make_room(block_pool, batch, tokens)
        fill, ps = self.start + self.length, self.page_size
        cols = self._ids[:, fill // ps:(fill + tokens - 1) // ps + 1]
        for name, x in tensors.items():
            pool_tensor = block_pool.tensors[name]
            h, num_blocks, per_block = pool_tensor.shape[:3]
            unit = ps // per_block
            offset, n = fill % ps // unit, tokens // unit
            slots = (cols[:, :, None] * per_block + torch.arange(per_block)).flatten(1)[:, offset:offset + n]
            flat = raw(pool_tensor).view(h, num_blocks * per_block, *pool_tensor.shape[3:])
            rows = raw(x).transpose(0, 1).reshape(h, batch * n, *x.shape[3:])
            flat.index_copy_(1, slots.flatten().to(x.device), rows)
        self.length += tokens

    def _make_room(self, block_pool: BlockPool, batch: int, tokens: int) -> None:
        """New blocks for ``tokens`` more tokens per row and private copies of shared blocks they write
        into; ``CacheFullError`` before any change if the pool cannot hand them out."""
        grow, cow = self.growth(tokens), self.cow_rows()
        if grow or cow is not None:
            block_pool.check(batch * grow + (0 if cow is None else cow.numel()))
            if cow is not None:
                col = (self.start + self.length) // self.page_size
                self.unshare(cow, torch.full_like(cow, col))
            if grow:
                self.ids = torch.cat([self._ids, block_pool.allocate(batch * grow).view(batch, grow)], dim=1)

    def next_slot(self, block_pool: BlockPool) -> int:
        """Make room for one more token of this one-row table of plain K/V blocks and count it written:
        its slot in the pool's ``[heads, blocks * page_size]`` view, for the caller to write."""
        if self._ids is None:
            self.pool = block_pool
            self.ids = torch.empty((1, 0), dtype=torch.long)
        self._make_room(block_pool, 1, 1)
        fill = self.start + self.length
        self.length += 1
        return int(self._ids[0, fill // self.page_size]) * self.page_size + fill % self.page_size

    def unshare(self, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """Give this table private copies of the blocks at ``(rows, cols)``."""
        old = self._ids[rows, cols]
        new = self.pool.allocate(rows.numel())
        self.pool.copy_blocks(old, new)
        ids = self._ids.clone()
        ids[rows, cols] = new
        self.ids = ids
        self.pool.decref(old)

    def read(self, name: str, workspace: PagedPool) -> torch.Tensor:
        """Tensor ``name`` of the held tokens, ``[batch, kv_heads, units, *rest]``: a view of the pool
        for one row in consecutive blocks, else each row's blocks gathered into ``workspace``."""
        pool_tensor = self.pool.tensors[name]
        h, _, per_block = pool_tensor.shape[:3]
        unit = self.page_size // per_block
        span = slice(self.start // unit, (self.start + self.length) // unit)
        n = self._ids.shape[1]
        if self.run_start is not None:
            run = pool_tensor[:, self.run_start:self.run_start + n]
            return run.reshape(h, n * per_block, *pool_tensor.shape[3:])[None, :, span]
        return self._gather_rows(pool_tensor, f"{self.pool.spec.kind}.{name}", workspace)[:, :, span]

    def _gather_rows(self, pool_tensor: torch.Tensor, slot: str, workspace: PagedPool) -> torch.Tensor:
        """Copy each row's blocks into a contiguous ``[batch, heads, blocks * units, *rest]`` tensor
        (one ``index_select`` over ``[heads * blocks, block]``, into the workspace)."""
        b, n = self._ids.shape
        h, num_blocks, per_block = pool_tensor.shape[:3]
        rest = pool_tensor.shape[3:]
        ids = self._ids.to(pool_tensor.device)
        heads = torch.arange(h, device=pool_tensor.device) * num_blocks
        index = (ids[:, None, :] + heads[None, :, None]).flatten()
        out = workspace.workspace(slot, (b * h * n, per_block * math.prod(rest)), pool_tensor)
        torch.index_select(raw(pool_tensor).view(h * num_blocks, -1), 0, index, out=raw(out))
        return out.view(b, h, n * per_block, *rest)

    def select_rows(self, rows: torch.Tensor) -> None:
        if self._ids is None:
            return
        new = self._ids[rows.cpu()]
        self.pool.incref(new)
        self.pool.decref(self._ids)
        self.ids = new

    def memory_report(self) -> MemoryReport:
        """Blocks shared by several rows (forks, beams) count once, with their filled slots."""
        if self._ids is None or self._ids.shape[1] == 0:
            return MemoryReport()
        n = self._ids.shape[1]
        fill = torch.full((n,), self.page_size, dtype=torch.long)
        fill[-1] = self.start + self.length - (n - 1) * self.page_size
        fill[0] -= self.start
        unique, inverse = self._ids.flatten().unique(return_inverse=True)
        filled = torch.zeros(unique.numel(), dtype=torch.long).scatter_reduce_(
            0, inverse, fill.repeat(self.batch_size), "amax")
        block_bytes = self.pool.block_bytes
        return MemoryReport(allocated=unique.numel() * block_bytes,
                            used=int(filled.sum()) * block_bytes // self.page_size,
                            tokens=self.batch_size * self.length)
