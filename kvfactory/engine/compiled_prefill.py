"""The engine's prefill steps compiled: the model's forward over a step of prefill chunks (and, in
mixed steps, decode tokens) under ``torch.compile``, with no graph break at attention, so that
inductor fuses the elementwise work between the matrix products (normalisation, rotary embedding,
the gated activation, residuals), which the eager forward runs one op at a time.

Each attention layer writes its tokens' K/V into plain pages and attends causally over each
sequence's blocks in one torch custom op (``kvfactory.engine.step_ops.paged_prefill_step``: chunks
through the chunk kernel of ``kvfactory/kernels/chunk.c``, decode tokens through the paged decode
kernel), over tensors built once per step and layer group before the forward (``PrefillStep``). Over
KIVI pages (``quantized_prefill_step``) the tokens go to the full-precision windows, read so, and the
packed tokens are read whole. Such a step is covered where each window takes its sequence's tokens
after encoding its oldest groups before the forward, as the eager step encodes them before its write
(``flush_full_windows``), so that both read the same tokens the same way. A chunk that encodes some
of its own tokens (a prompt's first chunks longer than the window, ``QuantizedStore.own_flush``) goes
to the window whole, reads those tokens encoded and decoded as the eager write leaves them
(``own_flush_chunk``), and its window encodes them after the forward, into the same codes. Room for
every token is made before the forward, as the decode step's plan makes it, and the stores count the
tokens written after it. The weights are not frozen into the graph: its linear layers multiply by the
row-major weights (MKL's GEMM) where ``weights.gemm_is_faster`` said so, else by the engine's
panels, and inductor keeps no copy.

It covers steps of ``weights.GEMM_ROWS`` tokens or more over plain or KIVI pages of full-attention
layers, on CPUs where the chunk kernel runs (float32, head sizes a multiple of 64, AVX-512); the
engine's decode steps, fewer tokens, go to ``kvfactory.engine.compiled``. Every size the graph reads
is at least two (block tables two wide and two rows, logits of two rows), so one graph serves every
such step.
Logits differ from the eager step's by summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvfactory import attention
from kvfactory.cache import KVCache, KVLayer, attention_layout
from kvfactory.engine.batch import Segment
from kvfactory.engine.compiled import (
    Codes,
    CompiledForward,
    at_least_two,
    groups_aligned,
    layer_codes,
    layer_groups,
)
from kvfactory.engine.step_ops import PACKED
from kvfactory.engine.weights import GEMM_ROWS
from kvfactory.quantization.ragged import PackedPlan, flush_full_windows, packed_plan
from kvfactory.quantization.store import QuantizedStore
from kvfactory.storage.base import LayerStore
from kvfactory.storage.paged import PagedStore
from kvfactory.storage.ragged import block_tables, shared_fits


@dataclass
class PrefillStep:
    """What every layer of one compiled prefill step reads: layer ``i``'s pools ``keys[i]`` /
    ``values[i]`` (plain pages, or KIVI pages' full-precision windows) and the tensors of its packed
    pages ``packed[i]`` (``step_ops.PACKED``; None for plain pages) read as ``codes[i]`` says; the
    chunks' bounds in the packed tokens (``bounds [S + 1]``); for its group ``group[i]``, the tokens'
    ``slots [T]``, each sequence's block table and the tokens it then holds (``tables``, ``totals``:
    ``paged_prefill``'s) and, for KIVI pages, the packed pages' ``packed_tables``, ``packed_tokens`` and
    ``packed_shared`` blocks (``kvfactory.quantization.ragged.PackedPlan``) and the tokens each sequence's
    window encodes after the step, where its chunk encodes some of its own (``own_flush``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    packed: list[list[torch.Tensor] | None]
    codes: tuple[Codes | None, ...]
    group: tuple[int, ...]
    bounds: torch.Tensor
    slots: list[torch.Tensor]
    tables: list[torch.Tensor]
    totals: list[torch.Tensor]
    packed_tables: list[torch.Tensor | None]
    packed_tokens: list[torch.Tensor | None]
    packed_shared: list[torch.Tensor | None]
    own_flush: list[torch.Tensor | None]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        i = module.layer_idx
        g = self.group[i]
        pages = (self.keys[i], self.values[i], self.slots[g], self.bounds, self.tables[g], self.totals[g])
        codes = self.codes[i]
        if codes is None:
            return torch.ops.kvfactory.paged_prefill_step(query, key, value, *pages, scaling)
        return torch.ops.kvfactory.quantized_prefill_step(
            query, key, value, *pages, self.packed[i], self.packed_tables[g], self.packed_tokens[g],
            self.packed_shared[g], self.own_flush[g], scaling, codes.bits, codes.group)


# each layer of each sequence with the tokens it took: its pages, None where the plan counted them
Written = list[tuple[KVLayer, PagedStore | None, int]]
# a planned step, what it wrote, and each layer's KIVI stores to encode their own tokens after it
Planned = tuple["PrefillStep", Written, list[list[QuantizedStore]]]


def _own_flush(store: LayerStore, codes: Codes | None, like: tuple[torch.Tensor, torch.Tensor], tokens: int
               ) -> int | None:
    """What a compiled prefill step encodes after its forward of a layer's store that takes ``tokens`` more
    (``QuantizedStore.own_flush``: plain pages 0), where it reads the store as the step does (plain
    pages, KIVI pages the kernels read in place, also before their first write: K/V like ``like``);
    else None."""
    if codes is None:
        return 0 if store.plain_pages else None
    if not isinstance(store, QuantizedStore) or not store.kernel_pages_for(store.like or like):
        return None
    return store.own_flush(tokens)


def _packed_plan(stores: list[QuantizedStore], own: list[int]) -> PackedPlan | None:
    """The ``PackedPlan`` that a group's layers read, made from its first layer's ``stores`` (one per
    sequence; ``groups_aligned`` found the others at the same place); an empty one where none holds a
    packed token yet and some sequence's chunk encodes its own (``own``, the tokens each encodes); None
    otherwise."""
    plan = packed_plan(stores)
    if plan is None and any(own):
        empty = torch.zeros(len(own), dtype=torch.long)
        return PackedPlan([None] * len(own), next(s for s, flush in enumerate(own) if flush), empty[:, None],
                          empty, 0)
    return plan


class CompiledPrefill(CompiledForward):
    """The compiled prefill step of one model, compiled when made (over a dummy step on scratch pools);
    ``plan`` prepares a step's tensors (or says the step is not one it covers), ``forward`` runs it and
    counts the tokens written."""

    name = "prefill step"

    def __init__(self, model: Any, like: tuple[torch.Tensor, torch.Tensor], codes: list[Codes | None],
                 groups: list[tuple[int, ...]]) -> None:
        """``like``: K/V shaped like one layer's writes ``[1, kv_heads, any, head_dim]``; ``codes``: each
        layer's (``compiled.layer_codes``); ``groups``: the layers that share a block table per
        sequence."""
        super().__init__(model, freezing=False)
        self.codes = tuple(codes)
        self.like = tuple(x.new_empty(*x.shape[:2], 1, x.shape[3]) for x in like)
        self.mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=like[0].device)  # skips mask building
        self.layers = len(attention_layout(model.config))
        self.members = [list(members) for members in groups]
        self.group = layer_groups(groups, self.layers)
        with torch.inference_mode(False):  # graph inputs of one kind, as a pool's tensors
            # what a layer whose sequences hold no packed token yet passes for its pool (never read)
            self._unread = [None if kind is None else [
                torch.zeros(shape[0], 2, *shape[1:], dtype=dtype, device=like[0].device)
                for _, shape, dtype in kind.layout] for kind in self.codes]
        self._warm_up()

    @staticmethod
    def covers(cache: KVCache, like: tuple[torch.Tensor, torch.Tensor], query_heads: int) -> bool:
        """Whether caches like ``cache`` (a new one) hold plain or KIVI pages (``compiled.layer_codes``) of
        full-attention layers only, which the chunk kernel reads for ``query_heads`` query heads over K/V
        like ``like``."""
        key = like[0]
        query = key.new_empty(1, query_heads, key.shape[3])
        return query_heads % key.shape[1] == 0 and shared_fits(query) and key.dtype == torch.float32 \
            and all(layer.sliding_window is None for layer in cache.layers) \
            and layer_codes(cache, like, query_heads) is not None

    def plan(self, segments: list[Segment]) -> Planned | None:
        """A ``PrefillStep`` for ``segments`` with room made for every token, each group's layers with the
        pages that hold each sequence's tokens (to count them written after the forward), and each
        layer's KIVI stores whose chunk encodes some of its own tokens (to encode them after the forward,
        ``QuantizedStore.own_flush``); None for a step this path does not cover, and ``CacheFullError``
        where the pool cannot hold the step, having touched nothing but KIVI windows that encoded their
        oldest groups (as the eager step would before its write)."""
        if sum(segment.tokens for segment in segments) < GEMM_ROWS:
            return None
        chunks = [segment.tokens for segment in segments]
        stores = [[segment.cache.layers[i].store for segment in segments] for i in range(self.layers)]
        own = []
        for row, codes in zip(stores, self.codes, strict=True):
            own.append([_own_flush(store, codes, self.like, n) for store, n in zip(row, chunks, strict=True)])
            if None in own[-1]:
                return None
        for row, codes in zip(stores, self.codes, strict=True):
            if codes is not None:
                flush_full_windows(row, chunks)
        pages = [row if codes is None else [store.inner for store in row]
                 for row, codes in zip(stores, self.codes, strict=True)]
        if not groups_aligned(self.members, stores):
            return None
        for layers in self.members:
            for store in pages[layers[0]]:
                held = store.pages_in_place()
                if held is not None and held[2]:  # stored tokens must start at their first block's start
                    return None
        packed = []
        for layers in self.members:
            plan = None
            if self.codes[layers[0]] is not None:
                plan = _packed_plan(stores[layers[0]], own[layers[0]])
                if plan is None:
                    return None
            packed.append(plan)
        key, value = self.like
        pool = segments[0].cache.shared
        if pool is not None:  # CacheFullError before any room is made: a step is written whole or not at all
            pool.check([request for layers in self.members
                        for store, n in zip(pages[layers[0]], chunks, strict=True)
                        for request in store.block_requests(n, 1, key, value)]
                       + [request for layers in self.members
                          for store, flush in zip(stores[layers[0]], own[layers[0]], strict=True) if flush
                          for request in store.packed.block_requests(flush, 1, self.like)])
        for row, codes in zip(stores, self.codes, strict=True):
            for store in row if codes is not None else ():
                if store.like is None:  # its first write: the window takes it straight
                    store.check_like(key, value)
        slots, tables, totals, written = [], [], [], []
        for layers in self.members:
            leaders = pages[layers[0]]
            slots.append(torch.cat([store.next_slots(key, value, n) for store, n in zip(leaders, chunks,
                                                                                        strict=True)]))
            held = [store.pages_in_place() for store in leaders]
            tables.append(at_least_two(at_least_two(block_tables([ids for _, ids, _, _ in held]), 0), 1))
            totals.append(at_least_two(torch.tensor([length for _, _, _, length in held]), 0))
            written.extend((segments[s].cache.layers[i], None if i == layers[0] else pages[i][s], n)
                           for i in layers for s, n in enumerate(chunks))
        pools = [pages[i][0].layer_blocks(key, value) for i in range(self.layers)]
        bounds = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()])
        runs = [None if codes is None else self._unread[i] if not any((plan := packed[self.group[i]]).held)
                else [stores[i][plan.first].runs.table.blocks.tensors[name] for name in PACKED]
                for i, codes in enumerate(self.codes)]
        step = PrefillStep(
            [p.k for p in pools], [p.v for p in pools], runs,
            self.codes, self.group, bounds, slots, tables, totals,
            [None if p is None else at_least_two(at_least_two(p.tables, 0), 1) for p in packed],
            [None if p is None else at_least_two(p.tokens, 0) for p in packed],
            [None if p is None else torch.tensor(p.shared) for p in packed],
            [None if p is None else at_least_two(torch.tensor(own[layers[0]]), 0)
             for p, layers in zip(packed, self.members, strict=True)])
        flushing = [[store for store, flush in zip(row, flushes, strict=True) if flush]
                    for row, flushes in zip(stores, own, strict=True)]
        return step, written, [row for row in flushing if row]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, planned: Planned,
                rows: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` at the packed ``rows`` after the planned step over ``input_ids [T]``
        at ``positions [T]``; every layer's pages then count their tokens written, as the eager step
        does, and windows whose chunk encoded some of its own tokens encode them."""
        step, written, flushing = planned
        last = torch.full((max(2 - len(rows), 0),), input_ids.shape[0] - 1, dtype=rows.dtype)
        logits = self._run(input_ids, positions, step, torch.cat([rows.cpu(), last]).to(rows.device))
        self.steps += self.failure is None
        key = self.like[0]
        for layer, pages, tokens in written:
            if pages is not None:  # the group's first layer counted them when the plan made room
                pages.count_written(tokens)
            layer.written(key.expand(-1, -1, tokens, -1))
        for stores in flushing:
            flush_full_windows(stores, 0)
        return logits[:len(rows)]

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PrefillStep,
                rows: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=self.mask,
                         use_cache=False, logits_to_keep=rows, **{attention.STEP: step})
        return out.logits[0]

    def _dummy_step(self) -> tuple[torch.Tensor, torch.Tensor, PrefillStep, torch.Tensor]:
        """Chunks of 70 and 90 tokens after 5 and 10 stored ones, in blocks of 4 of scratch pools (KIVI
        pages: 3 and 4 more blocks of packed tokens): every size distinct and above 1, ``GEMM_ROWS``
        tokens or more (so that the graph compiled for it serves every real step)."""
        key, value = self.like
        device = key.device
        with torch.inference_mode(False):  # as a pool's tensors are made (``BlockPool.layer``)
            pools = [torch.zeros(key.shape[1], 60, 4, x.shape[3], dtype=x.dtype, device=device)
                     for _ in range(self.layers) for x in (key, value)]
            packed = [None if kind is None else
                      [torch.zeros(shape[0], 9, *shape[1:], dtype=dtype, device=device)
                       for _, shape, dtype in kind.layout] for kind in self.codes]
        chunks, stored = (70, 90), (5, 10)
        tables = torch.arange(50, device=device).view(2, 25)
        slots = torch.cat([tables[s].repeat_interleave(4)[stored[s]:stored[s] + chunks[s]] * 4
                           + torch.arange(stored[s], stored[s] + chunks[s]) % 4 for s in range(2)])
        totals = torch.tensor([stored[0] + chunks[0], stored[1] + chunks[1]], device=device)
        bounds = torch.tensor([0, chunks[0], sum(chunks)], device=device)
        kinds = [self.codes[layers[0]] for layers in self.members]  # a group's layers share one codec
        packed_plans = [[None] * 4 if kind is None else [
            torch.tensor(x, device=device)
            for x in ([[0, 1, 2, 3], [4, 5, 6, 7]], [3 * kind.block_tokens, 4 * kind.block_tokens], 0, [0, 0])
        ] for kind in kinds]
        step = PrefillStep(pools[0::2], pools[1::2], packed, self.codes, self.group, bounds,
                           *([x.clone() for _ in self.members] for x in (slots, tables, totals)),
                           *([p[j] for p in packed_plans] for j in range(4)))
        positions = torch.cat([torch.arange(stored[s], stored[s] + chunks[s]) for s in range(2)]).to(device)
        ids = torch.ones(sum(chunks), dtype=torch.long, device=device)
        return ids, positions, step, torch.tensor([chunks[0] - 1, sum(chunks) - 1], device=device)

