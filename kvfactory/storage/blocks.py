"""Block pools and block tables: the memory under paged storage.

A ``BlockPool`` holds one kind of fixed-size block for one group of layers that hold the same
tokens (as vLLM's KV-cache groups: the full-attention layers of a model, the sliding layers of one
window size; a layer alone where layers differ, as under eviction). A block id names the same
slot in every layer of the group, so a block is allocated, refcounted, shared and copied on write
once per group. Each layer's tensors (``LayerBlocks``) are laid out ``[kv_heads, num_blocks,
units_per_block, ...]`` (plain K/V: a unit is a token; packed K/V: a unit is a codec unit,
``kvfactory.codecs``); the pool keeps a free list (least recently freed first) and refcounts.
Blocks a prefix cache references are marked ``cached``; the pool tells its ``watchers``
(``BlockWatcher``) whenever such a block becomes idle (only the prefix cache holds it) or is used
again, so the prefix cache keeps its idle blocks in one eviction-ordered queue without scanning
(``kvfactory.manager.prefix``). A ``PagedPool`` holds every block pool its caches use, by kind and
group.

A sequence's blocks in one group are one ``BlockIds`` (ids per batch row), shared by the group's
layers; each layer's ``BlockTable`` is its view of them (the span of tokens the layer holds): it
grows, writes and reads them, shares blocks between rows and copies a shared block before writing
into it, as in vLLM's block manager and nano-vllm's ``block_manager.py``. The first layer of a
group to write a step's tokens allocates their blocks; the others find them there.

Block kinds: ``kv`` (plain paged K/V), ``packed`` (quantized pages: codec codes, scales and zero
points) and ``window`` (the full-precision window of recent tokens in front of quantized pages).
Pool sizes (``pool_tokens`` / ``pool_blocks`` / ``pool_bytes``) bound the ``kv`` and ``packed``
blocks, where the tokens are; ``window`` blocks hold at most the codec's residual window plus one
unit per sequence row, so they grow on demand.
"""

from __future__ import annotations

import dataclasses
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
    """One layer's blocks: ``tensors`` holds ``(name, (kv_heads, units_per_block, *rest), dtype)``;
    ``group`` the layers whose blocks are allocated together (empty: the layer alone)."""

    kind: str
    layer_idx: int
    page_size: int  # tokens per block
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    device: torch.device
    group: tuple[int, ...] = ()
    encodes: tuple[tuple[int, int], tuple[int, int], torch.dtype] | None = None  # packed: K's and V's
    # (kv_heads, head_dim) and dtype, so a sequence adopting its blocks knows what they decode to

    @property
    def layers(self) -> tuple[int, ...]:
        return self.group or (self.layer_idx,)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """The block pool of this spec in a ``PagedPool``: by kind and layer group."""
        return self.kind, self.layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer."""
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.tensors)

    def same_blocks(self, other: PoolSpec) -> bool:
        """Whether ``other`` (a layer of the same group) takes blocks of this layout: every field but the
        layer equal (asked at each write's checks, so compared without building a copy)."""
        return other is self or all(getattr(other, f.name) == getattr(self, f.name)
                                    for f in dataclasses.fields(self) if f.name != "layer_idx")

    @classmethod
    def for_kv(cls, kind: str, layer_idx: int, page_size: int, key: torch.Tensor,
               value: torch.Tensor, group: tuple[int, ...] = ()) -> PoolSpec:
        """Plain K/V blocks shaped like ``key`` / ``value`` ``[batch, kv_heads, tokens, head_dim]``."""
        return cls(kind, layer_idx, page_size, (
            ("k", (key.shape[1], page_size, key.shape[3]), key.dtype),
            ("v", (value.shape[1], page_size, value.shape[3]), value.dtype)), key.device, group)


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
    """Fixed-size blocks of one kind for one group of layers, with a free list and refcounts; each
    layer's tensors (``layer``) hold its slot of every block.

    ``num_blocks=None`` makes the pool growable: it starts with the first request and grows by
    a quarter (at least what is asked) when a request does not fit.
    """

    def __init__(self, spec: PoolSpec, num_blocks: int | None):
        self.spec, self.page_size, self.layers = spec, spec.page_size, spec.layers
        self.layer_idx = self.layers[0]
        self.growable = num_blocks is None
        initial = num_blocks if num_blocks is not None else 0
        self._views: dict[int, LayerBlocks] = {}
        self.refcount = np.zeros(initial, dtype=np.int32)
        self.any_shared = False  # some block has refcount > 1: writes must check copy-on-write
        self.free: deque[int] = deque(range(initial))
        self.cached = np.zeros(initial, dtype=bool)  # blocks a prefix cache references (``hold_cached``)
        self.watchers: list[BlockWatcher] = []  # the prefix caches holding some of its blocks

    def layer(self, layer_idx: int) -> LayerBlocks:
        """Layer ``layer_idx``'s tensors of every block, made on first use."""
        view = self._views.get(layer_idx)
        if view is None:
            if layer_idx not in self.layers:
                raise ShapeError(f"layer {layer_idx} is not in the block group of layers {list(self.layers)}")
            with torch.inference_mode(False):  # the pool outlives any one inference_mode block
                tensors = {name: torch.empty((shape[0], self.num_blocks, *shape[1:]), dtype=dtype,
                                             device=self.spec.device)
                           for name, shape, dtype in self.spec.tensors}
            view = self._views[layer_idx] = LayerBlocks(self, layer_idx, tensors)
        return view

    @property
    def num_blocks(self) -> int:
        return self.refcount.size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer, every tensor together."""
        return self.spec.block_bytes

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its first tensor (plain K/V blocks: the K/V dtype)."""
        return self.spec.tensors[0][2]

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
            for view in self._views.values():
                for name, t in view.tensors.items():
                    grown = t.new_empty((t.shape[0], new, *t.shape[2:]))
                    grown[:, :old] = t
                    view.tensors[name] = grown
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
        """Copy block contents ``src[i] -> dst[i]`` in every layer (copy-on-write)."""
        for view in self._views.values():
            for t in view.tensors.values():
                raw(t)[:, dst] = raw(t)[:, src]

    def same_contents(self, a: int, b: int) -> bool:
        """Whether blocks ``a`` and ``b`` hold the same bytes in every layer."""
        return all(torch.equal(raw(t)[:, a], raw(t)[:, b]) for view in self._views.values()
                   for t in view.tensors.values())

    def memory_report(self) -> MemoryReport:
        used_blocks, layers = self.num_blocks - len(self.free), len(self._views)
        allocated = sum(t.nbytes for view in self._views.values() for t in view.tensors.values())
        return MemoryReport(allocated=allocated,
                            used=used_blocks * self.block_bytes * layers,
                            tokens=used_blocks * self.page_size * layers)


class LayerBlocks:
    """One layer's tensors of a ``BlockPool``'s blocks, ``[kv_heads, num_blocks, units_per_block, ...]``
    each: what a layer writes and reads; allocation is its ``pool``'s."""

    def __init__(self, pool: BlockPool, layer_idx: int, tensors: dict[str, torch.Tensor]) -> None:
        self.pool, self.layer_idx, self.tensors = pool, layer_idx, tensors

    @property
    def k(self) -> torch.Tensor:
        return self.tensors["k"]

    @property
    def v(self) -> torch.Tensor:
        return self.tensors["v"]

    @property
    def spec(self) -> PoolSpec:
        return self.pool.spec

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_bytes(self) -> int:
        return self.pool.block_bytes


class PagedPool:
    """Block pools for every layer group (and block kind) of a model; many caches (sequences) share
    one.

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
        self.pools: dict[tuple[str, tuple[int, ...]], BlockPool] = {}  # by ``PoolSpec.key``
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
        pool = self.pools.get(spec.key)
        if pool is not None and pool.spec is spec:  # the spec the pool was made for: checked then
            return pool
        if self.layout is not None:
            kv_heads, head_dim = self.layout
            plain = spec.kind != "packed"  # packed codes have codec-specific trailing shapes
            if any(shape[0] != kv_heads or plain and shape[-1] != head_dim for _, shape, _ in spec.tensors):
                raise ShapeError(f"layer {spec.layer_idx}: {spec.kind} blocks of {describe(spec)} do not fit "
                                 f"the model's kv_heads={kv_heads}, head_dim={head_dim}")
        if pool is None or pool.spec.same_blocks(spec):
            return pool
        if not pool.refcount.any():
            del self.pools[spec.key]
            return None
        raise ShapeError(f"layer {spec.layer_idx}: {spec.kind} blocks of {describe(spec)} do not fit the "
                         f"pool's {describe(pool.spec)}, which holds blocks in use")

    def block_pools(self, kind: str | None = "kv") -> list[BlockPool]:
        """The block pools of ``kind`` (None: every kind), by kind and first layer of their group."""
        return [self.pools[key] for key in sorted(self.pools) if kind in (None, key[0])]

    @property
    def layers(self) -> dict[int, BlockPool]:
        """The plain K/V block pool of each layer that has one (its group's)."""
        return {layer: pool for (kind, group), pool in self.pools.items() if kind == "kv" for layer in group}

    def workspace(self, slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A reusable buffer for multi-row reads, shared by every layer and cache of this pool."""
        return self._workspace.buffer(slot, shape, like)

    def block_pool(self, spec: PoolSpec) -> BlockPool:
        """The pool of ``spec``'s kind and layer group, allocated on first use (``_check_spec``)."""
        pool = self._check_spec(spec)
        if pool is None:
            pool = BlockPool(spec, self.capacity(spec))
            self.pools[spec.key] = pool
        return pool

    def layer_blocks(self, spec: PoolSpec) -> LayerBlocks:
        """``spec``'s layer's tensors in its group's pool (``block_pool``)."""
        return self.block_pool(spec).layer(spec.layer_idx)

    def capacity(self, spec: PoolSpec) -> int | None:
        """Blocks of ``spec``'s group (``None``: growable); ``pool_bytes`` is split evenly over layers."""
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
        for spec, needed in _totals(requests):
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
        for spec, needed in _totals(requests):
            pool = self.pools.get(spec.key)
            capacity = self.capacity(spec) if pool is None or pool.growable else pool.num_blocks
            if capacity is not None and needed > capacity:
                raise CacheFullError(spec.layer_idx, needed, capacity, capacity, spec.page_size)

    def memory_report(self) -> MemoryReport:
        """All block pools plus the read workspace (allocated, never counted as used)."""
        report = sum((p.memory_report() for p in self.pools.values()), MemoryReport())
        return MemoryReport(report.allocated + self._workspace.nbytes, report.used, report.tokens)

    def free_blocks(self) -> dict[int, int]:
        """Free plain K/V blocks per layer (its group's)."""
        return {i: len(p.free) for i, p in self.layers.items()}


def _totals(requests: list[tuple[PoolSpec, int]]) -> list[tuple[PoolSpec, int]]:
    """Requests summed per block pool (several caches' requests of one pool add up)."""
    totals: dict[tuple[str, tuple[int, ...]], tuple[PoolSpec, int]] = {}
    for spec, needed in requests:
        first, before = totals.get(spec.key, (spec, 0))
        totals[spec.key] = first, before + needed
    return list(totals.values())


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


class BlockIds:
    """One sequence's blocks ``[batch, blocks]`` in one group's ``BlockPool``, shared by the ``BlockTable``
    of each layer of the group (``tables``, the first one the group's leader): one allocation,
    refcount and copy-on-write per block for the whole group.

    ``run_start`` is the first id when a single row's blocks are consecutive in the pool, so a read can
    return a view instead of copying (the common single-sequence case). Forking or rearranging rows
    changes every layer's table at once: the first layer's call does it, the others' join it
    (``_round``).
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pool: BlockPool | None = None
        self.tables: list[BlockTable] = []
        self._ids: torch.Tensor | None = None
        self.run_start: int | None = None
        self._rounds: dict[str, tuple[object, list[BlockTable]]] = {}

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

    def take(self, pool: BlockPool, ids: torch.Tensor) -> None:
        """Reference blocks ``ids`` (filled elsewhere) in place of the held ones."""
        pool.incref(ids)
        self.drop()
        self.pool, self.ids = pool, ids.clone()

    def drop(self) -> None:
        if self._ids is not None and self.pool is not None:
            self.pool.decref(self._ids)
        self.ids = None

    def trim(self) -> None:
        """Give back the blocks no layer's tokens lie in: those before the first stored token of every
        layer and after the last (all of them once every table is empty)."""
        if self._ids is None:
            return
        held = [t for t in self.tables if t.length]
        if not held:  # emptied stores keep their place in their block (``drop_front``)
            self.pool.decref(self._ids)
            self.ids = self._ids[:, :0]
            for t in self.tables:
                t.start %= self.page_size
            return
        ps = self.page_size  # a layer yet to write this step's tokens will write them where it stands
        dead = min(t.start for t in self.tables) // ps
        keep = math.ceil(max(t.start + t.length for t in self.tables) / ps)
        if dead == 0 and keep >= self._ids.shape[1]:
            return
        self.pool.decref(torch.cat([self._ids[:, :dead], self._ids[:, keep:]], 1))
        self.ids = self._ids[:, dead:keep]
        for t in self.tables:
            t.start = max(0, t.start - dead * ps)

    def _round(self, op: str, table: BlockTable, arg: object) -> tuple[bool, object]:
        """Whether ``table`` is the first of the group to call ``op`` with ``arg`` (it does it) or joins a
        call the others began (they did it), and the round's value (``begin`` sets it)."""
        value, joined = self._rounds.get(op, (None, []))
        first = not joined or table in joined or (op == "select" and not torch.equal(value[0], arg))
        if first:
            joined = []
        joined.append(table)
        if len(joined) == len(self.tables):
            self._rounds.pop(op, None)
        else:
            self._rounds[op] = (value, joined)
        return first, value

    def begin(self, op: str, value: object) -> None:
        if op in self._rounds:
            self._rounds[op] = (value, self._rounds[op][1])


class GroupTables:
    """One sequence's ``BlockIds`` in each block pool of one layer group (plain or window K/V, quantized
    pages): made when the group's first layer asks for a kind, found there by the others, so each
    kind's blocks are allocated once for the group."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = layers
        self._ids: dict[str, BlockIds] = {}

    def ids(self, kind: str, page_size: int) -> BlockIds:
        """The group's ``BlockIds`` of ``kind``, blocks of ``page_size`` tokens."""
        shared = self._ids.setdefault(kind, BlockIds(page_size))
        if shared.page_size != page_size:
            raise ShapeError(f"layers {list(self.layers)}: {kind} blocks of {page_size} tokens joined a "
                             f"group whose blocks hold {shared.page_size}")
        return shared


class BlockTable:
    """One layer's view of a sequence's blocks (its group's ``BlockIds``): it holds tokens ``[start,
    start + length)`` of each row's blocks, written into this layer's tensors (``blocks``); released by
    ``release``. A table made alone is a group of one layer; ``join`` puts it in a group's.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.shared = BlockIds(page_size)
        self.shared.tables.append(self)
        self.blocks: LayerBlocks | None = None  # this layer's tensors, from its first write
        self.start = self.length = 0

    def join(self, shared: BlockIds) -> None:
        """Share ``shared``'s blocks with the other layers of a group (this table empty)."""
        if self.length or self.ids is not None:
            raise ShapeError("join: a block table holding tokens cannot change groups")
        self.shared.tables.remove(self)
        self.shared = shared
        shared.tables.append(self)

    @property
    def ids(self) -> torch.Tensor | None:
        return self.shared.ids

    @ids.setter
    def ids(self, ids: torch.Tensor | None) -> None:
        self.shared.ids = ids

    @property
    def pool(self) -> BlockPool | None:
        return self.shared.pool

    @property
    def run_start(self) -> int | None:
        return self.shared.run_start

    @property
    def leader(self) -> bool:
        """The group's first layer: the one that answers for the group's block requests."""
        return self.shared.tables[0] is self

    @property
    def batch_size(self) -> int:
        """Rows held; a layer yet to take part in a rearrangement its group began sees them as before."""
        pending = self.shared._rounds.get("select")
        if pending is not None and self not in pending[1]:
            return pending[0][1]
        return 0 if self.ids is None else self.ids.shape[0]

    def release(self) -> None:
        """Hold nothing; blocks no layer of the group holds go back to the pool."""
        self.start = self.length = 0
        if any(t.length for t in self.shared.tables):
            self.shared.trim()
        else:
            self.shared.drop()
            for t in self.shared.tables:
                t.start = 0

    def adopt(self, blocks: LayerBlocks, ids: torch.Tensor, start: int, length: int) -> None:
        """Hold tokens ``[start, start + length)`` of blocks ``ids [batch, blocks]`` already filled
        elsewhere (a fork, a cached prefix): referenced, not copied; a write into a shared block
        copies it first. The group's other layers adopt the same blocks."""
        shared = self.shared
        self.start = self.length = 0
        if any(t.length for t in shared.tables):
            if shared.pool is not blocks.pool or not torch.equal(shared.ids, ids):
                raise ShapeError(f"layer {blocks.layer_idx}: adopting blocks other than those the other "
                                 f"layers of its group hold")
        else:
            shared.take(blocks.pool, ids)
        self.blocks, self.start, self.length = blocks, start, length

    def fork_into(self, twin: BlockTable) -> None:
        """Make the empty ``twin`` this layer's table in a fork of the sequence: the same blocks,
        referenced once more; the layers of a group forked together share the twin's ``BlockIds``."""
        shared = self.shared
        first, value = shared._round("fork", self, None)
        if first:
            if shared.ids is not None:
                twin.shared.take(shared.pool, shared.ids)
            shared.begin("fork", twin.shared)
        else:
            twin.join(value)
        twin.blocks, twin.start, twin.length = self.blocks, self.start, self.length

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def growth(self, new_tokens: int) -> int:
        """New blocks each row needs to hold ``new_tokens`` more tokens."""
        have = 0 if self.ids is None else self.ids.shape[1]
        return max(self.blocks_for(self.start + self.length + new_tokens) - have, 0)

    def cow_rows(self) -> torch.Tensor | None:
        """Rows whose block receiving the next write is shared and must be copied first (a block the
        table already holds there: one partly filled, or one another layer of the group still reads
        after this layer gave its tokens back)."""
        fill, ids = self.start + self.length, self.ids
        if ids is None or fill // self.page_size >= ids.shape[1] or not self.pool.any_shared:
            return None
        col = ids[:, fill // self.page_size]
        shared = (self.pool.refcount[col.numpy()] > 1).nonzero()[0]
        return torch.from_numpy(shared) if shared.size else None

    def blocks_needed(self, new_tokens: int, batch: int) -> int:
        cow = self.cow_rows()
        return batch * self.growth(new_tokens) + (0 if cow is None else cow.numel())

    def append(self, blocks: LayerBlocks, tensors: dict[str, torch.Tensor], tokens: int) -> None:
        """Write ``tokens`` more tokens: ``tensors[name]`` is ``[batch, kv_heads, units, *rest]`` in
        ``name``'s units. Nothing is written unless every block the append needs can be handed out."""
        batch = next(iter(tensors.values())).shape[0]
        if self.ids is None and batch > 1 and blocks.spec.kind == "kv":
            first = first_equal_rows(tensors)
            if first is not None:  # rows repeat earlier ones (num_return_sequences): write each once, share
                distinct = first.unique()
                rows = {name: x[distinct.to(x.device)] for name, x in tensors.items()}
                self.append(blocks, rows, tokens)
                self._select(torch.searchsorted(distinct, first))
                return
        if self.ids is None:
            self.shared.pool = blocks.pool
            self.ids = torch.empty((batch, 0), dtype=torch.long)
        elif batch != self.ids.shape[0]:
            raise ShapeError(f"layer {blocks.layer_idx}: batch {batch} appended to a store of batch "
                             f"{self.ids.shape[0]}")
        self.blocks = blocks
        self._make_room(batch, tokens)
        write_rows(blocks, self.ids, torch.full((batch,), self.start + self.length), tensors, tokens)
        self.length += tokens

    def _make_room(self, batch: int, tokens: int) -> None:
        """New blocks for ``tokens`` more tokens per row and private copies of shared blocks they write
        into; ``CacheFullError`` before any change if the pool cannot hand them out. The group's first
        layer to write them makes the room; the others find it made."""
        grow, cow = self.growth(tokens), self.cow_rows()
        if grow or cow is not None:
            pool = self.pool
            pool.check(batch * grow + (0 if cow is None else cow.numel()))
            if cow is not None:
                col = (self.start + self.length) // self.page_size
                self.unshare(cow, torch.full_like(cow, col))
            if grow:
                self.ids = torch.cat([self.ids, pool.allocate(batch * grow).view(batch, grow)], dim=1)

    def next_slot(self, blocks: LayerBlocks) -> int:
        """Make room for one more token of this one-row table of plain K/V blocks and count it written:
        its slot in the layer's ``[heads, blocks * page_size]`` view, for the caller to write."""
        fill = self._claim(blocks, 1)
        return int(self.ids[0, fill // self.page_size]) * self.page_size + fill % self.page_size

    def next_slots(self, blocks: LayerBlocks, tokens: int) -> torch.Tensor:
        """``next_slot`` for ``tokens`` more tokens at once (a prefill chunk): their slots ``[tokens]``."""
        at = torch.arange(self._claim(blocks, tokens), self.start + self.length)
        return self.ids[0, at // self.page_size] * self.page_size + at % self.page_size

    def _claim(self, blocks: LayerBlocks, tokens: int) -> int:
        """Room for ``tokens`` more tokens of this one-row table, counted written: the first one's place."""
        if self.ids is None:
            self.shared.pool = blocks.pool
            self.ids = torch.empty((1, 0), dtype=torch.long)
        self.blocks = blocks
        self._make_room(1, tokens)
        fill = self.start + self.length
        self.length += tokens
        return fill

    def unshare(self, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """Give this group private copies of the blocks at ``(rows, cols)``, in every layer."""
        old = self.ids[rows, cols]
        new = self.pool.allocate(rows.numel())
        self.pool.copy_blocks(old, new)
        ids = self.ids.clone()
        ids[rows, cols] = new
        self.ids = ids
        self.pool.decref(old)

    def read(self, name: str, workspace: PagedPool) -> torch.Tensor:
        """Tensor ``name`` of the held tokens, ``[batch, kv_heads, units, *rest]``: a view of the pool
        for one row in consecutive blocks, else each row's blocks gathered into ``workspace``."""
        pool_tensor = self.blocks.tensors[name]
        h, _, per_block = pool_tensor.shape[:3]
        unit = self.page_size // per_block
        span = slice(self.start // unit, (self.start + self.length) // unit)
        n = self.ids.shape[1]
        if self.run_start is not None:
            run = pool_tensor[:, self.run_start:self.run_start + n]
            return run.reshape(h, n * per_block, *pool_tensor.shape[3:])[None, :, span]
        return self._gather_rows(pool_tensor, f"{self.blocks.spec.kind}.{name}", workspace)[:, :, span]

    def _gather_rows(self, pool_tensor: torch.Tensor, slot: str, workspace: PagedPool) -> torch.Tensor:
        """Copy each row's blocks into a contiguous ``[batch, heads, blocks * units, *rest]`` tensor
        (one ``index_select`` over ``[heads * blocks, block]``, into the workspace)."""
        b, n = self.ids.shape
        h, num_blocks, per_block = pool_tensor.shape[:3]
        rest = pool_tensor.shape[3:]
        ids = self.ids.to(pool_tensor.device)
        heads = torch.arange(h, device=pool_tensor.device) * num_blocks
        index = (ids[:, None, :] + heads[None, :, None]).flatten()
        out = workspace.workspace(slot, (b * h * n, per_block * math.prod(rest)), pool_tensor)
        torch.index_select(raw(pool_tensor).view(h * num_blocks, -1), 0, index, out=raw(out))
        return out.view(b, h, n * per_block, *rest)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Rebuild the batch from ``rows`` (beams): the group's first layer to call it rearranges the
        group's blocks, the others find them rearranged."""
        if self.ids is None:
            return
        rows, before = rows.cpu(), self.ids.shape[0]
        first, _ = self.shared._round("select", self, rows)
        if first:
            self.shared.begin("select", (rows, before))
            self._select(rows)

    def _select(self, rows: torch.Tensor) -> None:
        new = self.ids[rows.cpu()]
        self.pool.incref(new)
        self.pool.decref(self.ids)
        self.ids = new

    def memory_report(self) -> MemoryReport:
        """Blocks shared by several rows (forks, beams) count once, with their filled slots."""
        first = self.start // self.page_size  # blocks before it are held for the group's other layers
        ids = None if self.ids is None else self.ids[:, first:self.blocks_for(self.start + self.length)]
        if ids is None or ids.shape[1] == 0:
            return MemoryReport()
        start, n = self.start - first * self.page_size, ids.shape[1]
        fill = torch.full((n,), self.page_size, dtype=torch.long)
        fill[-1] = start + self.length - (n - 1) * self.page_size
        fill[0] -= start
        unique, inverse = ids.flatten().unique(return_inverse=True)
        filled = torch.zeros(unique.numel(), dtype=torch.long).scatter_reduce_(
            0, inverse, fill.repeat(self.batch_size), "amax")
        block_bytes = self.pool.block_bytes
        return MemoryReport(allocated=unique.numel() * block_bytes,
                            used=int(filled.sum()) * block_bytes // self.page_size,
                            tokens=self.batch_size * self.length)


def append_each(tables: list[BlockTable], blocks: LayerBlocks, tensors: dict[str, torch.Tensor],
                tokens: int) -> None:
    """Write ``tokens`` more tokens into each one-row table ``tables[i]`` of one layer's ``blocks``: row
    ``i`` of ``tensors[name]`` (``[S, kv_heads, units, *rest]``), one copy per tensor for every table (a
    batched step's write). Nothing is written unless every block the tables need can be handed out."""
    blocks.pool.check(sum(table.blocks_needed(tokens, 1) for table in tables))
    for table in tables:
        if table.ids is None:
            table.shared.pool = blocks.pool
            table.ids = torch.empty((1, 0), dtype=torch.long)
        elif table.ids.shape[0] != 1:
            raise ShapeError(f"layer {blocks.layer_idx}: append_each writes one-row tables; one holds "
                             f"{table.ids.shape[0]} rows")
        table.blocks = blocks
        table._make_room(1, tokens)
    fills = torch.tensor([table.start + table.length for table in tables])
    ids = torch.nn.utils.rnn.pad_sequence([table.ids[0] for table in tables], batch_first=True)
    write_rows(blocks, ids, fills, tensors, tokens)
    for table in tables:
        table.length += tokens


def write_rows(blocks: LayerBlocks, ids: torch.Tensor, fills: torch.Tensor, tensors: dict[str, torch.Tensor],
               tokens: int) -> None:
    """Write ``tokens`` tokens of row ``i`` of each ``tensors[name]`` (``[rows, kv_heads, units, *rest]``)
    into the blocks ``ids[i]`` of ``blocks`` from token ``fills[i]`` on, one copy per tensor; the blocks
    are already held."""
    page = blocks.spec.page_size
    for name, x in tensors.items():
        pool_tensor = blocks.tensors[name]
        h, num_blocks, per_block = pool_tensor.shape[:3]
        unit = page // per_block
        at = fills[:, None] + torch.arange(0, tokens, unit)  # [rows, units]: each unit's first token
        slots = ids.gather(1, at // page) * per_block + at % page // unit
        flat = raw(pool_tensor).view(h, num_blocks * per_block, *pool_tensor.shape[3:])
        rows = raw(x).transpose(0, 1).reshape(h, -1, *x.shape[3:])
        flat.index_copy_(1, slots.flatten().to(x.device), rows)
