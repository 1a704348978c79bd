"""The engine's decode step compiled: the model's forward over a packed batch of decode tokens under
``torch.compile`` (inductor's CPU backend, the weights frozen into the graph, which prepacks them),
with no graph break at attention.

Each attention layer stores its new K/V and reads its sequences' pages in one torch custom op,
``kvfactory::paged_decode_step`` (``write_tokens`` and ``paged_decode``, vLLM's PagedAttention, Kwon
et al. 2023), over tensors built once per step and layer group before the forward (``DecodeStep``):
each layer's pool tensors, and per group the new tokens' slots, the block tables, the first token's
offsets and the lengths read. No cache update runs inside the graph; the stores count the written
token after the forward, as the eager step does. Shapes are dynamic, so one graph serves every batch
of two or more sequences and every context (a dimension of size 1 compiles once more: at most a few
graphs in all).

It covers plain pages only (the engine refuses ``compile_step`` for other configs). Steps it does not
cover run eagerly (``kvfactory.engine.batch``): prefill chunks, a single sequence, and layers of a
group standing at different places. If
the compiler fails, that step and every later one run the same function eagerly. Logits differ from
the eager step's by summation order (fused kernels, prepacked weights).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvfactory import attention
from kvfactory.cache import attention_layout
from kvfactory.engine.batch import Segment, decode_plan
from kvfactory.storage.paged import write_tokens
from kvfactory.storage.ragged import paged_decode

logger = logging.getLogger("kvfactory")


@contextlib.contextmanager
def _compile_config() -> Iterator[None]:
    """Weights frozen into the graph (inductor then prepacks them); sizes that happen to be equal while
    compiling (the batch and a block table's width) kept as separate symbols, so neither recompiles."""
    import torch._inductor.config
    import torch.fx.experimental._config

    with torch._inductor.config.patch(freezing=True), \
            torch.fx.experimental._config.patch(use_duck_shape=False):
        yield


@torch.library.custom_op("kvfactory::paged_decode_step", mutates_args=("k_pool", "v_pool"))
def paged_decode_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
                      lengths: torch.Tensor, shared: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token per sequence: write ``key`` / ``value [1, Hkv, S, D]`` into ``slots [S]`` of the
    layer's pools ``[Hkv, blocks, page_size, D]``, then attend with ``query [1, Hq, S, D]`` over each
    sequence's blocks (``paged_decode``'s ``tables``, ``starts``, ``lengths`` and ``shared`` blocks, a
    0-d tensor so that no count recompiles): ``[1, S, Hq, Dv]``."""
    write_tokens(k_pool, slots, key[0])
    write_tokens(v_pool, slots, value[0])
    out = paged_decode(query[0].transpose(0, 1), k_pool, v_pool, tables, starts, lengths, scale, check=False,
                       shared=int(shared))
    return out[None]


@paged_decode_step.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
      slots: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
      shared: torch.Tensor, scale: float) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], v_pool.shape[-1])


def _groups(windows: list[int | None]) -> tuple[list[int | None], tuple[int, ...], list[list[int]]]:
    """Layer groups by window: each group's window, each layer's group, each group's layers."""
    order = list(dict.fromkeys(windows))
    group = tuple(order.index(window) for window in windows)
    return order, group, [[i for i, g in enumerate(group) if g == index] for index in range(len(order))]


@dataclass
class DecodeStep:
    """What every layer of one compiled decode step reads: layer ``i``'s pools ``keys[i]`` /
    ``values[i]`` and, for its group ``group[i]``, the plan's ``slots``, ``tables``, ``starts``,
    ``lengths`` and ``shared`` blocks (``kvfactory.engine.batch.DecodePlan``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    group: tuple[int, ...]
    slots: list[torch.Tensor]
    tables: list[torch.Tensor]
    starts: list[torch.Tensor]
    lengths: list[torch.Tensor]
    shared: list[torch.Tensor]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        i = module.layer_idx
        g = self.group[i]
        return torch.ops.kvfactory.paged_decode_step(query, key, value, self.keys[i], self.values[i],
                                                     self.slots[g], self.tables[g], self.starts[g],
                                                     self.lengths[g], self.shared[g], scaling)


class CompiledDecode:
    """The compiled decode step of one model, compiled when made (over a dummy step on scratch pools,
    so a first request does not wait for the compiler); ``plan`` prepares a step's tensors (or says the
    step is not one it covers), ``forward`` runs it and counts the tokens written."""

    def __init__(self, model: Any, like: tuple[torch.Tensor, torch.Tensor]) -> None:
        """``like``: K/V shaped like one layer's writes ``[1, kv_heads, any, head_dim]``."""
        self.model = model
        key, value = like
        self.like = key.new_empty(*key.shape[:2], 1, key.shape[3]), value.new_empty(*value.shape[:2], 1,
                                                                                     value.shape[3])
        self.mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=key.device)  # skips mask building
        self.windows = attention_layout(model.config)
        self.order, self.group, self.members = _groups(self.windows)
        self.compiled = torch.compile(self._logits, backend=self._inductor, dynamic=True, fullgraph=True)
        self.recompiles = 0  # graphs compiled after the dummy step's: only where a size became 1
        self._warm = False
        self.failure: str | None = None  # why the compiler failed: every step runs eagerly then
        self.steps = 0  # steps run through the compiled graph
        with torch.inference_mode():
            self._run(*self._dummy_step())
        self._warm = True

    def plan(self, segments: list[Segment]) -> tuple[DecodeStep, list[list[list]]] | None:
        """A ``DecodeStep`` for ``segments`` with room made for each token, and each group's layers per
        sequence (to count the token written after the forward); None, touching nothing, for a step
        this path does not cover."""
        if len(segments) < 2 or any(segment.tokens != 1 for segment in segments):
            return None
        caches = [segment.cache for segment in segments]
        order, group, members = self.order, self.group, self.members
        for cache in caches:
            if [layer.sliding_window for layer in cache.layers] != self.windows or any(
                    not layer.store.plain_pages or layer.store.blocks is None for layer in cache.layers):
                return None
            for layers in members:
                places = [cache.layers[i].store.place() for i in layers]
                if any(place != places[0] for place in places):
                    return None
        plans = [decode_plan([cache.layers[layers[0]].store for cache in caches], order[index], *self.like)
                 for index, layers in enumerate(members)]
        blocks = [layer.store.blocks for layer in caches[0].layers]
        step = DecodeStep([b.k for b in blocks], [b.v for b in blocks], group, [p.slots for p in plans],
                          [p.tables for p in plans], [p.starts for p in plans], [p.lengths for p in plans],
                          [torch.tensor(p.shared) for p in plans])
        return step, [[[cache.layers[i] for cache in caches] for i in layers] for layers in members]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                planned: tuple[DecodeStep, list[list[list]]]) -> torch.Tensor:
        """Logits ``[S, vocab]`` of the planned step's tokens ``input_ids [S]`` at ``positions [S]``; every
        layer's stores then count their token written, as the eager step does."""
        step, groups = planned
        logits = self._run(input_ids, positions, step)
        self.steps += self.failure is None
        key = self.like[0]
        for layers in groups:
            for depth, row in enumerate(layers):
                for layer in row:
                    if depth:  # the group's first layer counted it when the plan made room
                        layer.store.count_written(1)
                    layer.written(key)
        return logits

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """The compiled forward, else (the compiler having failed, now or before) the same eagerly."""
        if self.failure is None:
            try:
                with _compile_config():
                    return self.compiled(input_ids, positions, step)
            except torch._dynamo.exc.TorchDynamoException as exc:  # compiled nothing: run it eagerly
                self.failure = f"{type(exc).__name__}: {exc}"
                logger.warning("the engine's decode step failed to compile; decoding eagerly: %s",
                               self.failure)
        return self._logits(input_ids, positions, step)

    def _inductor(self, graph: torch.fx.GraphModule, inputs: list) -> Any:
        """Inductor's backend, counting the graphs it compiles after the dummy step's."""
        self.recompiles += self._warm
        return torch._dynamo.lookup_backend("inductor")(graph, inputs)

    def _dummy_step(self) -> tuple[torch.Tensor, torch.Tensor, DecodeStep]:
        """Two sequences of 10 and 11 tokens in blocks of 4 of scratch pools, every size distinct and
        above 1 (so that the graph compiled for it serves every real step)."""
        key, value = self.like
        with torch.inference_mode(False):  # as a pool's tensors are made (``BlockPool.layer``)
            pools = [torch.zeros(key.shape[1], 7, 4, x.shape[3], dtype=x.dtype, device=x.device)
                     for _ in self.windows for x in (key, value)]
        order, group = self.order, self.group
        plan = [torch.tensor(x, device=key.device)
                for x in ([9, 22], [[0, 1, 2], [3, 4, 5]], [0, 0], [10, 11], 0)]
        step = DecodeStep(pools[0::2], pools[1::2], group, *([x.clone() for _ in order] for x in plan))
        return torch.tensor([1, 2], device=key.device), torch.tensor([9, 10], device=key.device), step

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=self.mask,
                         use_cache=False, **{attention.STEP: step})
        return out.logits[0]
