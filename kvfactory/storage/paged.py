"""Paged storage: K/V in fixed-size blocks of a pool shared by many caches.

Each cache keeps a block table per batch row over its layer group's block pool
(``kvfactory.storage.blocks``): layers that hold the same tokens share one table per sequence, so
a block is allocated once for all of them. Blocks are shared between rows or caches by refcount
and copied on write (as in vLLM's block manager and nano-vllm's ``block_manager.py``).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from kvfactory.errors import ConfigError, ShapeError, UnsupportedError
from kvfactory.storage.base import LayerStore, MemoryReport, PrefixLayout, check_kv
from kvfactory.storage.blocks import BlockIds, BlockTable, GroupTables, LayerBlocks, PagedPool, PoolSpec, raw
from kvfactory.storage.ragged import block_tables

MAX_PAGE_SIZE = 65536  # tokens per block: larger pages are a typo, not a layout


class BlockTableStore(Protocol):
    """The block-table API between a ``KVCacheManager`` and the stores, used through ``KVCache``
    (``prefix_blocks``, ``adopt_blocks``, ``pages_from_start``, ``drop_front``): the manager never
    reads a store's block table itself. ``PagedStore`` (plain pages) implements it; stores of
    quantized pages or with an eviction policy take no part (they are forked, paused and saved whole)."""

    def size(self) -> int:
        """Tokens stored per batch row."""

    def held_blocks(self) -> torch.Tensor | None:
        """Every block ``[batch, blocks]`` the store references (accounting)."""

    def block_ids(self) -> torch.Tensor | None:
        """The blocks holding the stored tokens from the sequence's token 0, else None."""

    def sequence_blocks(self) -> torch.Tensor | None:
        """The blocks by their place in the sequence, from its block 0, ``-1`` for blocks given back
        from the front (a sliding window's past), else None."""

    def stored_from(self) -> int:
        """The place in the sequence of the first stored token, as far as this store knows."""

    def adopt(self, ids: torch.Tensor, tokens: int, first: int = 0) -> None:
        """Start an empty store holding tokens ``[first, tokens)`` from shared blocks of its layer's pool
        (referenced, copied on write)."""

    def drop_front(self, n: int) -> None:
        """Give back the blocks of the oldest ``n`` stored tokens."""

    def prepend(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Put whole pages back in front (a partial swap coming back)."""


@dataclass(eq=False)
class PagedStore(LayerStore):
    """Paged KV storage of one layer: a block table over a shared ``PagedPool``.

    ``kind`` names the pool's blocks it takes (``kvfactory.storage.blocks``): ``kv``, or ``window``
    when it holds the full-precision window in front of quantized pages (``kvfactory.compose`` sets
    it; it is not a config option).
    """

    plain_pages: ClassVar[bool] = True

    page_size: int = 16
    pool_tokens: int | None = None
    pool_blocks: int | None = None
    pool_bytes: int | None = None

    pool: PagedPool | None = field(default=None, init=False, repr=False)
    kind: str = field(default="kv", repr=False, metadata={"option": False})
    group: tuple[int, ...] = field(default=(), init=False, repr=False)  # ``share_blocks``
    _table: BlockTable = field(init=False, repr=False)
    # tokens dropped from the front (windows, partial swaps) and whether ``keep`` left gaps: blocks
    # that do not hold the sequence from its first token are never offered as a prefix (``block_ids``)
    _dropped: int = field(default=0, init=False, repr=False)
    _gapped: bool = field(default=False, init=False, repr=False)
    _last_spec: tuple[tuple, PoolSpec] | None = field(default=None, init=False, repr=False)  # ``_spec``'s

    def __post_init__(self) -> None:
        for key in ("page_size", "pool_tokens", "pool_blocks", "pool_bytes"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(key, value, "a positive integer")
        if self.page_size > MAX_PAGE_SIZE:
            raise ConfigError("page_size", self.page_size, f"at most {MAX_PAGE_SIZE} tokens")
        self._table = BlockTable(self.page_size)
        weakref.finalize(self, self._table.release)

    @classmethod
    def make_shared(cls, options: dict, num_layers: int) -> PagedPool:
        """One pool for all layers of the caches a factory creates."""
        return PagedPool(options.get("page_size", 16), tokens=options.get("pool_tokens"),
                         blocks=options.get("pool_blocks"), bytes=options.get("pool_bytes"),
                         num_layers=num_layers)

    def share_blocks(self, tables: GroupTables) -> None:
        """Allocate together with the other layers of a group (layers that hold the same tokens): this
        sequence's blocks of this store's kind in the group's pool are ``tables``', one table for all."""
        self.group = tables.layers
        self._table.join(tables.ids(self.kind, self.page_size))

    def attach(self, pool: PagedPool) -> None:
        if pool.page_size != self.page_size:
            raise ConfigError("page_size", self.page_size, f"the pool's page size {pool.page_size}")
        self.pool = pool

    def ensure_pool(self) -> PagedPool:
        """The attached pool; a store used on its own gets a private one."""
        if self.pool is None:
            self.attach(self.make_shared(vars(self), 1))
        return self.pool

    @property
    def _ids(self) -> torch.Tensor | None:
        return self._table.ids

    def _spec(self, key: torch.Tensor, value: torch.Tensor) -> PoolSpec:
        """The blocks a write shaped like ``key`` / ``value`` takes; the last one made is kept, since every
        write of a layer asks it again (a decode step, once per sequence and layer)."""
        shapes = (key.shape[1], key.shape[3], value.shape[1], value.shape[3], key.dtype, value.dtype,
                  key.device, self.layer_idx, self.group)
        if self._last_spec is None or self._last_spec[0] != shapes:
            self._last_spec = shapes, PoolSpec.for_kv(self.kind, self.layer_idx, self.page_size, key, value,
                                                      self.group)
        return self._last_spec[1]

    def block_requests(self, new_tokens: int, batch: int, key: torch.Tensor,
                       value: torch.Tensor) -> list[tuple[PoolSpec, int]]:
        """The blocks of the next write; asked of a group's first layer only, which allocates them
        for all."""
        if not self._table.leader:
            return []
        return [(self._spec(key, value), self._table.blocks_needed(new_tokens, batch))]

    # -- LayerStore -----------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        check_kv(key, value)
        blocks = self.ensure_pool().layer_blocks(self._spec(key, value))  # ShapeError before any write
        self._table.append(blocks, {"k": key, "v": value}, key.shape[2])

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ids is None:
            raise ShapeError(f"layer {self.layer_idx}: nothing stored yet")
        return self._table.read("k", self.pool), self._table.read("v", self.pool)

    def size(self) -> int:
        return self._table.length

    @property
    def batch_size(self) -> int:
        return self._table.batch_size

    def clear(self) -> None:
        self._table.release()
        self._dropped, self._gapped = 0, False

    def keep(self, index: torch.Tensor) -> None:
        """Compact in place: kept tokens move to the front of the row's own blocks, emptied blocks
        go back to the pool. Shared blocks are copied before they are written, so forks never see it.
        """
        index = index.cpu()
        table, kept, ps = self._table, index.shape[-1], self.page_size
        self._gapped = self._gapped or not bool((index == torch.arange(kept)).all())
        if kept and (self._ids is None or int(index.max()) >= table.length):
            raise ShapeError(f"layer {self.layer_idx}: keep index up to {int(index.max())} but "
                             f"{table.length} tokens are stored")
        if self._ids is None:
            return
        if len(table.shared.tables) > 1:
            raise UnsupportedError(f"layer {self.layer_idx}: keep() in a layer that shares its blocks with "
                                   f"layers {list(self.group)}; eviction keeps each layer's own blocks")
        block_pool, kept_blocks = table.pool, table.blocks_for(kept)
        if block_pool.any_shared and kept_blocks:
            shared = torch.from_numpy(block_pool.refcount[self._ids[:, :kept_blocks].numpy()] > 1)
            rows, cols = shared.nonzero(as_tuple=True)
            if rows.numel():
                block_pool.check(rows.numel())
                table.unshare(rows, cols)
        b, heads = self._ids.shape[0], table.blocks.k.shape[0]
        src = table.start + index.expand(b, heads, kept)  # [B, H, n] token positions
        src_slots = self._ids.gather(1, (src // ps).flatten(1)).view_as(src) * ps + src % ps
        dst = torch.arange(kept)
        dst_slots = (self._ids[:, dst // ps] * ps + dst % ps)[:, None].expand(b, heads, kept)
        head = torch.arange(heads)[:, None]  # per head: its slots in every batch row
        src_slots, dst_slots = (s.transpose(0, 1).reshape(heads, b * kept) for s in (src_slots, dst_slots))
        for pool_tensor in table.blocks.tensors.values():
            flat = pool_tensor.view(heads, -1, pool_tensor.shape[3])
            flat[head, dst_slots.to(flat.device)] = flat[head, src_slots.to(flat.device)]
        table.start, table.length = 0, kept
        block_pool.decref(self._ids[:, kept_blocks:])
        table.ids = self._ids[:, :kept_blocks]

    # -- the block-table API (``BlockTableStore``: forks, cached prefixes, partial swaps) -----------
    def fork(self) -> PagedStore:
        """A store of the same tokens in the same blocks, refcounted: whichever of the two writes
        into a shared block first gets its own copy (copy-on-write)."""
        twin = dataclasses.replace(self)
        twin.bind(self.layer_idx)
        twin.kind, twin.pool, twin.group = self.kind, self.pool, self.group
        self._table.fork_into(twin._table)
        twin._dropped, twin._gapped = self._dropped, self._gapped
        return twin

    def held_blocks(self) -> torch.Tensor | None:
        """The blocks ``[batch, blocks]`` this store references, whatever tokens they hold (accounting)."""
        return self._table.ids

    def block_ids(self) -> torch.Tensor | None:
        """The blocks ``[batch, blocks]`` holding the stored tokens, the first from the sequence's token 0
        (None when empty, or when tokens were dropped from the front or evicted)."""
        table = self._table
        return None if table.ids is None or table.start or self._dropped or self._gapped else table.ids

    def prefix_layout(self) -> PrefixLayout | None:
        """Plain pages are shared page by page (the full-precision window of quantized storage is not)."""
        return PrefixLayout(self.page_size) if self.kind == "kv" else None

    def sequence_blocks(self) -> torch.Tensor | None:
        """The blocks ``[batch, blocks]`` by their place in the sequence, from its block 0: ``-1`` for the
        blocks given back from the front (a sliding window's past, a partial swap), whose tokens are no
        longer stored, the held ones intact (None when empty or when ``keep`` left gaps)."""
        table = self._table
        if table.ids is None or self._gapped:
            return None
        gone = (self._dropped - table.start) // self.page_size
        return torch.cat([table.ids.new_full((table.ids.shape[0], gone), -1), table.ids], 1)

    def stored_from(self) -> int:
        """The place in the sequence of the first stored token, as far as this store knows: the tokens
        given back from its front (a window written back after a pause starts from 0 here)."""
        return self._dropped

    def next_slot(self, key: torch.Tensor, value: torch.Tensor) -> tuple[LayerBlocks, int]:
        """Room for one more token shaped like ``key`` / ``value`` ``[1, kv_heads, any, head_dim]``:
        the layer's blocks and the slot to write it to (``append_one_each``), the token counted stored."""
        blocks = self.layer_blocks(key, value)
        return blocks, self._table.next_slot(blocks)

    def next_slots(self, key: torch.Tensor, value: torch.Tensor, tokens: int) -> torch.Tensor:
        """``next_slot`` for ``tokens`` tokens at once (a prefill chunk): their slots ``[tokens]``."""
        return self._table.next_slots(self.layer_blocks(key, value), tokens)

    def layer_blocks(self, key: torch.Tensor, value: torch.Tensor) -> LayerBlocks:
        """This layer's tensors of the pool's blocks for tokens shaped like ``key`` / ``value``, made on
        first use (what a write before this layer's first one reads and writes)."""
        return self.ensure_pool().layer_blocks(self._spec(key, value))

    def place(self) -> tuple[BlockIds, int, int]:
        """This sequence's blocks in the layer's group (shared by the group's layers) and where this layer's
        tokens lie in them (start, length): what a decode step planned for one layer of a group reuses
        for the others standing at the same place (``count_written``)."""
        table = self._table
        return table.shared, table.start, table.length

    @property
    def blocks(self) -> LayerBlocks | None:
        """This layer's tensors of its group's blocks (None before the first write)."""
        return self._table.blocks

    def count_written(self, tokens: int) -> None:
        """Count ``tokens`` written into slots another layer of the group made room for (the same
        ``place``): the caller wrote them into this layer's ``blocks``."""
        table = self._table
        if table.blocks is None:  # the layer's first tokens
            table.blocks = table.pool.layer(self.layer_idx)
        table.length += tokens

    def pages_in_place(self) -> tuple[LayerBlocks, torch.Tensor, int, int] | None:
        """What a paged attention kernel reads in place (``kvfactory.storage.ragged``): the layer's blocks,
        this one-row store's block ids ``[blocks]`` from the one holding its first stored token, that
        token's offset in it and the stored tokens' count; None when empty or holding several rows."""
        table = self._table
        if table.ids is None or table.batch_size != 1 or not table.length:
            return None
        first = table.start // self.page_size
        return table.blocks, table.ids[0, first:], table.start - first * self.page_size, table.length

    def adopt(self, ids: torch.Tensor, tokens: int, first: int = 0) -> None:
        """Hold tokens ``[first, tokens)`` of a sequence from blocks ``ids [batch, blocks]`` of this layer's
        pool, filled by another store (a cached prefix), by their place in the sequence from its block
        0 (those before ``first``'s block are not read: ``-1`` where given back); the blocks are
        referenced, not copied."""
        if self.size():
            raise ShapeError(f"layer {self.layer_idx}: adopt() into a store holding {self.size()} tokens")
        block_pool = self.ensure_pool().pools.get((self.kind, self.group or (self.layer_idx,)))
        held = ids[:, first // self.page_size:]
        if (block_pool is None or not 0 <= first <= tokens <= ids.shape[1] * self.page_size
                or bool((held < 0).any())):
            raise ShapeError(f"layer {self.layer_idx}: tokens {first} to {tokens} in {ids.shape[1]} blocks "
                             f"of {self.page_size} that this pool does not hold")
        self._table.adopt(block_pool.layer(self.layer_idx), held, first % self.page_size, tokens - first)
        self._dropped, self._gapped = first, False

    def export_state(self, tokens: int | None = None) -> dict[str, torch.Tensor]:
        if not self.size():
            return {}
        keys, values = self.gather()
        return {"keys": keys[:, :, :tokens], "values": values[:, :, :tokens]}

    def import_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.append(tensors["keys"], tensors["values"])

    def prepend(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Put whole blocks of tokens back in front of the stored ones (a partial swap coming back from
        the host tier, after ``drop_front`` of the same number of tokens). The group's first layer to
        do it puts the blocks back for all; the others write into them."""
        check_kv(key, value)
        table, n = self._table, key.shape[2]
        ahead = table.start >= n and table.ids is not None  # another layer of the group put them back
        if n % self.page_size or (table.start and not ahead) or (
                table.ids is not None and key.shape[0] != table.batch_size):
            raise ShapeError(f"layer {self.layer_idx}: prepend {n} tokens of batch {key.shape[0]} to a store "
                             f"of batch {table.batch_size} starting at {table.start}: whole pages of "
                             f"{self.page_size} tokens in front of a store that starts at a page")
        blocks = self.ensure_pool().layer_blocks(self._spec(key, value))
        if not ahead:
            pool, front = blocks.pool, n // self.page_size
            pool.check(key.shape[0] * front)
            new = pool.allocate(key.shape[0] * front).view(key.shape[0], front)
            table.shared.pool = pool
            table.ids = new if table.ids is None else torch.cat([new, table.ids], 1)
            for other in table.shared.tables:
                if other is not table and other.length:
                    other.start += n
            table.start += n
        length = table.length
        table.start -= n
        table.length = 0
        table.append(blocks, {"k": key, "v": value}, n)
        table.length = length + n
        self._dropped = max(0, self._dropped - n)

    # -- page reads (sparse decode, ``kvfactory.selectors``) -----------------------------------
    def pageable(self) -> int:
        """Stored tokens that ``read_pages`` serves as whole pages (from the first stored token)."""
        return self.size() if self._table.start == 0 else 0

    def read_pages(self, pages: torch.Tensor, tail_page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the stored pages ``pages [B, H, k]`` (``page_size`` tokens each), then of every token
        from page ``tail_page`` on: ``[B, H, k * page_size + size() - tail_page * page_size, D]``, one row
        copy per block read."""
        table, ps = self._table, self.page_size
        block_pool = table.blocks
        b, h, k = pages.shape
        tail = torch.arange(tail_page, table.blocks_for(table.length), device=pages.device).expand(b, h, -1)
        device = block_pool.k.device
        blocks = table.ids.gather(1, torch.cat([pages, tail], -1).flatten(1).cpu()).view(b, h, -1).to(device)
        rows = (blocks + torch.arange(h, device=device)[None, :, None] * block_pool.num_blocks).flatten()
        n = k * ps + table.length - tail_page * ps  # the last page may not be full
        return tuple(t.flatten(0, 1).index_select(0, rows).view(b, h, -1, t.shape[-1])[:, :, :n]
                     for t in (block_pool.k, block_pool.v))

    def read_bytes(self, page_tokens: int, tail_tokens: int) -> int:
        """Bytes one row reads for ``page_tokens`` tokens in pages and ``tail_tokens`` in the tail."""
        return (page_tokens + tail_tokens) * self._table.pool.block_bytes // self.page_size

    def drop_front(self, n: int) -> None:
        table = self._table
        n = min(n, table.length)
        self._dropped += n
        table.start += n
        table.length -= n
        table.shared.trim()

    def truncate(self, n: int) -> None:
        table = self._table
        table.length = max(0, min(n, table.length))
        table.shared.trim()

    def select_rows(self, rows: torch.Tensor) -> None:
        self._table.select_rows(rows)

    def memory_report(self) -> MemoryReport:
        """Blocks shared by several rows (forks, beams) count once, with their filled slots."""
        return self._table.memory_report()


def append_one_each(stores: list[PagedStore], key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Store one new token ``key[i]`` / ``value[i]`` (``[S, kv_heads, 1, head_dim]``) in each one-row
    store ``stores[i]`` of one layer's pool, with one copy per tensor: a batched decode step's write.
    Returns the slots written (``write_slots``)."""
    places = [store.next_slot(key[i:i + 1], value[i:i + 1]) for i, store in enumerate(stores)]
    blocks = places[0][0]
    if any(other is not blocks for other, _ in places):
        raise ShapeError("append_one_each: the stores write into different block pools")
    slots = torch.tensor([slot for _, slot in places], device=key.device)
    write_slots(blocks, slots, key, value)
    return slots


def write_slots(blocks: LayerBlocks, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write token ``key[i]`` / ``value[i]`` (``[S, kv_heads, 1, head_dim]``) into slot ``slots[i]`` of the
    layer's ``[heads, blocks * page_size]`` view of its blocks, one copy per tensor."""
    for name, x in (("k", key), ("v", value)):
        write_tokens(blocks.tensors[name], slots, x[:, :, 0].transpose(0, 1))


def write_tokens(pool_tensor: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Write ``tokens [heads, S, *rest]`` into slots ``slots [S]`` of ``pool_tensor [heads, blocks,
    page_size, *rest]`` seen as ``[heads, blocks * page_size, *rest]``, with one copy."""
    h, num_blocks, page = pool_tensor.shape[:3]
    flat = raw(pool_tensor).view(h, num_blocks * page, *pool_tensor.shape[3:])
    flat.index_copy_(1, slots, raw(tokens))


def front_tokens(stores: list[PagedStore], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The oldest ``tokens`` held by each one-row store ``stores[i]`` of one layer's pool (each holding
    that many), as K and V ``[S, kv_heads, tokens, head_dim]``, gathered with one copy per tensor."""
    views = [store.pages_in_place() for store in stores]
    blocks, page = views[0][0], stores[0].page_size
    if any(view is None or view[0] is not blocks or view[3] < tokens for view in views):
        raise ShapeError(f"front_tokens: every store must hold {tokens} tokens in one layer's blocks")
    at = torch.tensor([view[2] for view in views])[:, None] + torch.arange(tokens)  # [S, tokens]
    slots = block_tables([view[1] for view in views]).gather(1, at // page) * page + at % page
    out = []
    for name in ("k", "v"):
        pool_tensor = blocks.tensors[name]
        h, num_blocks = pool_tensor.shape[:2]
        flat = pool_tensor.view(h, num_blocks * page, *pool_tensor.shape[3:])
        rows = flat.index_select(1, slots.flatten().to(flat.device))
        out.append(rows.view(h, len(stores), tokens, *rows.shape[2:]).transpose(0, 1))
    return out[0], out[1]
