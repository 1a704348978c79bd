"""One engine step's packed batch: where each sequence's tokens sit and how each attends.

A step feeds every scheduled sequence's new tokens back to back (``input_ids [1, T]``, no padding);
``StepBatch.write`` is called by each layer with the layer's new K/V ``[1, Hkv, T, D]`` and stores
each sequence's slice in that sequence's own cache. Its attention then runs per sequence:

- decode tokens of plain paged layers, sliding ones included, are attended to in one call over the
  pool's blocks in place (``kvfactory.storage.ragged.paged_decode``: no per-step copy of each sequence
  into a padded tensor; vLLM's PagedAttention, Kwon et al. 2023). Where each token goes and what each
  sequence reads is planned once per step and layer group (``DecodePlan``): the layers of a group share
  one block table per sequence, so the group's first layer plans and the others reuse it. Blocks that
  every sequence starts with (a shared prompt's) are read once for all of them;
- decode tokens of KIVI pages likewise, over their packed blocks and full-precision windows in place
  (``kvfactory.quantization.ragged.quantized_decode``); the windows that a step pushes past their
  residual, a decode token's or a prefill chunk's, first encode their oldest groups in one batch
  (``flush_windows``);
- decode tokens of sparse layers over plain pages (Quest, OVAL) likewise, each KV head over the
  blocks its selector picked (``SparseStore.decode_blocks``), except on the steps that measure the
  selection against full attention;
- a prefill chunk over plain or quantized pages, sparse layers' included, is written through its
  cache and attends causally over its stored tokens (decoded, for quantized ones) and itself
  (``kvfactory.attention.causal_chunk``), a page selector then seeing the chunk's queries;
- everything else (int8 and FP8 pages, eviction policies, sparse reads over quantized pages and
  their shadow steps, sliding layers that are not plain pages) goes
  through the sequence's own cache and kvfactory's attention, exactly as ``model.generate`` would
  run it, with a causal mask aligned to the chunk's end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvfactory import attention
from kvfactory.cache import KVCache, KVLayer, kvfactory_attention
from kvfactory.quantization.ragged import (
    PackedPlan,
    flush_full_windows,
    in_place,
    packed_plan,
    quantized_decode,
)
from kvfactory.storage.blocks import BlockIds
from kvfactory.storage.paged import PagedStore, append_one_each, write_slots
from kvfactory.storage.ragged import block_tables, paged_decode, shared_prefix


@dataclass
class Segment:
    """Tokens ``[start, end)`` of the packed step belong to ``cache``."""

    cache: KVCache
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class DecodePlan:
    """Where one decode token of each sequence goes in a layer group's blocks and what each then reads
    (``paged_decode``'s tables, starts and lengths): built by the first layer of the group in a step,
    reused by the others standing at the same ``places``."""

    places: list[tuple[BlockIds, int, int]]  # each sequence's blocks and the layer's span, before the write
    slots: torch.Tensor  # [S]: the new token's slot in a layer's [heads, blocks * page_size] view
    tables: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    shared: int  # leading blocks every sequence reads whole (a common prompt's), read once for all


@dataclass
class StepBatch:
    """The segments of one step; ``write`` is ``kvfactory.cache.PackedBatch``'s per-layer callback."""

    segments: list[Segment]
    in_place: bool = True  # decode paged layers with the ragged kernels (False: through each cache)
    plans: dict[tuple[BlockIds, ...], DecodePlan] = field(default_factory=dict)  # by the sequences' blocks
    # each layer group's quantized pages' last plan (the group's layers share its block tables), kept
    # by the engine from step to step (``packed_plan``)
    packed_plans: dict[tuple[int, ...], PackedPlan] = field(default_factory=dict)

    def write(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> attention.BatchRead:
        return _StepRead(self, layer_idx, key, value)

    @cached_property
    def chunks(self) -> list[Segment]:
        """The segments of prefill chunks (more than one token), found once for every layer."""
        return [segment for segment in self.segments if segment.tokens > 1]


class _StepRead(attention.BatchRead):
    """One layer's writes and attention, run when the layer attends. Each sequence outside the paged
    kernel writes and attends in turn, as under ``generate``: a store's read may live in a workspace
    that the next sequence's read reuses."""

    def __init__(self, batch: StepBatch, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.batch, self.layer_idx, self.key, self.value = batch, layer_idx, key, value

    def attend(self, module: torch.nn.Module, query: torch.Tensor, scaling: float, **kwargs: object
               ) -> torch.Tensor:
        out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
        paged: list[tuple[int, KVLayer]] = []
        quantized: list[tuple[int, KVLayer]] = []
        sparse: list[tuple[int, KVLayer]] = []
        plain_math = attention.plain_softmax(kwargs.get("dropout"), kwargs)  # what causal_chunk computes
        self._flush_chunks()
        for segment in self.batch.segments:
            layer = segment.cache.layers[self.layer_idx]
            if self.batch.in_place and segment.tokens == 1:
                if layer.store.plain_pages:  # sliding layers too: the plan reads their window
                    paged.append((segment.start, layer))
                    continue
                if not layer.is_sliding and in_place(layer.store, query.shape[1]):
                    quantized.append((segment.start, layer))
                    continue
                if not layer.is_sliding and layer.store.reads_blocks():
                    sparse.append((segment.start, layer))
                    continue
            span = slice(segment.start, segment.end)
            keys, values = segment.cache.update(self.key[:, :, span], self.value[:, :, span], self.layer_idx)
            read, observer = attention.take(keys, self.layer_idx)
            q = query[:, :, span]
            pending = isinstance(read, attention.DeferredRead | attention.NarrowRead)  # a tail returned
            length = read.length if pending else keys.shape[-2]
            whole = read is None or (isinstance(read, attention.DeferredRead)  # K/V read whole for a chunk
                                     and q.shape[2] > attention.MAX_CHUNKED_QUERY)
            passive = observer is None or getattr(observer, "keeps_causal_mask", False)
            if q.shape[2] > 1 and whole and passive and layer.sliding_window is None and plain_math:
                if read is not None:  # quantized pages, decoded for the chunk as kvfactory_attention would
                    keys, values = read.materialize()
                if observer is not None:  # a page selector: causal over the stored tokens, as here
                    observer.attention_mask(None, q)
                out[:, span] = attention.causal_chunk(q, keys, values, scaling)
                if observer is not None:  # the prompt's page mass, as kvfactory_attention would hand it
                    observer.observe(q, scaling)
                continue
            mask = causal_mask(q.shape[2], length, layer.sliding_window, q.device) if q.shape[2] > 1 else None
            attention.defer(read, keys, self.layer_idx, observer)
            out[:, span], _ = kvfactory_attention(module, q, keys, values, mask, scaling=scaling, **kwargs)
        if paged:
            self._paged(paged, query, scaling, out)
        if quantized:
            self._quantized(quantized, query, scaling, out)
        if sparse:
            self._sparse(sparse, query, scaling, out)
        return out

    def _flush_chunks(self) -> None:
        """The full-precision windows in front of quantized pages that this step's prefill chunks push
        past their residual encode their oldest groups first (``flush_full_windows``), as each store's
        write would; the chunks then join the windows."""
        chunks = self.batch.chunks
        if chunks:
            flush_full_windows([segment.cache.layers[self.layer_idx].store for segment in chunks],
                               [segment.tokens for segment in chunks])

    def _paged(self, paged: list[tuple[int, KVLayer]], query: torch.Tensor, scaling: float,
               out: torch.Tensor) -> None:
        """Write every decode token of plain pages with one copy, then attend in one kernel call (a
        sliding layer over its window's last tokens, before it gives the oldest back)."""
        at = torch.tensor([start for start, _ in paged], device=query.device)
        layers = [layer for _, layer in paged]
        stores = [layer.store for layer in layers]
        keys, values = (x[0, :, at].transpose(0, 1)[:, :, None] for x in (self.key, self.value))
        plan = self._plan(stores, layers[0].sliding_window, keys, values)
        blocks = stores[0].blocks
        write_slots(blocks, plan.slots, keys, values)
        for i, layer in enumerate(layers):
            layer.written(keys[i:i + 1])
        q = query[0, :, at].transpose(0, 1)  # [S, Hq, D]
        out[0, at] = paged_decode(q, blocks.k, blocks.v, plan.tables, plan.starts, plan.lengths, scaling,
                                  check=False, shared=plan.shared)

    def _plan(self, stores: list[PagedStore], window: int | None, keys: torch.Tensor,
              values: torch.Tensor) -> DecodePlan:
        """This step's ``DecodePlan`` for the stores' layer group: the one an earlier layer of the group
        made when the stores stand where it stood (their tokens then counted written), else a new one
        (room made for each token; a sliding layer reads its last ``window`` tokens)."""
        places = [store.place() for store in stores]
        key = tuple(shared for shared, _, _ in places)
        plan = self.batch.plans.get(key)
        if plan is not None and plan.places == places:
            for store in stores:
                store.count_written(1)
            return plan
        plan = self.batch.plans[key] = decode_plan(stores, window, keys[:1], values[:1])
        return plan

    def _quantized(self, quantized: list[tuple[int, KVLayer]], query: torch.Tensor, scaling: float,
                   out: torch.Tensor) -> None:
        """Write the decode tokens of KIVI pages (with one copy into the windows they join, planned once
        for a group's windows, after the full windows encoded their oldest group in one batch; through
        the store where it encodes as it writes), then attend with one kernel call for the packed blocks
        and one for the windows."""
        at = torch.tensor([start for start, _ in quantized], device=query.device)
        stores = [layer.store for _, layer in quantized]
        fits = [store.fits_window(1) for store in stores]
        if not all(fits):  # full windows encode their oldest group first, in one batch
            flush_full_windows([store for store, fit in zip(stores, fits, strict=True) if not fit], 1)
            fits = [store.fits_window(1) for store in stores]
        windowed = [i for i, fit in enumerate(fits) if fit]  # most steps: the token joins the window
        plan = None
        if windowed:
            layers = [quantized[i][1] for i in windowed]
            inner = [layer.store.inner for layer in layers]
            rows = at if len(windowed) == len(quantized) else at[torch.tensor(windowed)]
            keys, values = (x[0, :, rows].transpose(0, 1)[:, :, None] for x in (self.key, self.value))
            plan = self._plan(inner, None, keys, values)  # the windows of a group share their tables
            write_slots(inner[0].blocks, plan.slots, keys, values)
            for i, layer in enumerate(layers):
                layer.written(keys[i:i + 1])
        for (start, layer), fit in zip(quantized, fits, strict=True):
            if not fit:  # the window is full: the store encodes a group as it writes
                layer.append(self.key[:, :, start:start + 1], self.value[:, :, start:start + 1])
        q = query[0, :, at].transpose(0, 1)  # [S, Hq, D]
        whole = len(windowed) == len(quantized)
        windows = (plan.tables, plan.starts, plan.lengths, plan.shared) if whole else None
        group = stores[0].packed.group or (self.layer_idx,)  # a fork's twins keep their original's group
        packed = packed_plan(stores, self.batch.packed_plans.get(group))
        if packed is not None:
            self.batch.packed_plans[group] = packed
        out[0, at] = quantized_decode(q, stores, scaling, windows, packed)

    def _sparse(self, sparse: list[tuple[int, KVLayer]], query: torch.Tensor, scaling: float,
                out: torch.Tensor) -> None:
        """Decode tokens of sparse layers over plain pages: written into the pages with one copy per
        tensor (each store then updates its page summaries), each store picks the blocks each KV head
        reads, and each KV head's rows of every sequence attend over their own picks in one kernel
        call."""
        at = torch.tensor([start for start, _ in sparse], device=query.device)
        keys, values = (x[0, :, at].transpose(0, 1)[:, :, None] for x in (self.key, self.value))
        append_one_each([layer.store.inner for _, layer in sparse], keys, values)
        picks = []
        for i, (start, layer) in enumerate(sparse):
            layer.store.track(keys[i:i + 1], values[i:i + 1])
            layer.written(keys[i:i + 1])
            picks.append(layer.store.decode_blocks(query[0, :, start]))
        pool = sparse[0][1].store.inner.pages_in_place()[0]
        lengths = torch.tensor([tokens for _, tokens in picks])
        starts = torch.zeros_like(lengths)
        hkv = pool.k.shape[0]
        rows = query.shape[1] // hkv
        q = query[0, :, at].transpose(0, 1)  # [S, Hq, D]
        for head in range(hkv):
            heads = slice(head * rows, (head + 1) * rows)
            tables = block_tables([blocks[head] for blocks, _ in picks])
            out[0, at, heads] = paged_decode(q[:, heads], pool.k[head:head + 1], pool.v[head:head + 1],
                                             tables, starts, lengths, scaling, check=False)


def decode_plan(stores: list[PagedStore], window: int | None, key: torch.Tensor, value: torch.Tensor
                ) -> DecodePlan:
    """Room for one decode token in each one-row store ``stores[s]`` of one layer (counted written) and
    what each then reads, a sliding layer its last ``window`` tokens; ``key`` / ``value`` are shaped like
    one layer's writes ``[1, kv_heads, any, head_dim]``."""
    places = [store.place() for store in stores]
    slots = torch.tensor([store.next_slot(key, value)[1] for store in stores], device=key.device)
    rows, starts, lengths = [], [], []
    for store in stores:
        _, ids, start, length = store.pages_in_place()
        if window is not None and length > window:
            start, length = start + length - window, window
            ids, start = ids[start // store.page_size:], start % store.page_size
        rows.append(ids)
        starts.append(start)
        lengths.append(length)
    tables, starts, lengths = block_tables(rows), torch.tensor(starts), torch.tensor(lengths)
    shared = shared_prefix(tables, starts, lengths, stores[0].page_size)
    return DecodePlan(places, slots, tables, starts, lengths, shared)


def causal_mask(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[1, 1, queries, keys]``: the last ``queries`` of ``keys`` consecutive tokens see the tokens
    before them (within ``window`` for a sliding layer), as SDPA's boolean mask."""
    rows = torch.arange(queries, device=device)[:, None] + (keys - queries)
    cols = torch.arange(keys, device=device)[None, :]
    visible = cols <= rows
    if window is not None:
        visible &= rows - cols < window
    return visible[None, None]
