"""One engine step's packed batch: where each sequence's tokens sit and how each attends.

A step feeds every scheduled sequence's new tokens back to back (``input_ids [1, T]``, no padding);
``StepBatch.write`` is called by each layer with the layer's new K/V ``[1, Hkv, T, D]`` and stores
each sequence's slice in that sequence's own cache. Its attention then runs per sequence:

- decode tokens of plain paged layers are attended to in one call over the pool's blocks in place
  (``kvfactory.storage.ragged.paged_decode``: no per-step copy of each sequence into a padded
  tensor; vLLM's PagedAttention, Kwon et al. 2023);
- everything else (prefill chunks, quantized pages, eviction policies, page selectors, sliding
  layers) goes through the sequence's own cache and kvfactory's attention, exactly as
  ``model.generate`` would run it, with a causal mask aligned to the chunk's end. These sequences
  are written and read one after another when the layer attends: a cache's read may sit in a
  workspace buffer shared by every cache of the pool (``ReadWorkspace``), valid only until the
  next read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory import attention
from kvfactory.cache import KVCache, kvfactory_attention
from kvfactory.storage.paged import PagedStore
from kvfactory.storage.ragged import paged_decode


@dataclass
class Segment:
    """Tokens ``[start, end)`` of the packed step belong to ``cache``, which has seen ``past`` before."""

    cache: KVCache
    start: int
    end: int
    past: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class _Generic:
    """A segment written through its cache when the layer attends: its slice of the new K/V."""

    segment: Segment
    key: torch.Tensor
    value: torch.Tensor


class StepBatch:
    """The segments of one step; ``write`` is ``kvfactory.cache.PackedBatch``'s per-layer callback."""

    def __init__(self, segments: list[Segment], in_place: bool = True) -> None:
        self.segments = segments
        self.in_place = in_place  # decode plain pages with the paged kernel (False: through each cache)

    def write(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> attention.BatchRead:
        paged: list[tuple[int, PagedStore]] = []
        generic: list[_Generic] = []
        for segment in self.segments:
            k, v = key[:, :, segment.start:segment.end], value[:, :, segment.start:segment.end]
            layer = segment.cache.layers[layer_idx]
            plain = type(layer.store) is PagedStore and not layer.is_sliding
            if self.in_place and segment.tokens == 1 and plain:
                layer.append(k, v)
                paged.append((segment.start, layer.store))
            else:
                generic.append(_Generic(segment, k, v))
        return _StepRead(layer_idx, paged, generic)


class _StepRead(attention.BatchRead):
    def __init__(self, layer_idx: int, paged: list[tuple[int, PagedStore]], generic: list[_Generic]) -> None:
        self.layer_idx, self.paged, self.generic = layer_idx, paged, generic

    def attend(self, module: torch.nn.Module, query: torch.Tensor, scaling: float, **kwargs: object
               ) -> torch.Tensor:
        out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
        if self.paged:
            self._paged(query, scaling, out)
        for item in self.generic:  # each read is attended to before the next one is made
            segment = item.segment
            keys, values = segment.cache.update(item.key, item.value, self.layer_idx)
            read, observer = attention.take(keys, self.layer_idx)
            q = query[:, :, segment.start:segment.end]
            length = read.length if isinstance(read, attention.DeferredRead) else keys.shape[-2]
            window = segment.cache.layers[self.layer_idx].sliding_window
            mask = causal_mask(q.shape[2], length, window, q.device) if q.shape[2] > 1 else None
            attention.defer(read, keys, self.layer_idx, observer)
            result, _ = kvfactory_attention(module, q, keys, values, mask, scaling=scaling, **kwargs)
            out[:, segment.start:segment.end] = result
        return out

    def _paged(self, query: torch.Tensor, scaling: float, out: torch.Tensor) -> None:
        views = [store.pages_in_place() for _, store in self.paged]
        pool = views[0][0]
        width = max(ids.numel() for _, ids, _, _ in views)
        tables = torch.zeros(len(views), width, dtype=torch.long)
        for row, (_, ids, _, _) in enumerate(views):
            tables[row, :ids.numel()] = ids
        starts = torch.tensor([start for _, _, start, _ in views])
        lengths = torch.tensor([length for _, _, _, length in views])
        rows = torch.tensor([start for start, _ in self.paged], device=query.device)
        q = query[0, :, rows].transpose(0, 1)  # [S, Hq, D]
        out[0, rows] = paged_decode(q, pool.k, pool.v, tables, starts, lengths, scaling)


def causal_mask(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[1, 1, queries, keys]``: the last ``queries`` of ``keys`` consecutive tokens see the tokens
    before them (within ``window`` for a sliding layer), as SDPA's boolean mask."""
    rows = torch.arange(queries, device=device)[:, None] + (keys - queries)
    cols = torch.arange(keys, device=device)[None, :]
    visible = cols <= rows
    if window is not None:
        visible &= rows - cols < window
    return visible[None, None]
