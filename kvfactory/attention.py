"""Attention over a layer store without materialising its whole K/V: kvfactory's attention math.

With ``attn_implementation="kvfactory"`` (registered by ``kvfactory.cache``, the transformers
adapter), a cache layer whose store can be read in pieces (``DeferredRead``: quantized storage)
returns only its full-precision tail from ``update`` and leaves a pending read for the layer's
attention call. ``attend`` then computes exact softmax attention from the read's scores and
weighted sums, which a quantized store computes straight from the packed codes
(``kvfactory.codecs.fused``) or by decoding a few MiB at a time into a reused buffer, so decode
never writes the whole layer's K/V in floating point. Scores of one step are small (one row per
query head), so a plain two-pass softmax is exact and needs no online rescaling.

Anything the chunked path does not cover (long queries such as prefill, logit soft-capping,
attention sinks, dropout) reads the store whole (``DeferredRead.materialize``) and runs SDPA.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Protocol

import torch

MAX_CHUNKED_QUERY = 16  # longer queries (prefill) read the store whole: their scores would be large


class DeferredRead(ABC):
    """A layer's K/V, attended to in pieces by the attention call that follows ``update``."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens stored per row."""

    @property
    @abstractmethod
    def kv_heads(self) -> int:
        """KV heads stored."""

    @abstractmethod
    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """``query [B, Hkv, R, D]`` dotted with every stored key: ``[B, Hkv, R, length]``."""

    @abstractmethod
    def weighted_sum(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs [B, Hkv, R, length]`` times the stored values: ``[B, Hkv, R, Dv]``."""

    @abstractmethod
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns in place of the whole K/V: the full-precision tail (may be empty)."""

    @abstractmethod
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K/V ``[B, Hkv, length, D]``, as a non-deferred read returns it."""


class NarrowRead(ABC):
    """A layer's K/V of which an attention call reads only part, chosen from its query (a page
    selector's read, ``kvfactory.selectors.sparse``): attention runs SDPA over what ``narrow`` returns."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens stored per row: the columns of the mask ``narrow`` is given."""

    @abstractmethod
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns in place of the whole K/V: the step's new tokens."""

    @abstractmethod
    def narrow(self, query: torch.Tensor, attention_mask: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys, values ``[B, Hkv, n, D]`` to attend to for ``query [B, Hq, q, D]``, and the mask
        (``attention_mask``'s columns of those tokens, broadcastable to ``[B, Hq, q, n]``)."""


class BatchRead(ABC):
    """The K/V of a packed batch of sequences (``kvfactory.engine``): each sequence's new tokens sit
    back to back in the step's query, and each attends to its own stored K/V only."""

    @abstractmethod
    def attend(self, module: torch.nn.Module, query: torch.Tensor, scaling: float, **kwargs: object
               ) -> torch.Tensor:
        """Attention of the packed ``query [1, Hq, T, D]``: ``[1, T, Hq, Dv]``."""


class Observer(Protocol):
    """A layer store that takes part in its attention call (an eviction store, ``kvfactory.eviction``)."""

    def attention_mask(self, mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
        """The mask to attend with, given transformers' ``mask`` and the step's ``query``."""

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        """Called once the call's output is computed."""


class _Pending(threading.local):
    read: DeferredRead | NarrowRead | BatchRead | None = None
    observer: Observer | None = None
    key: torch.Tensor | None = None
    layer_idx: int | None = None


_pending = _Pending()


def defer(read: DeferredRead | NarrowRead | BatchRead | None, returned_key: torch.Tensor | None = None,
          layer_idx: int | None = None, observer: Observer | None = None) -> None:
    """Leave ``read`` of layer ``layer_idx`` for the attention call that receives ``returned_key`` (what
    ``update`` returned), and ``observer`` (an eviction store) to take part in that call;
    ``defer(None)`` drops what an earlier update left."""
    _pending.read, _pending.observer = read, observer
    _pending.key, _pending.layer_idx = returned_key, layer_idx


def take(key: torch.Tensor, layer_idx: int | None
         ) -> tuple[DeferredRead | NarrowRead | BatchRead | None, Observer | None]:
    """The read and observer left for ``key`` by layer ``layer_idx``'s update (None, None when it
    returned K/V whole and has nothing to observe).

    What another layer left, or for keys of another length, was left by an update outside this
    forward pass (a cache filled by hand) and is dropped. A read of this layer for other keys of the
    same length means the model changed K/V between ``update`` and attention, which the chunked
    path cannot follow: that is an error, not a silent fallback.
    """
    read, observer = _pending.read, _pending.observer
    returned, layer = _pending.key, _pending.layer_idx
    defer(None)
    if layer != layer_idx or returned is None or key.shape[-2] != returned.shape[-2]:
        return None, None
    if read is None or returned is key:
        return read, observer
    raise RuntimeError("attn_implementation='kvfactory': the keys reaching attention are not the ones "
                       "the cache returned (the model transforms K/V after the cache update); load the "
                       "model with attn_implementation='sdpa' for this architecture")


def attend(query: torch.Tensor, read: DeferredRead, attention_mask: torch.Tensor | None,
           scaling: float) -> torch.Tensor:
    """Exact softmax attention of ``query`` ``[B, Hq, q, D]`` over ``read``; returns ``[B, q, Hq, Dv]``.

    Query heads are grouped by KV head as in transformers' ``repeat_kv`` (head ``h`` reads KV head
    ``h // (Hq / Hkv)``); ``attention_mask`` is SDPA's (boolean, True = attend, or additive),
    broadcastable to ``[B, Hq, q, length]``; without one, queries are causal over the tail.
    """
    b, hq, q, d = query.shape
    hkv = read.kv_heads
    groups = hq // hkv
    scores = read.scores(query.reshape(b, hkv, groups * q, d)).mul_(scaling)
    mask_scores(scores, attention_mask, q, read.length)
    out = read.weighted_sum(scores.softmax(-1))
    return out.view(b, hkv, groups, q, -1).reshape(b, hq, q, -1).transpose(1, 2).contiguous()


def mask_scores(scores: torch.Tensor, attention_mask: torch.Tensor | None, q: int, length: int) -> None:
    """Mask ``scores [B, Hkv, groups * q, length]`` of all stored tokens in place, under SDPA's
    ``attention_mask`` or, without one, causally over the last ``q``."""
    b, hkv, rows, _ = scores.shape
    groups = rows // q
    if attention_mask is not None:
        mask = attention_mask.expand(b, hkv * groups, q, length) if attention_mask.shape[1] != 1 else \
            attention_mask.expand(b, 1, q, length).expand(b, groups, q, length).unsqueeze(1)
        mask = mask.reshape(b, -1, rows, length)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    elif q > 1:
        rows_at = torch.arange(q, device=scores.device).repeat(groups)[:, None]
        scores.masked_fill_(torch.arange(length, device=scores.device) > length - q + rows_at, float("-inf"))

