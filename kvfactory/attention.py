"""Attention over a layer store without materialising its whole K/V: kvfactory's attention math.

With ``attn_implementation="kvfactory"`` (registered by ``kvfactory.cache``, the transformers
adapter), a cache layer whose store can be read in pieces (``DeferredRead``: quantized storage)
returns only its full-precision tail from ``update`` and leaves a pending read for the layer's
attention call. ``attend`` then computes exact softmax attention over the store chunk by chunk:
each chunk of packed tokens is decoded into a small reused buffer that stays in cache, so decode
never writes the whole layer's K/V in floating point. Scores of one step are small (one row per
query head), so a plain two-pass softmax is exact and needs no online rescaling.

Anything the chunked path does not cover (long queries such as prefill, logit soft-capping,
attention sinks, dropout) reads the store whole (``DeferredRead.materialize``) and runs SDPA.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

MAX_CHUNKED_QUERY = 16  # longer queries (prefill) read the store whole: their scores would be large


class DeferredRead(ABC):
    """A layer's K/V, read chunk by chunk by the attention call that follows ``update``."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens stored per row."""

    @abstractmethod
    def key_chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(start, keys [B, Hkv, n, D])`` covering ``[0, length)`` in order; a chunk is valid until
        the next one is asked for."""

    @abstractmethod
    def value_chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """As ``key_chunks``, for the values."""

    @abstractmethod
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns in place of the whole K/V: the full-precision tail (may be empty)."""

    @abstractmethod
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K/V ``[B, Hkv, length, D]``, as a non-deferred read returns it."""


class _Pending(threading.local):
    read: DeferredRead | None = None
    key: torch.Tensor | None = None
    layer_idx: int | None = None


_pending = _Pending()


def defer(read: DeferredRead | None, returned_key: torch.Tensor | None = None,
          layer_idx: int | None = None) -> None:
    """Leave ``read`` of layer ``layer_idx`` for the attention call that receives ``returned_key`` (what
    ``update`` returned); ``defer(None)`` drops what an earlier update left."""
    _pending.read, _pending.key, _pending.layer_idx = read, returned_key, layer_idx


def take(key: torch.Tensor, layer_idx: int | None) -> DeferredRead | None:
    """The read left for ``key`` by layer ``layer_idx``'s update, or None when it returned K/V whole.

    A read left by another layer, or for keys of another length, was left by an update outside this
    forward pass (a cache filled by hand) and is dropped. A read of this layer for other keys of the
    same length means the model changed K/V between ``update`` and attention, which the chunked
    path cannot follow: that is an error, not a silent fallback.
    """
    read, returned, layer = _pending.read, _pending.key, _pending.layer_idx
    defer(None)
    if read is None or returned is key:
        return read
    if layer != layer_idx or key.shape[-2] != returned.shape[-2]:
        return None
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
    total = read.length
    scores = hkv = None
    for start, keys in read.key_chunks():
        if scores is None:
            hkv = keys.shape[1]
            scores = query.new_empty((b, hkv, hq // hkv * q, total))
            grouped = query.reshape(b, hkv, hq // hkv * q, d)
        torch.matmul(grouped, keys.transpose(-1, -2), out=scores[..., start:start + keys.shape[2]])
    scores.mul_(scaling)
    groups = hq // hkv
    if attention_mask is not None:
        mask = attention_mask.expand(b, hq, q, total) if attention_mask.shape[1] != 1 else \
            attention_mask.expand(b, 1, q, total).expand(b, groups, q, total).unsqueeze(1)
        mask = mask.reshape(b, -1, groups * q, total)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    elif q > 1:
        rows = torch.arange(q, device=query.device).repeat(groups)[:, None]
        scores.masked_fill_(torch.arange(total, device=query.device) > total - q + rows, float("-inf"))
    probs = scores.softmax(-1)
    out = None
    for start, values in read.value_chunks():
        part = probs[..., start:start + values.shape[2]] @ values
        out = part if out is None else out.add_(part)
    return out.view(b, hkv, groups, q, -1).reshape(b, hq, q, -1).transpose(1, 2).contiguous()
