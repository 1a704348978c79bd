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
``causal_chunk`` is the engine's attention for a prefill chunk that follows stored tokens.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvfactory import kernels

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


STEP = "kvfactory_step"  # the forward keyword that carries a compiled engine step (``CompiledStep``)


class CompiledStep(Protocol):
    """An engine step whose every layer writes and reads in one traceable call
    (``kvfactory.engine.compiled``): passed to the model's forward as ``kvfactory_step=``, it reaches
    each attention call untouched."""

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """Store the layer's new ``key`` / ``value [1, Hkv, T, D]`` and return the attention of
        ``query [1, Hq, T, D]``: ``[1, T, Hq, Dv]``."""


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


def plain_softmax(dropout: float | None, options: dict[str, Any]) -> bool:
    """Whether a layer's attention is a plain scaled softmax, what kvfactory's own reads compute: no
    dropout, no soft-capping (Gemma 2) and no attention sinks (``s_aux``: GPT-OSS)."""
    return not dropout and options.get("softcap") is None and options.get("s_aux") is None


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


def causal_chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """A prefill chunk's attention: ``query [B, Hq, C, D]`` holds the last ``C`` of the ``K`` positions
    of ``key`` / ``value [B, Hkv, K, D]`` (query head ``h`` reading KV head ``h // (Hq / Hkv)``), each
    attending to every position up to its own; returns ``[B, C, Hq, D]``, as transformers' attention
    functions do.

    SDPA's ``is_causal`` aligns the mask to the top left, so a chunk after stored tokens needs an
    explicit mask, under which SDPA computes every masked-out score too. On the CPU this attends
    to the stored tokens (no mask) and to the chunk itself (the causal kernel) apart, and merges the
    two by their log-sum-exps (FlashAttention's merge of a row's blocks, Dao et al. 2022): at 2,048
    queries over 6,144 keys it takes 0.74x the time of the masked call. On CPUs with AVX-512,
    kvfactory's own kernel (``_kernel_chunk``) takes float32 chunks after stored tokens, 1.4 to 1.9x
    as fast as that. A chunk that is the whole sequence keeps SDPA's causal call, the one ``generate``
    makes, so that a prompt prefilled in one chunk is stored bit for bit as the cache alone stores it
    (a quantized cache's rounding would otherwise carry float32's last-bit differences on).
    Elsewhere SDPA takes the lower-right causal bias (``causal_lower_right``), which CUDA's kernels
    apply without a mask."""
    chunk, total = query.shape[2], key.shape[2]
    if chunk < total and (out := _kernel_chunk(query, key, value, scaling)) is not None:
        return out
    if query.device.type == "cpu" and chunk < total:
        return _split_chunk(query, key, value, scaling)
    return _biased_chunk(query, key, value, scaling)


def _kernel_chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
                  ) -> torch.Tensor | None:
    """``causal_chunk`` by kvfactory's C kernel (``kvfactory/kernels/chunk.c``), which computes no
    score above the diagonal; None where it does not apply (not one float32 CPU row, a head size
    not a multiple of 64, no AVX-512 build or no compiler)."""
    tensors = (query, key, value)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.stride(-1) != 1 for t in tensors) \
            or query.shape[0] != 1 or query.shape[-1] % 64 or query.shape[1] % key.shape[1]:
        return None
    lib = kernels.load("chunk")
    if lib is None:
        return None
    _, heads, chunk, dim = query.shape
    out = torch.empty(1, chunk, heads, dim)
    done = lib.chunk_attention(heads, key.shape[1], chunk, key.shape[2], dim,
                               query.data_ptr(), query.stride(1), query.stride(2),
                               key.data_ptr(), key.stride(1), key.stride(2),
                               value.data_ptr(), value.stride(1), value.stride(2),
                               None, key.shape[2], 1, scaling, out.data_ptr(), None)
    return out if done else None


def _biased_chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
                  ) -> torch.Tensor:
    chunk, total = query.shape[2], key.shape[2]
    bias = causal_lower_right(chunk, total) if chunk < total else None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, is_causal=bias is None,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)


def _split_chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
                 ) -> torch.Tensor:
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # SDPA's CPU kernel, with its LSE
    # the kernel reads each row's channels in place, as SDPA hands them over
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    stored = key.shape[2] - query.shape[2]
    past, past_lse = flash(query, key[:, :, :stored], value[:, :, :stored], scale=scaling)[:2]
    own, own_lse = flash(query, key[:, :, stored:], value[:, :, stored:], is_causal=True, scale=scaling)[:2]
    return merge_parts((past, past_lse), (own, own_lse))[0].transpose(1, 2)


def merge_parts(*parts: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the same query rows over disjoint sets of tokens (``[S, Hq, D]`` outputs with their
    ``[S, Hq]`` log-sum-exps, ``-inf`` for a part of no tokens) as attention over their union, as
    FlashAttention merges the blocks of a row (Dao et al. 2022): output (float32 at least) and
    log-sum-exp (one part as it is). Any shapes whose outputs are their log-sum-exps' with a channel
    dimension added."""
    if len(parts) == 1:
        return parts[0]
    lse = functools.reduce(torch.logaddexp, [part_lse for _, part_lse in parts])
    weighted = [part.float() * (part_lse - lse).exp_()[..., None] for part, part_lse in parts]
    return functools.reduce(torch.add, weighted), lse
