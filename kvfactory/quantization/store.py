"""Quantized storage: keys and values held as codec-packed runs, the newest tokens in full precision.

``QuantizedStore`` wraps the config's storage (dense or paged) and uses it for the full-precision
residual window (KIVI's recent tokens, which are still being grouped). When the window overflows
by whole codec units, the oldest units are encoded (``kvfactory.codecs``) and appended to packed
buffers (dense) or to the pool's quantized pages (paged: ``PagedRuns``); nothing else is kept in
floating point. A read decodes the packed part and copies the
residual into one workspace shared by every layer (``ReadWorkspace``), so decode allocates no
fresh full-size tensor per step and holds at most one layer's K/V in floating point.

Telemetry: every ``sample_every``-th flush (and the first, unless the store started from another
sequence's quantized pages, whose first flush was sampled) also decodes what it encoded and adds
the squared error and squared norm of K and V to running sums: ``quantization_error()`` gives the
relative MSE of this layer's keys and values so far, measured on what was really stored.

Eviction on quantized data (``keep``, ``drop_front``, ``truncate``) decodes, selects and encodes
again; per-token codecs and KIVI's min/max groups reproduce their codes, so this is near-lossless.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from collections.abc import Iterator

import torch

from kvfactory.attention import DeferredRead
from kvfactory.codecs import Codec, Encoded, fused, native
from kvfactory.codecs.calibration import FIRST_USE_TOKENS
from kvfactory.errors import ShapeError
from kvfactory.storage.base import LayerStore, MemoryReport, PrefixLayout, check_kv, take_tokens
from kvfactory.storage.blocks import BlockTable, GroupTables, PagedPool, PoolSpec, append_each
from kvfactory.storage.paged import PagedStore
from kvfactory.storage.workspace import ReadWorkspace


def _streams(ek: Encoded, ev: Encoded) -> dict[str, torch.Tensor]:
    """Keys' and values' encoded tensors under one namespace (``k.codes``, ``v.scale``, ...)."""
    return {f"k.{n}": t for n, t in ek.tensors.items()} | {f"v.{n}": t for n, t in ev.tensors.items()}


def _split(streams: dict[str, torch.Tensor], tokens: int) -> tuple[Encoded, Encoded]:
    """``_streams``' inverse: the keys' and the values' ``Encoded``."""
    return tuple(Encoded({n[2:]: t for n, t in streams.items() if n[0] == side}, tokens) for side in "kv")


def error_sums(key: torch.Tensor, value: torch.Tensor, ek: Encoded, ev: Encoded, codecs: tuple[Codec, Codec]
               ) -> torch.Tensor:
    """Per row of ``key`` / ``value [B, H, n, D]``, encoded by ``codecs`` as ``ek`` / ``ev``: the squared
    error of the decoded keys, the keys' squared norm, then the values' two, float64 ``[B, 4]`` (what
    a sampled flush adds to ``quantization_error``'s sums)."""
    sums = []
    with torch.no_grad():
        for x, codec, enc in ((key, codecs[0], ek), (value, codecs[1], ev)):
            x = x.double()
            sums += [(codec.decode(enc).double() - x).square().sum((1, 2, 3)), x.square().sum((1, 2, 3))]
    return torch.stack(sums, 1)


BlockLayout = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # each tensor's name, shape and dtype


def block_layout(key_codec: Codec, value_codec: Codec, block_tokens: int,
                 like: tuple[torch.Tensor, torch.Tensor]) -> BlockLayout:
    """What the codecs make of one block of ``block_tokens`` tokens shaped like ``like`` (K and V
    ``[any, kv_heads, any, head_dim]``): each encoded tensor's name, shape ``(kv_heads, ...)`` and
    dtype, as a pool's block of quantized pages holds them (``PoolSpec.tensors``)."""
    blank = [x.new_zeros((1, x.shape[1], block_tokens, x.shape[3])) for x in like]
    streams = _streams(key_codec.encode(blank[0]), value_codec.encode(blank[1]))
    return tuple((name, tuple(t.shape[1:]), t.dtype) for name, t in streams.items())


def packed_block_tokens(page_size: int, key_codec: Codec, value_codec: Codec) -> int:
    """Tokens in one block of quantized pages over pages of ``page_size``: whole pages and whole codec
    units (32 for KIVI's 32-token key groups on 16-token pages)."""
    return math.lcm(page_size, key_codec.unit, value_codec.unit)


class PackedRuns:
    """Encoded keys and values appended along the unit axis (dim 2) into buffers with headroom.

    Packed data is small, so growing by a fixed headroom of ``reserve_tokens`` (a copy every
    ``reserve_tokens`` tokens) costs little and keeps the waste under it instead of a growth
    factor's 25 %. The storage of quantized dense caches.
    """

    def __init__(self, key_codec: Codec, value_codec: Codec, reserve_tokens: int = 64) -> None:
        self.units = {"k": key_codec.unit, "v": value_codec.unit}
        unit = math.lcm(key_codec.unit, value_codec.unit)
        self.reserve = math.ceil(reserve_tokens / unit) * unit
        self._buffers: dict[str, torch.Tensor] = {}
        self.tokens = self.capacity = 0

    def append(self, ek: Encoded, ev: Encoded, like: tuple[torch.Tensor, torch.Tensor]) -> None:
        streams, new = _streams(ek, ev), ek.tokens
        if self.tokens + new > self.capacity:
            self._grow(self.tokens + new + (self.reserve if self._buffers else 0), streams)
        for name, tensor in streams.items():
            unit = self.units[name[0]]
            self._buffers[name][:, :, self.tokens // unit:(self.tokens + new) // unit] = tensor
        self.tokens += new

    def _grow(self, capacity: int, like: dict[str, torch.Tensor]) -> None:
        grown = {}
        with torch.inference_mode(False):  # buffers outlive any one inference_mode block
            for name, tensor in like.items():
                unit = self.units[name[0]]
                grown[name] = tensor.new_empty((*tensor.shape[:2], capacity // unit, *tensor.shape[3:]))
                if name in self._buffers and self.tokens:
                    grown[name][:, :, :self.tokens // unit] = self._buffers[name][:, :, :self.tokens // unit]
        self._buffers, self.capacity = grown, capacity

    def encoded(self) -> tuple[Encoded, Encoded]:
        """Everything stored, as views."""
        return _split({n: t[:, :, :self.tokens // self.units[n[0]]] for n, t in self._buffers.items()},
                      self.tokens)

    def select_rows(self, rows: torch.Tensor) -> None:
        self._buffers = {n: t.index_select(0, rows.to(t.device)) for n, t in self._buffers.items()}

    def clear(self) -> None:
        self._buffers, self.tokens, self.capacity = {}, 0, 0

    def memory_report(self) -> MemoryReport:
        allocated = sum(t.nbytes for t in self._buffers.values())
        return MemoryReport(allocated, allocated * self.tokens // max(self.capacity, 1))

    def block_requests(self, tokens: int, batch: int,
                       like: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[PoolSpec, int]]:
        return []


class PagedRuns:
    """Encoded keys and values in the pool's ``packed`` blocks: quantized pages.

    A block holds ``lcm(page_size, codec units)`` tokens (32 for KIVI's 32-token key groups on
    16-token pages) of packed codes, scales and zero points, so the pool's blocks hold the bytes
    a quantized cache really keeps; one row in consecutive blocks is read as a view. The layers of a
    group (``tables``: one window size and codec, which encode the same tokens at the same steps)
    share one block table, so a block is allocated, refcounted and cached once for all of them.
    """

    def __init__(self, key_codec: Codec, value_codec: Codec, layer_idx: int, pool: PagedPool,
                 tables: GroupTables | None = None) -> None:
        self.key_codec, self.value_codec, self.layer_idx, self.pool = key_codec, value_codec, layer_idx, pool
        self.block_tokens = packed_block_tokens(pool.page_size, key_codec, value_codec)
        self.table = BlockTable(self.block_tokens)
        self.group = () if tables is None else tables.layers
        if tables is not None:
            self.table.join(tables.ids("packed", self.block_tokens))
        self._spec: PoolSpec | None = None
        self._views: tuple[tuple, tuple[Encoded, Encoded]] | None = None  # encoded(), while unchanged
        weakref.finalize(self, self.table.release)

    @property
    def tokens(self) -> int:
        return self.table.length

    def spec(self, like: tuple[torch.Tensor, torch.Tensor]) -> PoolSpec:
        """The block layout: what the codecs make of one block of tokens shaped like ``like``."""
        if self._spec is None:
            k, v = like
            encodes = ((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), k.dtype)
            self._spec = PoolSpec("packed", self.layer_idx, self.block_tokens,
                                  block_layout(self.key_codec, self.value_codec, self.block_tokens, like),
                                  like[0].device, self.group, encodes)
        return self._spec

    def append(self, ek: Encoded, ev: Encoded, like: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.table.append(self.pool.layer_blocks(self.spec(like)), _streams(ek, ev), ek.tokens)

    def adopt(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hold the whole blocks ``ids [batch, blocks]`` of this layer's packed pool, filled by another
        sequence (referenced, copied on write); returns empty K and V of the shapes they encode."""
        block_pool = self.pool.pools.get(("packed", self.group or (self.layer_idx,)))
        if block_pool is None or block_pool.spec.encodes is None or bool((ids < 0).any()):
            raise ShapeError(f"layer {self.layer_idx}: {ids.shape[1]} quantized pages this pool does not "
                             f"hold")
        self._spec = dataclasses.replace(block_pool.spec, layer_idx=self.layer_idx)  # the group leader's
        (hk, dk), (hv, dv), dtype = self._spec.encodes
        self.table.adopt(block_pool.layer(self.layer_idx), ids, 0, ids.shape[1] * self.block_tokens)
        with torch.inference_mode(False):  # shape/dtype witnesses that hold no tokens
            return (torch.empty((ids.shape[0], hk, 0, dk), dtype=dtype, device=self._spec.device),
                    torch.empty((ids.shape[0], hv, 0, dv), dtype=dtype, device=self._spec.device))

    def encoded(self) -> tuple[Encoded, Encoded]:
        """Everything stored: views for one row in consecutive blocks, else gathered copies. The views
        are kept until the table or the pool's tensors change (a decode step adds a group of tokens
        only every ``block_tokens`` steps), so most steps do not rebuild them."""
        table = self.table
        key = (table.start, table.length, table.ids, *table.blocks.tensors.values())
        if self._views is not None and key[:2] == self._views[0][:2] and len(key) == len(self._views[0]) \
                and all(a is b for a, b in zip(key[2:], self._views[0][2:], strict=True)):
            return self._views[1]
        names = [name for name, _, _ in table.blocks.spec.tensors]
        encoded = _split({name: table.read(name, self.pool) for name in names}, self.tokens)
        self._views = (key, encoded) if table.run_start is not None else None
        return encoded

    def select_rows(self, rows: torch.Tensor) -> None:
        self.table.select_rows(rows)

    def clear(self) -> None:
        self.table.release()

    def memory_report(self) -> MemoryReport:
        return self.table.memory_report()

    def block_requests(self, tokens: int, batch: int,
                       like: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[PoolSpec, int]]:
        """The blocks of encoding ``tokens`` more; asked of a group's first layer only, which allocates
        them for all."""
        if not tokens or not self.table.leader:
            return []
        return [(self.spec(like), self.table.blocks_needed(tokens, batch))]


def append_runs(runs: list[PagedRuns], ek: Encoded, ev: Encoded, like: tuple[torch.Tensor, torch.Tensor]
                ) -> None:
    """Append row ``i`` of ``ek`` / ``ev`` to ``runs[i]`` (one-row quantized pages of one layer's pool,
    tokens shaped like ``like``), one copy per stream for them all."""
    blocks = [r.pool.layer_blocks(r.spec(like)) for r in runs]
    if any(b is not blocks[0] for b in blocks):
        raise ShapeError("append_runs: the runs write into different block pools")
    append_each([r.table for r in runs], blocks[0], _streams(ek, ev), ek.tokens)


class QuantizedStore(LayerStore):
    """One layer's K/V: codec-packed runs plus up to ``residual`` + one unit newest tokens in ``inner``
    (built for that role by ``kvfactory.compose``: paged blocks of kind ``window``, dense headroom
    of at most one unit)."""

    def __init__(self, inner: LayerStore, key_codec: Codec, value_codec: Codec, residual: int,
                 workspace: ReadWorkspace, sample_every: int = 16, tables: GroupTables | None = None) -> None:
        self.inner, self.key_codec, self.value_codec, self.tables = inner, key_codec, value_codec, tables
        self.residual, self.workspace, self.sample_every = residual, workspace, sample_every
        self._flushes = 0
        self._error = torch.zeros(4, dtype=torch.float64)  # K error, K norm, V error, V norm (squared sums)
        self.unit = math.lcm(key_codec.unit, value_codec.unit)
        self._packed: PackedRuns | PagedRuns | None = None  # made on first use (paged: once a pool is known)
        self._like: tuple[torch.Tensor, torch.Tensor] | None = None  # empty [B, H, 0, D] K and V
        self._realigned = False  # codes no longer start at the sequence's token 0 (a drop, an eviction)
        self._kernel_shapes: tuple[tuple | None, bool] = (None, False)  # (like, whether the kernels fit it)

    def bind(self, layer_idx: int) -> None:
        super().bind(layer_idx)
        self.inner.bind(layer_idx)

    def attach(self, pool: object) -> None:
        """Give the inner store its pool (paged storage); quantized pages come from the same pool."""
        self.inner.attach(pool)

    @property
    def packed(self) -> PackedRuns | PagedRuns:
        """Where encoded tokens live: the pool's quantized pages over paged storage, else buffers."""
        if self._packed is None:
            if isinstance(self.inner, PagedStore):
                self._packed = PagedRuns(self.key_codec, self.value_codec, self.layer_idx,
                                         self.inner.ensure_pool(), self.tables)
            else:
                self._packed = PackedRuns(self.key_codec, self.value_codec)
        return self._packed

    @property
    def like(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Empty K and V ``[B, H, 0, D]`` of the stored shapes and dtype; None before any write."""
        return self._like

    @property
    def runs(self) -> PackedRuns | PagedRuns | None:
        """The encoded runs, once any were made (``packed`` makes them)."""
        return self._packed

    def place(self) -> tuple[object, tuple[object, int, int] | None]:
        """Where this layer's tokens lie in its group's blocks (shared by the group's layers): the
        window's place (``PagedStore.place``) and the quantized pages' block ids, start and length (None
        before the first), so that a step planned for one layer of a group serves the others standing at
        the same place. Over paged storage only."""
        packed = self._packed
        table = packed.table if isinstance(packed, PagedRuns) else None
        return self.inner.place(), None if table is None else (table.shared, table.start, table.length)

    @property
    def kernel_pages(self) -> bool:
        """Whether the C kernels (``kvfactory/kernels/kivi.c``) read the packed tokens in place: one row
        over paged storage, KIVI keys and values of one bit width, the packed tokens from the start of
        their first block, sizes the kernels take, on the CPU with the kernels built."""
        return self._like is not None and self.kernel_pages_for(self._like)

    def kernel_pages_for(self, like: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """``kernel_pages`` for tokens shaped like ``like`` (empty K and V ``[1, H, 0, D]``; a store
        before its first write)."""
        packed = self._packed
        if self._kernel_shapes[0] is not like:  # asked per layer and sequence each step: kept per shape
            self._kernel_shapes = like, self._kernel_shapes_fit(like)
        if packed is None:
            return self._kernel_shapes[1]
        return self._kernel_shapes[1] and isinstance(packed, PagedRuns) and packed.table.start == 0

    @property
    def kernel_codecs(self) -> bool:
        """Whether the C kernels take this store's codes: KIVI keys and values of one bit width in
        quantized pages over plain pages, the kernels built."""
        keys, values = self.key_codec, self.value_codec
        return (self.inner.plain_pages and keys.bits == values.bits and native.available()
                and (keys.kernel_layout, values.kernel_layout) == ("kivi-keys", "kivi-values"))

    def _kernel_shapes_fit(self, like: tuple[torch.Tensor, torch.Tensor]) -> bool:
        if not self.kernel_codecs:
            return False
        block_tokens = packed_block_tokens(self.inner.page_size, self.key_codec, self.value_codec)
        return (like[0].shape[0] == 1 and like[0].device.type == "cpu" and block_tokens <= native.MAX_BLOCK
                and like[1].shape[3] == like[0].shape[3] <= native.MAX_DIM)

    def fits_window(self, tokens: int) -> bool:
        """Whether ``tokens`` more stay in the full-precision window without a flush, so a batched
        write may store them in ``inner`` directly (``kvfactory.storage.paged.append_one_each``)."""
        return self._like is not None and self._flush_count(self.inner.size() + tokens) == 0

    def own_flush(self, tokens: int) -> int | None:
        """How a compiled prefill step writes ``tokens`` more straight into the window and leaves what
        ``append`` leaves: 0 where it encodes none of them (the window has room, or has after
        ``batch_flush``); where ``append`` would encode some of them too (more than the window holds),
        the tokens a batched flush then encodes after the step (``batch_flush(0)``), which reads them
        encoded and decoded as ``append``'s read does; None where neither holds (several rows, dense
        storage, scales still to be fixed)."""
        held = self.inner.size()
        flush = self._flush_count(held + tokens)
        if flush == 0:
            return 0
        one_row = self._like is None or self._like[0].shape[0] == 1
        if not one_row or not isinstance(self.inner, PagedStore) or not self._scales_fixed():
            return None
        return flush if flush > held else 0  # else ``batch_flush(tokens)`` encodes held tokens first

    @property
    def quantized_tokens(self) -> int:
        return 0 if self._packed is None else self._packed.tokens

    def _scales_ready(self, total: int) -> bool:
        """Whether codes may be written with ``total`` tokens held: scales fixed on first use wait
        for ``FIRST_USE_TOKENS`` of them (kept in the full-precision window meanwhile), unless another
        cache of the factory fixed them already."""
        return self._scales_fixed() or total >= FIRST_USE_TOKENS

    def _scales_fixed(self) -> bool:
        cells = [c.first_use for c in (self.key_codec, self.value_codec) if c.first_use is not None]
        return all(cell.fixed for cell in cells)

    def batch_flush(self, new_tokens: int) -> int:
        """Tokens at the front of the window that ``kvfactory.quantization.ragged.flush_windows`` encodes
        for this store, batched with other sequences' stores of the layer, before ``new_tokens`` more
        join the window: those ``append`` would encode, where the window holds them all, the scales are
        fixed and the codes go to one row's quantized pages; else 0 (``append`` encodes as it writes)."""
        if self._like is None or self._like[0].shape[0] != 1 or not isinstance(self.inner, PagedStore) \
                or not self._scales_fixed():
            return 0
        held = self.inner.size()
        flush = self._flush_count(held + new_tokens)
        return flush if flush <= held else 0

    @property
    def samples_next_flush(self) -> bool:
        """Whether the next flush samples its quantization error (every ``sample_every``-th does)."""
        return self._flushes % self.sample_every == 0

    def took_front(self, tokens: int, error: torch.Tensor | None) -> None:
        """The window's oldest ``tokens`` were encoded and written into this store's quantized pages by a
        batched flush (``error``: their ``error_sums`` row, where ``samples_next_flush``): counted as
        ``append``'s own flush would be, then given back by the window."""
        self._count_flush(error)
        self.inner.drop_front(tokens)

    def _count_flush(self, error: torch.Tensor | None) -> None:
        """Count one flush, adding its ``error_sums`` where it was sampled."""
        if error is not None:
            self._error += error.cpu()
        self._flushes += 1

    def _flush_count(self, total: int) -> int:
        """Tokens to encode when ``total`` sit in the window: whole units beyond ``residual``."""
        return max(0, (total - self.residual) // self.unit * self.unit)

    def check_like(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Record the stored shapes and dtype at the first write (also one straight into the window, a
        compiled step's), else check ``key`` / ``value`` against them (``ShapeError``)."""
        if self._like is None:
            with torch.inference_mode(False):  # shape/dtype witnesses that hold no tokens
                self._like = key.new_empty((*key.shape[:2], 0, key.shape[3])), \
                    value.new_empty((*value.shape[:2], 0, value.shape[3]))
            return
        k, v = self._like
        if key.shape[:2] != k.shape[:2] or key.shape[3] != k.shape[3] or value.shape[3] != v.shape[3] \
                or key.dtype != k.dtype or key.device != k.device:
            raise ShapeError(f"layer {self.layer_idx}: cannot append key {tuple(key.shape)} ({key.dtype}) / "
                             f"value {tuple(value.shape)} to a store of [batch={k.shape[0]}, kv_heads="
                             f"{k.shape[1]}, head_dim={k.shape[3]}/{v.shape[3]}] ({k.dtype})")

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        check_kv(key, value)
        self.check_like(key, value)
        held = self.inner.size()
        total = held + key.shape[2]
        flush = self._flush_count(total) if self._scales_ready(total) else 0
        if flush == 0:
            self.inner.append(key, value)
            return
        if held:
            old_k, old_v = self.inner.gather()
            key, value = torch.cat([old_k, key], dim=2), torch.cat([old_v, value], dim=2)
        self.key_codec.fix_first_use(key)  # over every token held, not only those encoded now
        self.value_codec.fix_first_use(value)
        with torch.no_grad():  # codes are not differentiable (a forward outside no_grad works all the same)
            ek, ev = self.key_codec.encode(key[:, :, :flush]), self.value_codec.encode(value[:, :, :flush])
        codecs = self.key_codec, self.value_codec
        self._count_flush(error_sums(key[:, :, :flush], value[:, :, :flush], ek, ev, codecs).sum(0)
                          if self.samples_next_flush else None)
        self.packed.append(ek, ev, self._like)
        if flush <= held:  # only held tokens were encoded: the window gives back their pages, keeps the rest
            self.inner.drop_front(flush)
            self.inner.append(*(x[:, :, held:] for x in (key, value)))
            return
        self.inner.clear()
        if key.shape[2] > flush:
            self.inner.append(key[:, :, flush:].contiguous(), value[:, :, flush:].contiguous())

    def quantization_error(self) -> dict[str, float]:
        """Relative MSE of the keys and values encoded so far (sampled flushes), NaN before any."""
        k_err, k_norm, v_err, v_norm = self._error.tolist()
        return {"key": k_err / k_norm if k_norm else float("nan"),
                "value": v_err / v_norm if v_norm else float("nan")}

    @torch.no_grad()  # quantized storage is not differentiable: reads carry no autograd history
    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        quantized, held = self.quantized_tokens, self.inner.size()
        if quantized + held == 0 and self._like is not None:
            return self._like  # everything was removed: empty, with the stored shape
        if quantized == 0:
            return self.inner.gather()
        k, v = self._like
        b, h, _, dk = k.shape
        keys = self.workspace.buffer("quantized_keys", (b, h, quantized + held, dk), k)
        values = self.workspace.buffer("quantized_values", (b, h, quantized + held, v.shape[3]), v)
        if self.kernel_pages and k.dtype == torch.float32:  # decoded in place from the pool's blocks
            native.paged_dequantize(self.packed.table.blocks.tensors, self.packed.table.ids[0],
                                    self.key_codec.bits, self.value_codec.group_size, keys[0, :, :quantized],
                                    values[0, :, :quantized])
        else:
            ek, ev = self.packed.encoded()
            self.key_codec.decode(ek, out=keys[:, :, :quantized])
            self.value_codec.decode(ev, out=values[:, :, :quantized])
        if held:
            rk, rv = self.inner.gather()
            keys[:, :, quantized:].copy_(rk)
            values[:, :, quantized:].copy_(rv)
        return keys, values

    def deferred_read(self) -> QuantizedRead | None:
        """A read for kvfactory's attention: always where the codecs have fused kernels; otherwise
        once the layer's floating-point K would exceed two chunks, since below that decoding it
        whole for SDPA is as fast (``benchmarks/quantized_attention.py``)."""
        if not self.quantized_tokens or self._like is None:
            return None
        if (fused.available() or native.available()) and type(self.key_codec).scores is not Codec.scores \
                and type(self.value_codec).weighted_sum is not Codec.weighted_sum:
            return QuantizedRead(self)
        k = self._like[0]
        whole = k.shape[0] * k.shape[1] * self.size() * k.shape[3] * k.element_size()
        return QuantizedRead(self) if whole > 2 * QuantizedRead.chunk_bytes else None

    def size(self) -> int:
        return self.quantized_tokens + self.inner.size()

    @property
    def batch_size(self) -> int:
        return 0 if self._like is None else self._like[0].shape[0]

    def clear(self) -> None:
        if self._packed is not None:
            self._packed.clear()
        self.inner.clear()
        self._like, self._realigned = None, False

    def keep(self, index: torch.Tensor) -> None:
        """Decode, keep ``index``, encode again (near-lossless, see the module doc)."""
        keys, values = self.gather()
        keys, values = take_tokens(keys, index), take_tokens(values, index)
        like = self._like
        self.clear()
        self._like, self._realigned = like, True
        if keys.shape[2]:
            self.append(keys, values)

    def drop_front(self, n: int) -> None:
        """While nothing is encoded the window's own ``drop_front`` (a sliding-window layer whose window
        fits the full-precision window): it leaves the stored tokens in place, so a read returned
        before the drop still holds them, as the attention that follows it expects. Else ``keep``."""
        if self.quantized_tokens == 0:
            self.inner.drop_front(n)
            self._realigned = self._realigned or n > 0
        else:
            self.keep(torch.arange(min(n, self.size()), self.size()))

    def truncate(self, n: int) -> None:
        if n >= self.quantized_tokens:
            self.inner.truncate(n - self.quantized_tokens)
        else:
            self.keep(torch.arange(max(0, n)))

    def select_rows(self, rows: torch.Tensor) -> None:
        if self._packed is not None:
            self._packed.select_rows(rows)
        self.inner.select_rows(rows)
        if self._like is not None:
            self._like = tuple(t.index_select(0, rows.to(t.device)) for t in self._like)

    # -- forks and saved state (``kvfactory.manager``): packed data is shared or copied, never re-encoded --
    def fork(self) -> QuantizedStore:
        """A store of the same tokens: quantized pages shared by refcount (copy-on-write), the window's
        pages too; packed buffers of dense storage copied."""
        twin = QuantizedStore(self.inner.fork(), self.key_codec, self.value_codec, self.residual,
                              self.workspace, self.sample_every)
        twin.bind(self.layer_idx)
        twin._flushes, twin._error, twin._like = self._flushes, self._error.clone(), self._like
        twin._realigned = self._realigned
        if isinstance(self.inner, PagedStore):  # every layer of a group forks its table: the twins share one
            runs = self.packed
            twin._packed = PagedRuns(self.key_codec, self.value_codec, self.layer_idx, runs.pool)
            twin._packed.group = runs.group
            runs.table.fork_into(twin._packed.table)
        elif self._packed is not None:
            raise self._unsupported("forked over dense storage")
        return twin

    def export_state(self, tokens: int | None = None) -> dict[str, torch.Tensor]:
        """The packed codes, scales and zero points as stored (``packed.*``), their token count, and the
        full-precision window (``window.*``, possibly empty)."""
        if tokens is not None:
            raise self._unsupported("swapped in part")
        if self._like is None:
            return {}
        window = self.inner.gather() if self.inner.size() else self._like
        state = {"window.keys": window[0], "window.values": window[1],
                 "packed.tokens": torch.tensor(self.quantized_tokens)}
        if self.quantized_tokens:
            state |= {f"packed.{name}": t for name, t in _streams(*self.packed.encoded()).items()}
        return state

    def import_state(self, tensors: dict[str, torch.Tensor]) -> None:
        window_k, window_v = tensors["window.keys"], tensors["window.values"]
        self.check_like(window_k, window_v)
        tokens = int(tensors["packed.tokens"])
        if tokens:
            streams = {name[7:]: t for name, t in tensors.items()
                       if name.startswith("packed.") and name != "packed.tokens"}
            self.packed.append(*_split(streams, tokens), self._like)
        if window_k.shape[2]:
            self.inner.append(window_k, window_v)

    # -- prefix sharing (``KVCache.prefix_blocks``): whole quantized pages, codes aligned at token 0 ----
    def prefix_layout(self) -> PrefixLayout | None:
        """Quantized pages are shared whole: a block's codes (KIVI's groups aligned at token 0) depend only
        on the prefix up to it. A hit leaves the full-precision window's tokens to compute, so the codes
        after it are those computing the prompt makes."""
        if not isinstance(self.inner, PagedStore):
            return None
        block_tokens = math.lcm(self.inner.page_size, self.key_codec.unit, self.value_codec.unit)
        calibrating = any(c.first_use is not None for c in (self.key_codec, self.value_codec))
        # after a hit of whole quantized pages the window holds exactly the last ``residual`` tokens when
        # those are whole quantized pages too and flushes wait for no calibration: adoptable pages
        window = self.residual if (block_tokens == self.unit and self.residual % self.unit == 0
                                   and not calibrating) else 0
        return PrefixLayout(block_tokens, "packed", self.residual, from_start=True, window=window)

    def sequence_blocks(self) -> torch.Tensor | None:
        """The full quantized pages ``[batch, blocks]`` from the sequence's token 0 (None when there are
        none, or when the codes start elsewhere)."""
        runs = self._packed
        if not isinstance(runs, PagedRuns) or runs.table.ids is None or runs.table.start or self._realigned:
            return None
        return runs.table.ids[:, :self.quantized_tokens // runs.block_tokens]

    def share_filled(self, place: int, block: int) -> None:
        """A full quantized page's codes are never written again, so one holding the same bytes in every
        layer of the group can stand for this store's (``LayerStore.share_filled``); the group's layers
        then read it with every sequence holding it. Codes of the same tokens computed apart may differ
        in a rounding: those stay apart."""
        held = self.sequence_blocks()
        if held is None or held.shape[0] != 1 or not 0 <= place < held.shape[1]:
            return
        table = self._packed.table
        own = int(table.ids[0, place])
        if own == block or not table.pool.same_contents(own, block):
            return
        ids = table.ids.clone()
        ids[0, place] = block
        table.pool.incref(torch.tensor([block]))
        table.ids = ids
        table.pool.decref(torch.tensor([own]))

    def stored_from(self) -> int:
        return 0

    def window_pages(self) -> tuple[int, torch.Tensor] | None:
        """The full-precision window's first token (its codes' end) and its pages ``[pages]``, the first
        page starting there; None unless one row holds the sequence from token 0 in paged storage."""
        view = self.inner.pages_in_place() if isinstance(self.inner, PagedStore) else None
        if view is None or self._realigned or self.batch_size != 1 or view[2]:
            return None
        return self.quantized_tokens, view[1]

    def adopt_window(self, ids: torch.Tensor, pages: torch.Tensor, tokens: int) -> None:
        """Start from a cached prefix of ``tokens`` tokens: the quantized pages ``ids [1, blocks]`` from
        token 0, then the full-precision window's pages ``pages [1, n]`` holding the rest, both referenced
        (``PrefixLayout.window``): the state computing those tokens leaves, with nothing to compute again."""
        packed = ids.shape[1] * self.packed.block_tokens
        page = self.inner.page_size
        if tokens - packed != pages.shape[1] * page or packed % page or ids.shape[0] != 1:
            raise ShapeError(f"layer {self.layer_idx}: {ids.shape[1]} quantized pages and {pages.shape[1]} "
                             f"window pages of {page} do not hold {tokens} tokens")
        self.adopt(ids, packed)
        self.inner.adopt(torch.cat([pages.new_full((1, packed // page), -1), pages], 1), tokens, packed)

    def adopt(self, ids: torch.Tensor, tokens: int, first: int = 0) -> None:
        """Start from a cached prefix's quantized pages ``ids [batch, blocks]`` holding tokens ``[0, tokens)``
        (referenced, copied on write), from token 0 also in a sliding layer (``PrefixLayout.from_start``:
        ``first`` is not used); the full-precision window starts empty."""
        if self.size():
            raise ShapeError(f"layer {self.layer_idx}: adopt() into a store holding {self.size()} tokens")
        runs = self.packed
        if not isinstance(runs, PagedRuns) or tokens != ids.shape[1] * runs.block_tokens:
            raise ShapeError(f"layer {self.layer_idx}: {tokens} tokens are not {ids.shape[1]} whole "
                             f"quantized pages of this store")
        self._like, self._realigned = runs.adopt(ids), False
        self._flushes = 1  # the sequence that encoded these pages sampled its first flush: sample later ones

    # -- page reads (sparse decode over quantized pages, ``kvfactory.selectors``) ------------------
    @property
    def page_size(self) -> int:
        """The tokens of a page of the storage below (a page selector's unit)."""
        return self.inner.page_size

    def pageable(self) -> int:
        """Tokens ``read_pages`` serves as whole pages: the quantized ones (paged storage only)."""
        return self.quantized_tokens if isinstance(self._packed, PagedRuns) else 0

    @torch.no_grad()
    def read_pages(self, pages: torch.Tensor, tail_page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the quantized pages ``pages [B, H, k]`` (the pool's ``page_size`` tokens each),
        decoded from their packed blocks only, then every token from page ``tail_page`` on (packed ones
        decoded, then the full-precision window): ``PagedStore.read_pages``' layout."""
        ps = self.inner.page_size
        bt = self._packed.block_tokens
        b, h, k = pages.shape
        first = pages * ps
        keys, values = self._decode_blocks(first // bt)  # [B, H, k * bt, D]: whole packed blocks
        sub = (first % bt // ps)[..., None, None, None].expand(b, h, k, 1, ps, keys.shape[-1])
        parts = [[x.view(b, h, k, bt // ps, ps, -1).gather(3, sub).view(b, h, k * ps, -1)]
                 for x in (keys, values)]
        start, quantized = tail_page * ps, self.quantized_tokens
        if start < quantized:  # the packed part of the tail
            blocks = torch.arange(start // bt, -(-quantized // bt), device=pages.device).expand(b, h, -1)
            offset = start - start // bt * bt
            for part, x in zip(parts, self._decode_blocks(blocks), strict=True):
                part.append(x[:, :, offset:offset + quantized - start])
        if self.inner.size():
            for part, x in zip(parts, self.inner.gather(), strict=True):
                part.append(x[:, :, max(0, start - quantized):])
        return tuple(torch.cat(part, 2) for part in parts)

    def _decode_blocks(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed blocks ``index [B, H, m]`` (each row's block positions) decoded: ``[B, H, m * bt, D]``."""
        table = self._packed.table
        block_pool = table.blocks
        b, h, m = index.shape
        blocks = table.ids.gather(1, index.flatten(1).cpu()).view(b, h, m)
        streams = {}
        for name, t in block_pool.tensors.items():
            heads = torch.arange(h, device=t.device)[None, :, None] * t.shape[1]
            rows = (blocks.to(t.device) + heads).flatten()
            streams[name] = t.flatten(0, 1).index_select(0, rows).view(b, h, m * t.shape[2], *t.shape[3:])
        ek, ev = _split(streams, m * self._packed.block_tokens)
        return self.key_codec.decode(ek), self.value_codec.decode(ev)

    def read_bytes(self, page_tokens: int, tail_tokens: int) -> int:
        """Bytes one row reads for ``page_tokens`` quantized tokens in pages and ``tail_tokens`` in the tail
        (counted as full precision)."""
        packed = self._packed.table.pool.block_bytes / self._packed.block_tokens if page_tokens else 0.0
        k, v = self._like
        fp = k.shape[1] * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size())
        return int(page_tokens * packed + tail_tokens * fp)

    def residual_report(self) -> MemoryReport:
        """The full-precision window's share (reported apart from the packed bytes)."""
        return self.inner.memory_report()

    def memory_report(self) -> MemoryReport:
        inner = self.inner.memory_report()
        packed = MemoryReport() if self._packed is None else self._packed.memory_report()
        return MemoryReport(allocated=inner.allocated + packed.allocated, used=inner.used + packed.used,
                            tokens=self.batch_size * self.size())

    def block_requests(self, new_tokens: int, batch: int, key: torch.Tensor,
                       value: torch.Tensor) -> list[tuple[PoolSpec, int]]:
        """Window blocks for what stays in full precision after the append, quantized pages for the rest."""
        held = self.inner.size()
        flush = self._flush_count(held + new_tokens)
        stays = held + new_tokens - flush if flush else new_tokens
        window = self.inner.block_requests(stays, batch, key, value)
        if not flush:
            return window
        like = self._like or (key[:, :, :0], value[:, :, :0])
        return window + self.packed.block_requests(flush, batch, like)


class QuantizedRead(DeferredRead):
    """A quantized layer attended to without decoding it whole, in runs of tokens whose floats take
    ``chunk_bytes`` (so whatever a run needs stays in cache): scores and weighted sums of a run come
    from the codecs' fused kernels (``kvfactory.codecs.fused``) where they have them, else from the
    run decoded into a small workspace buffer; the full-precision window is used as it is."""

    chunk_bytes = 4 << 20

    def __init__(self, store: QuantizedStore) -> None:
        self.store, self.quantized, self.held = store, store.quantized_tokens, store.inner.size()
        b, h, _, d = store._like[0].shape
        unit = store.unit
        self.chunk = max(unit, self.chunk_bytes // (b * h * d * store._like[0].element_size()) // unit * unit)
        device = store._like[0].device
        if store.key_codec.reads_whole(device) and store.value_codec.reads_whole(device):
            self.chunk = max(self.chunk, self.quantized)

    @functools.cached_property
    def encoded(self) -> tuple[Encoded, Encoded]:
        """The packed runs, looked up at the first read of them (a chunk that ``materialize``s never
        does)."""
        return self.store.packed.encoded()

    @functools.cached_property
    def window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-precision window, likewise gathered at its first read."""
        return self.store.inner.gather() if self.held else self.store._like

    @property
    def length(self) -> int:
        return self.quantized + self.held

    @property
    def kv_heads(self) -> int:
        return self.store._like[0].shape[1]

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.window

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        codec = self.store.key_codec
        parts = []
        for _, part in self._parts(0):
            fused_scores = codec.scores(query, part)
            parts.append(fused_scores if fused_scores is not None else
                         query @ self._decode(0, part).transpose(-1, -2))
        if self.window[0].shape[2]:
            parts.append(query @ self.window[0].transpose(-1, -2))
        return torch.cat(parts, dim=-1)

    def weighted_sum(self, probs: torch.Tensor) -> torch.Tensor:
        codec, out = self.store.value_codec, None
        for start, part in self._parts(1):
            weights = probs[..., start:start + part.tokens]
            fused_sum = codec.weighted_sum(weights, part)
            part_sum = fused_sum if fused_sum is not None else weights @ self._decode(1, part)
            out = part_sum if out is None else out.add_(part_sum)
        if self.window[1].shape[2]:
            out = out.add_(probs[..., self.quantized:] @ self.window[1])
        return out

    def _parts(self, side: int) -> Iterator[tuple[int, Encoded]]:
        """The packed keys (0) or values (1) in runs of ``chunk`` tokens: ``(first token, run)``."""
        unit = (self.store.key_codec, self.store.value_codec)[side].unit
        for start in range(0, self.quantized, self.chunk):
            n = min(self.chunk, self.quantized - start)
            yield start, Encoded({name: t[:, :, start // unit:(start + n) // unit]
                                  for name, t in self.encoded[side].tensors.items()}, n)

    def _decode(self, side: int, part: Encoded) -> torch.Tensor:
        """``part`` decoded into a reused workspace buffer (codecs without fused kernels)."""
        like = self.store._like[side]
        b, h, _, d = like.shape
        out = self.store.workspace.buffer(f"chunk{side}", (b, h, part.tokens, d), like)
        return (self.store.key_codec, self.store.value_codec)[side].decode(part, out=out)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.gather()
