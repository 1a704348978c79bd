"""The engine's decode step compiled: the model's forward over a packed batch of decode tokens under
``torch.compile`` (inductor's CPU backend, the weights frozen into the graph, which prepacks them),
with no graph break at attention.

Each attention layer stores its new K/V and reads its sequences' pages in one torch custom op
(``kvfactory.engine.step_ops``): ``paged_decode_step`` over plain pages, ``quantized_decode_step``
over KIVI pages (their packed blocks and full-precision windows), over tensors built once per step
and layer group before the forward (``DecodeStep``): each layer's pool tensors, and per group the new
tokens' slots, the block tables, the first token's offsets, the lengths read and, for KIVI pages, the
packed block tables and tokens, and a shared prompt's packed blocks decoded: once while the steps
read the same leading blocks, which stay pinned meanwhile (a full packed block is never written again
while held), a float32 copy of the prompt's packed tokens per layer kept between steps. No cache
update runs inside the graph: windows that the new token would push past their residual encode their
oldest group before the forward, as the eager step's layers would before writing it
(``flush_windows``), and the stores count the written token after the forward, as the eager step
does. Shapes are dynamic and block tables at least two
wide, so one graph serves every batch of two to ``GEMM_ROWS - 1`` sequences (fewer rows than the
linear layers take the GEMM for) and every context.

It covers plain pages and KIVI pages that the C kernels read (the engine refuses ``compile_step``
for other configs). Steps it does not cover run eagerly (``kvfactory.engine.batch``): prefill chunks
(``kvfactory.engine.compiled_prefill`` compiles steps of prefill chunks, mixed steps included, over
plain and KIVI pages), a single sequence, layers of a group standing at different places, KIVI pages
before any sequence holds a packed token or while their scales wait for their first tokens.
``CompiledForward`` holds what both compiled steps share: the compilation over a dummy step and the
eager fallback after a compiler failure. Logits differ from the eager step's by summation order
(fused kernels, prepacked weights).
"""

from __future__ import annotations

import contextlib
import logging
import types
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvfactory import attention
from kvfactory.cache import KVCache, KVLayer, attention_layout
from kvfactory.codecs import native
from kvfactory.engine.batch import Segment, decode_plan
from kvfactory.engine.step_ops import PACKED
from kvfactory.engine.weights import GEMM_ROWS
from kvfactory.quantization.ragged import PackedPlan, decode_blocks, flush_full_windows, packed_plan
from kvfactory.quantization.store import BlockLayout, QuantizedStore, block_layout, packed_block_tokens
from kvfactory.storage.base import LayerStore
from kvfactory.storage.blocks import BlockPool
from kvfactory.storage.ragged import shared_fits

logger = logging.getLogger("kvfactory")


@contextlib.contextmanager
def _compile_config(freezing: bool) -> Iterator[None]:
    """Weights frozen into the graph where ``freezing`` (inductor then prepacks them); sizes that happen
    to be equal while compiling (the batch and a block table's width) kept as separate symbols, so
    neither recompiles."""
    import torch._inductor.config
    import torch.fx.experimental._config

    with torch._inductor.config.patch(freezing=freezing), \
            torch.fx.experimental._config.patch(use_duck_shape=False):
        yield


def own_code(method: Any) -> Any:
    """``method`` (bound) over a copy of its function's code object. Dynamo keeps its graphs per code
    object and, with ``fullgraph``, fails outright past ``recompile_limit`` (8) graphs of one: the
    engines of one process would share the limit (a ninth engine's compile raising), so each compiled
    step keeps its own."""
    fn = method.__func__
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    return types.MethodType(copy, method.__self__)


class Inductor:
    """Inductor's backend, counting the graphs it compiles once ``warm``. A compiled step's backend
    lives as long as Dynamo's cache of its code: it holds no reference to the step, so that a dropped
    engine's step, its frozen weights with it, is freed."""

    def __init__(self) -> None:
        self.warm = False
        self.recompiles = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: list) -> Any:
        self.recompiles += self.warm
        return torch._dynamo.lookup_backend("inductor")(graph, inputs)


class CompiledForward(ABC):
    """A forward of ``model`` compiled by inductor's CPU backend (dynamic shapes, one whole graph),
    compiled when made over a dummy step (``_warm_up``), so that a first request does not wait for the
    compiler; if the compiler fails, that step and every later one run the same function eagerly.
    ``freezing``: weights frozen into the graph (inductor prepacks those the engine's panels do not
    hold)."""

    name = "step"

    def __init__(self, model: Any, freezing: bool) -> None:
        self.model = model
        self.freezing = freezing
        self._backend = Inductor()  # refers to nothing of this step: Dynamo's cache of its code keeps it
        self.compiled = torch.compile(own_code(self._logits), backend=self._backend, dynamic=True,
                                      fullgraph=True)
        self.failure: str | None = None  # why the compiler failed: every step runs eagerly then
        self.steps = 0  # steps run through the compiled graph

    @abstractmethod
    def _logits(self, *args: Any) -> torch.Tensor:
        """The model's forward over a step's tensors (what is compiled)."""

    @abstractmethod
    def _dummy_step(self) -> tuple[Any, ...]:
        """A step's tensors over scratch pools, sized so that its graph serves every real step."""

    def _warm_up(self) -> None:
        """Compile over the dummy step, its tensors made as the engine's steps make theirs."""
        with torch.inference_mode():
            self._run(*self._dummy_step())
        self._backend.warm = True

    @property
    def recompiles(self) -> int:
        """Graphs compiled after the dummy step's (none expected)."""
        return self._backend.recompiles

    def _run(self, *args: Any) -> torch.Tensor:
        """The compiled forward, else (the compiler having failed, now or before) the same eagerly."""
        if self.failure is None:
            try:
                with _compile_config(self.freezing):
                    return self.compiled(*args)
            except torch._dynamo.exc.TorchDynamoException as exc:  # compiled nothing: run it eagerly
                self.failure = f"{type(exc).__name__}: {exc}"
                logger.warning("the engine's %s failed to compile; running it eagerly: %s", self.name,
                               self.failure)
        return self._logits(*args)


@dataclass(frozen=True)
class Codes:
    """How a layer's KIVI pages are read: ``bits`` per code, values grouped by ``group`` channels, in
    blocks of ``block_tokens`` tokens laid out as ``layout`` (``block_layout``)."""

    bits: int
    group: int
    block_tokens: int
    layout: BlockLayout


def layer_codes(cache: KVCache, like: tuple[torch.Tensor, torch.Tensor], query_heads: int
                ) -> list[Codes | None] | None:
    """Each layer's ``Codes`` (None for plain pages) in caches like ``cache`` (a new one, none written),
    K/V shaped like ``like`` ``[1, kv_heads, any, head_dim]``; None where a layer is neither plain pages
    nor full-attention KIVI pages that the C kernels read, with ``query_heads`` grouped over its KV heads
    as they take them (``kvfactory.quantization.ragged.in_place``)."""
    kv_heads = like[0].shape[1]
    grouped = query_heads % kv_heads == 0 and query_heads // kv_heads <= native.MAX_ROWS
    codes: list[Codes | None] = []
    for layer in cache.layers:
        store = layer.store
        if store.plain_pages:
            codes.append(None)
        elif grouped and isinstance(store, QuantizedStore) and store.kernel_codecs \
                and not layer.is_sliding:
            keys, values = store.key_codec, store.value_codec
            block_tokens = packed_block_tokens(store.inner.page_size, keys, values)
            codes.append(Codes(keys.bits, values.group_size, block_tokens,
                               block_layout(keys, values, block_tokens, like)))
        else:
            return None
    return codes


def read_as_planned(store: LayerStore, codes: Codes | None, tokens: int) -> bool:
    """Whether a layer's store is read as a compiled step reads it: plain pages, or KIVI pages the
    kernels read in place whose window takes ``tokens`` more, after a batched flush of its oldest
    groups where it is full (a chunk that would encode its own tokens is not)."""
    if codes is None:
        return store.plain_pages
    return isinstance(store, QuantizedStore) and store.kernel_pages and (
        store.fits_window(tokens) or store.batch_flush(tokens) > 0)


def layer_groups(groups: list[tuple[int, ...]], layers: int) -> tuple[int, ...]:
    """Each layer's index in ``groups`` (the layers that share one block table per sequence; every layer
    in one)."""
    index = {layer: g for g, members in enumerate(groups) for layer in members}
    return tuple(index[layer] for layer in range(layers))


def groups_aligned(members: list[list[int]], stores: list[list[LayerStore]]) -> bool:
    """Whether each sequence's layers of a group (``members``; ``stores[layer][sequence]``, plain pages or
    KIVI pages over them) stand at one place (``place``: the same blocks, start and length, of the window
    and the quantized pages), so that one plan per group serves them all. Layers write in order and
    rearrange their rows together (``BlockIds``), so a step that stopped part way leaves the group's
    first and last layers apart: those two are compared."""
    for layers in members:
        last = stores[layers[-1]]
        if any(first.place() != last[s].place() for s, first in enumerate(stores[layers[0]])):
            return False
    return True


def at_least_two(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with a zero slice appended along ``dim`` where it has one there (a block table's width, a
    row per sequence: never read, the lengths and bounds end every read), a size the compiled graph
    would compile again for."""
    return x if x.shape[dim] > 1 else torch.cat([x, torch.zeros_like(x)], dim)


@dataclass
class DecodeStep:
    """What every layer of one compiled decode step reads: layer ``i``'s pools ``keys[i]`` /
    ``values[i]`` (plain pages, or KIVI pages' full-precision windows) and the tensors of its packed
    pages ``packed[i]`` (``step_ops.PACKED``; None for plain pages) read as ``codes[i]`` says; for its
    group ``group[i]``, the plan's ``slots``, ``tables``, ``starts``, ``lengths`` and ``shared`` blocks
    (``kvfactory.engine.batch.DecodePlan``) and, for KIVI pages, the packed pages' ``packed_tables``,
    ``packed_tokens`` and ``packed_shared`` blocks (``kvfactory.quantization.ragged.PackedPlan``), and
    layer ``i``'s shared blocks ``decoded[i]`` (``decode_blocks``; a small unread tensor where none)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    packed: list[list[torch.Tensor] | None]
    codes: tuple[Codes | None, ...]
    group: tuple[int, ...]
    slots: list[torch.Tensor]
    tables: list[torch.Tensor]
    starts: list[torch.Tensor]
    lengths: list[torch.Tensor]
    shared: list[torch.Tensor]
    packed_tables: list[torch.Tensor | None]
    packed_tokens: list[torch.Tensor | None]
    packed_shared: list[torch.Tensor | None]
    decoded: list[torch.Tensor | None]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        i = module.layer_idx
        g = self.group[i]
        pages = (self.keys[i], self.values[i], self.slots[g], self.tables[g], self.starts[g], self.lengths[g],
                 self.shared[g])
        codes = self.codes[i]
        if codes is None:
            return torch.ops.kvfactory.paged_decode_step(query, key, value, *pages, scaling)
        return torch.ops.kvfactory.quantized_decode_step(
            query, key, value, *pages, self.packed[i], self.packed_tables[g], self.packed_tokens[g],
            self.packed_shared[g], self.decoded[i], scaling, codes.bits, codes.group)


class KeptBlocks:
    """A group's shared packed blocks ``ids`` of ``pool`` decoded per layer (``layers``), pinned (one more
    reference each) while kept, so that no other sequence's tokens are written into them meanwhile."""

    def __init__(self, pool: BlockPool, ids: torch.Tensor, layers: dict[int, torch.Tensor]) -> None:
        self.pool, self.ids, self.layers = pool, ids, layers
        pool.incref(ids)

    def reads(self, plan: PackedPlan) -> bool:
        """Whether ``plan``'s shared blocks are these."""
        return plan.shared == self.ids.numel() and torch.equal(plan.tables[0, :plan.shared], self.ids)

    def unpin(self) -> None:
        self.pool.decref(self.ids)


class CompiledDecode(CompiledForward):
    """The compiled decode step of one model, compiled when made (over a dummy step on scratch pools);
    ``plan`` prepares a step's tensors (or says the step is not one it covers), ``forward`` runs it and
    counts the tokens written."""

    name = "decode step"

    def __init__(self, model: Any, like: tuple[torch.Tensor, torch.Tensor], codes: list[Codes | None],
                 groups: list[tuple[int, ...]]) -> None:
        """``like``: K/V shaped like one layer's writes ``[1, kv_heads, any, head_dim]``; ``codes``: each
        layer's (``layer_codes``); ``groups``: the layers that share a block table per sequence."""
        super().__init__(model, freezing=True)
        key, value = like
        self.like = key.new_empty(*key.shape[:2], 1, key.shape[3]), value.new_empty(*value.shape[:2], 1,
                                                                                     value.shape[3])
        self.mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=key.device)  # skips mask building
        self.windows = attention_layout(model.config)
        self.codes = tuple(codes)
        self.members = [list(members) for members in groups]
        self.group = layer_groups(groups, len(self.windows))
        self._packed: dict[int, PackedPlan] = {}  # each group's last packed plan (``packed_plan``)
        self._decoded: dict[int, KeptBlocks] = {}  # each group's shared packed blocks decoded, per layer
        with torch.inference_mode(False):  # graph inputs of one kind (decoded blocks are made so too)
            self._unread = [None if kind is None else  # what a layer without shared blocks passes for them
                            key.new_zeros(2, key.shape[1], 2, key.shape[3]) for kind in self.codes]
        self._warm_up()

    def plan(self, segments: list[Segment]) -> tuple[DecodeStep, list[list[list[tuple[KVLayer, LayerStore]]]]
                                                     ] | None:
        """A ``DecodeStep`` for ``segments`` with room made for each token, and each group's layers per
        sequence with the pages that hold its token (to count it written after the forward); None for a
        step this path does not cover, having touched nothing but windows that encoded their oldest
        group (as the eager step would before its write)."""
        if not 2 <= len(segments) < GEMM_ROWS or any(segment.tokens != 1 for segment in segments):
            return None
        caches = [segment.cache for segment in segments]
        codes = self.codes
        if any([layer.sliding_window for layer in cache.layers] != self.windows for cache in caches):
            return None
        stores = [[cache.layers[i].store for cache in caches] for i in range(len(codes))]
        # the layers of a group (one config, one codec) standing at one place, its first answers for all
        if not all(read_as_planned(store, codes[layers[0]], 1) for layers in self.members
                   for store in stores[layers[0]]):
            return None
        if not groups_aligned(self.members, stores):
            return None
        pages = [row if kind is None else [store.inner for store in row] for row, kind in zip(stores, codes,
                                                                                               strict=True)]
        for layers in self.members:
            if codes[layers[0]] is None:
                continue
            full = [s for s, store in enumerate(stores[layers[0]]) if not store.fits_window(1)]
            for i in layers if full else ():
                flush_full_windows([stores[i][s] for s in full], 1)
        if any(store.blocks is None for row in pages for store in row):
            return None
        packed: list[PackedPlan | None] = []
        for g, layers in enumerate(self.members):
            plan = None
            if codes[layers[0]] is not None:
                plan = packed_plan(stores[layers[0]], self._packed.get(g))
                if plan is None:
                    return None
                self._packed[g] = plan
            packed.append(plan)
        plans = [decode_plan(pages[layers[0]], self.windows[layers[0]], *self.like)
                 for layers in self.members]
        decoded = self._decoded_blocks(stores, packed)
        step = DecodeStep(
            [row[0].blocks.k for row in pages], [row[0].blocks.v for row in pages],
            [None if kind is None else [stores[i][packed[self.group[i]].first].runs.table.blocks.tensors[name]
                                        for name in PACKED] for i, kind in enumerate(codes)],
            codes, self.group, [p.slots for p in plans], [at_least_two(p.tables, 1) for p in plans],
            [p.starts for p in plans], [p.lengths for p in plans], [torch.tensor(p.shared) for p in plans],
            [None if p is None else at_least_two(p.tables, 1) for p in packed],
            [None if p is None else p.tokens for p in packed],
            [None if p is None else torch.tensor(p.shared if g in self._decoded else 0)
             for g, p in enumerate(packed)],
            decoded)
        return step, [[[(caches[s].layers[i], pages[i][s]) for s in range(len(caches))] for i in layers]
                      for layers in self.members]

    def _decoded_blocks(self, stores: list[list[LayerStore]], packed: list[PackedPlan | None]
                        ) -> list[torch.Tensor | None]:
        """Each layer's shared packed blocks (``PackedPlan.shared``) decoded: kept from an earlier step while
        its group's plan reads the same leading blocks (pinned while kept, so that equal ids mean equal
        contents: a flush that adds each sequence a block keeps them), else decoded now; an unread tensor
        where the group has none or the chunk kernel does not read them (its plan's shared count 0 in
        the step)."""
        for g, plan in enumerate(packed):
            kept = self._decoded.get(g)
            if plan is None or not plan.shared or not shared_fits(self.like[0]):
                self._drop(g)
            elif kept is None or not kept.reads(plan):
                self._drop(g)
                store = stores[self.members[g][0]][plan.first]
                bits, group = store.key_codec.bits, store.value_codec.group_size
                ids = plan.tables[0, :plan.shared].clone()
                with torch.inference_mode(False):  # as the dummy step's inputs, so that no kind recompiles
                    layers = {i: decode_blocks(stores[i][plan.first].runs.table.blocks.tensors, bits, group,
                                               ids) for i in self.members[g]}
                self._decoded[g] = KeptBlocks(store.runs.table.pool, ids, layers)
        heads = [kept.layers for kept in self._decoded.values()]
        return [next((h[i] for h in heads if i in h), unread) for i, unread in enumerate(self._unread)]

    def _drop(self, group: int) -> None:
        kept = self._decoded.pop(group, None)
        if kept is not None:
            kept.unpin()

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the shared packed blocks kept decoded between steps."""
        return sum(t.nbytes for kept in self._decoded.values() for t in kept.layers.values())

    def release(self) -> None:
        """Drop the blocks kept decoded (no sequence is decoding)."""
        for g in list(self._decoded):
            self._drop(g)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                planned: tuple[DecodeStep, list[list[list[tuple[KVLayer, LayerStore]]]]]) -> torch.Tensor:
        """Logits ``[S, vocab]`` of the planned step's tokens ``input_ids [S]`` at ``positions [S]``; every
        layer's pages then count their token written, as the eager step does."""
        step, groups = planned
        logits = self._run(input_ids, positions, step)
        self.steps += self.failure is None
        key = self.like[0]
        for layers in groups:
            for depth, row in enumerate(layers):
                for layer, pages in row:
                    if depth:  # the group's first layer counted it when the plan made room
                        pages.count_written(1)
                    layer.written(key)
        return logits

    def _dummy_step(self) -> tuple[torch.Tensor, torch.Tensor, DecodeStep]:
        """Two sequences of 10 and 11 tokens in blocks of 4 of scratch pools (KIVI pages: 3 and 4 more
        blocks of packed tokens), every size distinct and above 1 (so that the graph compiled for it
        serves every real step)."""
        key, value = self.like
        device = key.device
        with torch.inference_mode(False):  # as a pool's tensors are made (``BlockPool.layer``)
            pools = [torch.zeros(key.shape[1], 7, 4, x.shape[3], dtype=x.dtype, device=device)
                     for _ in self.windows for x in (key, value)]
            packed = [None if kind is None else
                      [torch.zeros(shape[0], 9, *shape[1:], dtype=dtype, device=device)
                       for _, shape, dtype in kind.layout] for kind in self.codes]
        plan = [torch.tensor(x, device=device)
                for x in ([9, 22], [[0, 1, 2], [3, 4, 5]], [0, 0], [10, 11], 0)]
        kinds = [self.codes[layers[0]] for layers in self.members]  # a group's layers share one codec
        packed_plans = [[None] * 3 if kind is None else [
            torch.tensor(x, device=device) for x in ([[0, 1, 2, 3], [4, 5, 6, 7]],
                                                      [3 * kind.block_tokens, 4 * kind.block_tokens], 0)]
                        for kind in kinds]
        step = DecodeStep(pools[0::2], pools[1::2], packed, self.codes, self.group,
                          *([x.clone() for _ in self.members] for x in plan),
                          *([p[j] for p in packed_plans] for j in range(3)), list(self._unread))
        return torch.tensor([1, 2], device=device), torch.tensor([9, 10], device=device), step

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=self.mask,
                         use_cache=False, **{attention.STEP: step})
        return out.logits[0]
