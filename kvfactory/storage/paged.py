"""Paged storage: a preallocated block pool per layer shared by many caches.

Each layer pool holds K and V as ``[kv_heads, num_blocks, page_size, head_dim]`` with a free list
(LRU-first) and per-block refcounts; each cache keeps a block table per batch row. Blocks are
shared between rows or caches by refcount and copied on write (as in vLLM's block manager and
nano-vllm's ``block_manager.py``).
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfactory.errors import CacheFullError, ConfigError, ShapeError
from kvfactory.storage.base import LayerStore, MemoryReport, check_kv
from kvfactory.storage.workspace import ReadWorkspace


class BlockPool:
    """Fixed-size KV blocks of one layer, with a free list and refcounts.

    ``num_blocks=None`` makes the pool growable: it starts with the first request and grows by
    a quarter (at least what is asked) when a request does not fit.
    """

    def __init__(self, layer_idx: int, page_size: int, kv_heads: int, head_dim: int, v_head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_blocks: int | None):
        self.layer_idx, self.page_size, self.growable = layer_idx, page_size, num_blocks is None
        initial = num_blocks if num_blocks is not None else 0
        with torch.inference_mode(False):  # the pool outlives any one inference_mode block
            self.k = torch.empty((kv_heads, initial, page_size, head_dim), dtype=dtype, device=device)
            self.v = torch.empty((kv_heads, initial, page_size, v_head_dim), dtype=dtype, device=device)
        self.refcount = np.zeros(initial, dtype=np.int32)
        self.any_shared = False  # some block has refcount > 1: writes must check copy-on-write
        self.free: deque[int] = deque(range(initial))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, keys and values together."""
        return self.page_size * (self.k.shape[0] * self.k.shape[3] + self.v.shape[0] * self.v.shape[3]) \
            * self.k.element_size()

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
            for name in ("k", "v"):
                t = getattr(self, name)
                grown = t.new_empty((t.shape[0], new, t.shape[2], t.shape[3]))
                grown[:, :old] = t
                setattr(self, name, grown)
        self.refcount = np.concatenate([self.refcount, np.zeros(new - old, dtype=np.int32)])
        self.free.extend(range(old, new))

    def incref(self, ids: torch.Tensor) -> None:
        np.add.at(self.refcount, ids.flatten().cpu().numpy(), 1)
        self.any_shared = bool((self.refcount > 1).any())

    def decref(self, ids: torch.Tensor) -> None:
        ids = ids.flatten().cpu().numpy()
        if ids.size == 0:
            return
        np.add.at(self.refcount, ids, -1)
        touched = np.unique(ids)
        if (self.refcount[touched] < 0).any():
            raise RuntimeError(f"layer {self.layer_idx}: block freed more often than referenced")
        self.free.extend(touched[self.refcount[touched] == 0].tolist())
        self.any_shared = bool((self.refcount > 1).any())

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy block contents ``src[i] -> dst[i]`` (copy-on-write)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def memory_report(self) -> MemoryReport:
        used_blocks = self.num_blocks - len(self.free)
        return MemoryReport(allocated=self.k.nbytes + self.v.nbytes, used=used_blocks * self.block_bytes,
                            tokens=used_blocks * self.page_size)


class PagedPool:
    """Block pools for every layer of a model; many caches (sequences) share one.

    Size it with exactly one of ``tokens``, ``blocks`` or ``bytes`` (per layer for tokens and
    blocks, in total for bytes); with none, each layer pool grows on demand.
    """

    def __init__(self, page_size: int = 16, *, tokens: int | None = None, blocks: int | None = None,
                 bytes: int | None = None, num_layers: int = 1):
        given = {k: v for k, v in (("pool_tokens", tokens), ("pool_blocks", blocks), ("pool_bytes", bytes))
                 if v is not None}
        if len(given) > 1:
            raise ConfigError(", ".join(given), tuple(given.values()), "at most one of pool_tokens, "
                              "pool_blocks, pool_bytes")
        self.page_size, self.num_layers = page_size, num_layers
        self._blocks = blocks if blocks is not None else (
            math.ceil(tokens / page_size) if tokens is not None else None)
        self._bytes = bytes
        self.layers: dict[int, BlockPool] = {}
        self._workspace = ReadWorkspace()

    def workspace(self, slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A reusable buffer for multi-row reads, shared by every layer and cache of this pool."""
        return self._workspace.buffer(slot, shape, like)

    def layer(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> BlockPool:
        """The pool of ``layer_idx``, allocated on first use with the dtype/device of ``key``."""
        pool = self.layers.get(layer_idx)
        if pool is None:
            pool = BlockPool(layer_idx, self.page_size, key.shape[1], key.shape[3], value.shape[3],
                             key.dtype, key.device, self._capacity(key, value))
            self.layers[layer_idx] = pool
        return pool

    def _capacity(self, key: torch.Tensor, value: torch.Tensor) -> int | None:
        """Blocks per layer (``None``: growable); ``pool_bytes`` is split evenly over the layers."""
        if self._bytes is None:
            return self._blocks
        block_bytes = self.page_size * key.shape[1] * (key.shape[3] + value.shape[3]) * key.element_size()
        blocks = self._bytes // (block_bytes * self.num_layers)
        if blocks < 1:
            raise ConfigError("pool_bytes", self._bytes, f">= {block_bytes * self.num_layers} (one block in "
                              f"every layer)")
        return blocks

    def check(self, needs: dict[int, int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Raise ``CacheFullError`` unless every layer can hand out the blocks in ``needs``.

        A layer whose pool is not allocated yet is judged by the size it will get (shaped like
        ``key``/``value``).
        """
        for layer_idx, needed in needs.items():
            if layer_idx in self.layers:
                self.layers[layer_idx].check(needed)
                continue
            capacity = self._capacity(key, value)
            if capacity is not None and needed > capacity:
                raise CacheFullError(layer_idx, needed, capacity, capacity, self.page_size)

    def memory_report(self) -> MemoryReport:
        """All layer pools plus the read workspace (allocated, never counted as used)."""
        report = sum((p.memory_report() for p in self.layers.values()), MemoryReport())
        return MemoryReport(report.allocated + self._workspace.nbytes, report.used, report.tokens)

    def free_blocks(self) -> dict[int, int]:
        return {i: len(p.free) for i, p in self.layers.items()}


class _Table:
    """Block ids ``[batch, blocks]`` of one store; released to the pool when the store dies.

    ``run_start`` is the first id when a single row's blocks are consecutive in the pool, so
    ``gather`` can return a view instead of copying (the common single-sequence case).
    """

    def __init__(self) -> None:
        self._ids: torch.Tensor | None = None
        self.pool: BlockPool | None = None
        self.run_start: int | None = None

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

    def release(self) -> None:
        if self._ids is not None and self.pool is not None:
            self.pool.decref(self._ids)
        self.ids = None


@dataclass(eq=False)
class PagedStore(LayerStore):
    """Paged KV storage of one layer: block tables over a shared ``PagedPool``."""

    page_size: int = 16
    pool_tokens: int | None = None
    pool_blocks: int | None = None
    pool_bytes: int | None = None

    pool: PagedPool | None = field(default=None, init=False, repr=False)
    _table: _Table = field(default_factory=_Table, init=False, repr=False)
    _start: int = field(default=0, init=False, repr=False)
    _len: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("page_size", "pool_tokens", "pool_blocks", "pool_bytes"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(key, value, "a positive integer")
        weakref.finalize(self, self._table.release)

    @classmethod
    def make_shared(cls, options: dict, num_layers: int) -> PagedPool:
        """One pool for all layers of the caches a factory creates."""
        return PagedPool(options.get("page_size", 16), tokens=options.get("pool_tokens"),
                         blocks=options.get("pool_blocks"), bytes=options.get("pool_bytes"),
                         num_layers=num_layers)

    def attach(self, pool: PagedPool) -> None:
        if pool.page_size != self.page_size:
            raise ConfigError("page_size", self.page_size, f"the pool's page size {pool.page_size}")
        self.pool = pool

    # -- geometry -------------------------------------------------------------------------
    @property
    def _ids(self) -> torch.Tensor | None:
        return self._table.ids

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def _cow_rows(self) -> torch.Tensor | None:
        """Rows whose block receiving the next write is shared and must be copied first."""
        fill = self._start + self._len
        if self._ids is None or fill % self.page_size == 0 or not self._table.pool.any_shared:
            return None
        col = self._ids[:, fill // self.page_size]
        shared = (self._table.pool.refcount[col.numpy()] > 1).nonzero()[0]
        return torch.from_numpy(shared) if shared.size else None

    def _growth(self, new_tokens: int) -> int:
        """New blocks each row needs to hold ``new_tokens`` more tokens."""
        have = 0 if self._ids is None else self._ids.shape[1]
        return max(self._blocks_for(self._start + self._len + new_tokens) - have, 0)

    def blocks_needed(self, new_tokens: int, batch: int) -> int:
        cow = self._cow_rows()
        return batch * self._growth(new_tokens) + (0 if cow is None else cow.numel())

    # -- LayerStore -----------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        check_kv(key, value)
        if self.pool is None:
            self.attach(self.make_shared(vars(self), 1))
        b, h, t, d = key.shape
        block_pool = self.pool.layer(self.layer_idx, key, value)
        if (h, d, value.shape[3]) != (block_pool.k.shape[0], block_pool.k.shape[3], block_pool.v.shape[3]):
            raise ShapeError(f"layer {self.layer_idx}: key {tuple(key.shape)} / value {tuple(value.shape)} "
                             f"do not fit the pool's kv_heads={block_pool.k.shape[0]}, head_dim="
                             f"{block_pool.k.shape[3]}/{block_pool.v.shape[3]}")
        if key.dtype != block_pool.k.dtype or key.device != block_pool.k.device:
            raise ShapeError(f"layer {self.layer_idx}: key is {key.dtype} on {key.device}, the pool holds "
                             f"{block_pool.k.dtype} on {block_pool.k.device}")
        if self._ids is None:
            self._table.pool = block_pool
            self._table.ids = torch.empty((b, 0), dtype=torch.long)
        elif b != self._ids.shape[0]:
            raise ShapeError(f"layer {self.layer_idx}: batch {b} appended to a store of batch "
                             f"{self._ids.shape[0]}")
        grow, cow = self._growth(t), self._cow_rows()
        if grow or cow is not None:
            # nothing is written unless every block this append needs can be handed out
            block_pool.check(b * grow + (0 if cow is None else cow.numel()))
            if cow is not None:
                self._copy_on_write(block_pool, cow)
            if grow:
                self._table.ids = torch.cat([self._ids, block_pool.allocate(b * grow).view(b, grow)], dim=1)
        fill, ps = self._start + self._len, self.page_size
        first_col, offset = fill // ps, fill % ps
        cols = self._ids[:, first_col:(fill + t - 1) // ps + 1] * ps
        slots = (cols[:, :, None] + torch.arange(ps)).flatten(1)[:, offset:offset + t].flatten()
        slots = slots.to(key.device)
        flat_k = block_pool.k.view(h, -1, d)
        flat_v = block_pool.v.view(h, -1, value.shape[3])
        flat_k.index_copy_(1, slots, key.transpose(0, 1).reshape(h, b * t, d))
        flat_v.index_copy_(1, slots, value.transpose(0, 1).reshape(h, b * t, value.shape[3]))
        self._len += t

    def _copy_on_write(self, block_pool: BlockPool, rows: torch.Tensor) -> None:
        col = (self._start + self._len) // self.page_size
        self._unshare(block_pool, rows, torch.full_like(rows, col))

    def _unshare(self, block_pool: BlockPool, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """Give this store private copies of the blocks at ``(rows, cols)`` of its table."""
        old = self._ids[rows, cols]
        new = block_pool.allocate(rows.numel())
        block_pool.copy_blocks(old, new)
        ids = self._ids.clone()
        ids[rows, cols] = new
        self._table.ids = ids
        block_pool.decref(old)

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ids is None:
            raise ShapeError(f"layer {self.layer_idx}: nothing stored yet")
        block_pool = self._table.pool
        n = self._ids.shape[1]
        span = slice(self._start, self._start + self._len)
        run = self._table.run_start
        if run is not None:  # one row in consecutive blocks: a view, no copy
            keys = block_pool.k[:, run:run + n].reshape(block_pool.k.shape[0], n * self.page_size, -1)
            values = block_pool.v[:, run:run + n].reshape(block_pool.v.shape[0], n * self.page_size, -1)
            return keys[None, :, span], values[None, :, span]
        keys, values = self._gather_rows(block_pool.k, "k"), self._gather_rows(block_pool.v, "v")
        return keys[:, :, span], values[:, :, span]

    def _gather_rows(self, pool_tensor: torch.Tensor, slot: str) -> torch.Tensor:
        """Copy each row's blocks into a contiguous ``[batch, heads, blocks * page, dim]`` tensor
        (one ``index_select`` over ``[heads * blocks, page * dim]``, into the pool's workspace)."""
        b, n = self._ids.shape
        h, num_blocks, ps, d = pool_tensor.shape
        ids = self._ids.to(pool_tensor.device)
        heads = torch.arange(h, device=pool_tensor.device) * num_blocks
        index = (ids[:, None, :] + heads[None, :, None]).flatten()
        out = self.pool.workspace(slot, (b * h * n, ps * d), pool_tensor)
        torch.index_select(pool_tensor.view(h * num_blocks, ps * d), 0, index, out=out)
        return out.view(b, h, n * ps, d)

    def size(self) -> int:
        return self._len

    @property
    def batch_size(self) -> int:
        return 0 if self._ids is None else self._ids.shape[0]

    def clear(self) -> None:
        self._table.release()
        self._start = self._len = 0

    def keep(self, index: torch.Tensor) -> None:
        """Compact in place: kept tokens move to the front of the row's own blocks, emptied blocks
        go back to the pool. Shared blocks are copied before they are written, so forks never see it.
        """
        index = index.cpu()
        kept, ps = index.numel(), self.page_size
        if kept and (self._ids is None or int(index[-1]) >= self._len):
            raise ShapeError(f"layer {self.layer_idx}: keep index up to {int(index[-1])} but "
                             f"{self._len} tokens are stored")
        if self._ids is None:
            return
        block_pool, kept_blocks = self._table.pool, self._blocks_for(kept)
        if block_pool.any_shared and kept_blocks:
            shared = torch.from_numpy(block_pool.refcount[self._ids[:, :kept_blocks].numpy()] > 1)
            rows, cols = shared.nonzero(as_tuple=True)
            if rows.numel():
                block_pool.check(rows.numel())
                self._unshare(block_pool, rows, cols)
        src, dst = self._start + index, torch.arange(kept)
        src_slots = (self._ids[:, src // ps] * ps + src % ps).flatten().to(block_pool.k.device)
        dst_slots = (self._ids[:, dst // ps] * ps + dst % ps).flatten().to(block_pool.k.device)
        for pool_tensor in (block_pool.k, block_pool.v):
            flat = pool_tensor.view(pool_tensor.shape[0], -1, pool_tensor.shape[3])
            flat.index_copy_(1, dst_slots, flat.index_select(1, src_slots))
        self._start, self._len = 0, kept
        block_pool.decref(self._ids[:, kept_blocks:])
        self._table.ids = self._ids[:, :kept_blocks]

    def drop_front(self, n: int) -> None:
        n = min(n, self._len)
        self._start += n
        self._len -= n
        dead = self._start // self.page_size
        if dead and self._ids is not None:
            self._table.pool.decref(self._ids[:, :dead])
            self._table.ids = self._ids[:, dead:]
            self._start -= dead * self.page_size

    def truncate(self, n: int) -> None:
        self._len = max(0, min(n, self._len))
        if self._ids is None:
            return
        keep = self._blocks_for(self._start + self._len)
        if keep < self._ids.shape[1]:
            self._table.pool.decref(self._ids[:, keep:])
            self._table.ids = self._ids[:, :keep]

    def select_rows(self, rows: torch.Tensor) -> None:
        if self._ids is None:
            return
        new = self._ids[rows.cpu()]
        self._table.pool.incref(new)
        self._table.pool.decref(self._ids)
        self._table.ids = new

    def memory_report(self) -> MemoryReport:
        """Blocks shared by several rows (forks, beams) count once, with their filled slots."""
        if self._ids is None or self._ids.shape[1] == 0:
            return MemoryReport()
        block_pool = self._table.pool
        n = self._ids.shape[1]
        fill = torch.full((n,), self.page_size, dtype=torch.long)
        fill[-1] = self._start + self._len - (n - 1) * self.page_size
        fill[0] -= self._start
        unique, inverse = self._ids.flatten().unique(return_inverse=True)
        filled = torch.zeros(unique.numel(), dtype=torch.long).scatter_reduce_(
            0, inverse, fill.repeat(self.batch_size), "amax")
        token_bytes = block_pool.block_bytes // self.page_size
        return MemoryReport(allocated=unique.numel() * block_pool.block_bytes,
                            used=int(filled.sum()) * token_bytes, tokens=self.batch_size * self._len)
