"""Page summaries: what a selector knows about each stored page of a layer without reading it.

A page is ``page_size`` consecutive stored tokens (the paged store's blocks); per page, batch row
and KV head the summaries keep the per-channel maximum and minimum of its keys, Quest's bound
(Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"),
and, for selectors that embed pages (OVAL's prefetch router), the mean key; side by side in one
``[B, Hkv, pages, 2 or 3 * D]`` tensor so that scoring is one pass over them. They are updated as
tokens are appended, one vectorised reduction per append. A selector that scores every token from
a small code of its key (OVAL's query scorer) has the codes kept here instead (``set_token_codes``);
one that embeds pages (OVAL's block gate and prefetch router) has each page's embedding kept, and the
features of the open (last, partly filled) page only (``set_embedding``).

Every decode step reads each sparse layer's summaries whole, so they are stored in float16 by default
(half the bytes of float32 keys): maxima rounded up and minima rounded down, so Quest's bound stays
a bound, means to nearest. On the CPU the scores and the top pages come from C kernels
(``kvfactory/kernels/pages.c``) that read float16 directly; elsewhere from torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvfactory import kernels

GROWTH = 1.25  # capacity grows by a quarter, as paged pools do


def _pages_library(t: torch.Tensor) -> object | None:
    return kernels.load("pages") if t.device.type == "cpu" else None


def split_rows(queries: torch.Tensor) -> torch.Tensor:
    """``[..., 2D]`` rows ``[max(q, 0) | min(q, 0)]`` whose dot with a page's ``[max | min]`` is Quest's
    bound ``q · c + |q| · h`` (``c`` the centre and ``h`` the half-width of each channel's range)."""
    return torch.cat([queries.clamp(min=0), queries.clamp(max=0)], -1)


def best_dot(rows: torch.Tensor, features: torch.Tensor, bound: bool = False) -> torch.Tensor:
    """``max_r rows[..., r, :] · features[..., p, :]`` in float32: ``rows [B, H, R, F]`` against
    ``features [B, H, P, F]`` (float32 or float16, a view of the summaries) gives ``[B, H, P]``. With
    ``bound``, ``rows [B, H, R, F / 2]`` are queries taken as ``split_rows(rows)`` (in the kernel)."""
    lib = _pages_library(features)
    if lib is None or features.stride(-1) != 1 or features.dtype not in FEATURE_DTYPES:
        if bound:
            rows = split_rows(rows.float())
        return (rows.float() @ features.float().transpose(-1, -2)).amax(2)
    b, h, r = rows.shape[:3]
    p, f = features.shape[2:]
    rows = rows.float().contiguous()
    out = torch.empty((b, h, p), dtype=torch.float32)
    fs = features.stride()
    if lib.page_scores(b, h, r, f, p, rows.data_ptr(), features.data_ptr(), kernels.KINDS[features.dtype],
                       *fs[:3], int(bound), out.data_ptr()):
        raise MemoryError(f"page_scores: no memory for {r} query rows")
    return out


def top_pages(scores: torch.Tensor, lo: int, hi: int, k: int) -> torch.Tensor:
    """Indices of the ``k`` best pages in ``[lo, hi)`` of ``scores [B, H, P]``: ``[B, H, k]``, unordered."""
    lib = _pages_library(scores)
    if lib is None or scores.dtype != torch.float32:
        return scores[..., lo:hi].topk(k, dim=-1, sorted=False).indices + lo
    b, h, p = scores.shape
    scores = scores.contiguous()
    out = torch.empty(b, h, k, dtype=torch.long)
    if lib.top_pages(b * h, p, scores.data_ptr(), lo, hi, k, out.data_ptr()):
        raise MemoryError(f"top_pages: no memory to rank {hi - lo} pages")
    return out


FEATURE_DTYPES = (torch.float32, torch.float16)  # what pages.c reads
INF = float("inf")


class PageSummaries:
    """Per-page key statistics of one layer's stored tokens: ``[kmax | kmin]`` (+ ``| kmean``), stored
    in ``dtype`` (None: the keys' own); with an embedding, the open page's only."""

    def __init__(self, page_size: int, with_mean: bool = False, dtype: torch.dtype | None = torch.float16
                 ) -> None:
        self.page_size, self.with_mean, self.dtype = page_size, with_mean, dtype
        self.length = 0
        self.embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # see ``set_embedding``
        self._embedded: torch.Tensor | None = None  # [B, Hkv, capacity, E]
        self._summaries: torch.Tensor | None = None  # [B, Hkv, capacity (1 with an embedding), (2 or 3) * D]
        self.encode: Callable[[torch.Tensor], torch.Tensor] | None = None  # see ``set_token_codes``
        self._codes: torch.Tensor | None = None  # [B, Hkv, C, capacity in tokens]: channel-major

    @property
    def pages(self) -> int:
        return math.ceil(self.length / self.page_size)

    @property
    def features(self) -> torch.Tensor:
        """``[B, Hkv, pages, (2 or 3) * D]``: per-channel key maximum, minimum (and mean) per page."""
        if self.embed is not None:
            raise ValueError("page summaries with an embedding keep the open page's features only: score "
                             "the pages from `embedded`")
        return self._summaries[:, :, :self.pages]

    @property
    def head_dim(self) -> int:
        return self._summaries.shape[-1] // (3 if self.with_mean else 2)

    @property
    def bounds(self) -> torch.Tensor:
        """``[B, Hkv, pages, 2 * D]``: each page's per-channel key maximum, then minimum."""
        return self.features[..., :2 * self.head_dim]

    @property
    def kmax(self) -> torch.Tensor:
        return self.features[..., :self.head_dim]

    @property
    def kmin(self) -> torch.Tensor:
        return self.features[..., self.head_dim:2 * self.head_dim]

    @property
    def kmean(self) -> torch.Tensor:
        return self.features[..., 2 * self.head_dim:]

    @property
    def embedded(self) -> torch.Tensor:
        """``[B, Hkv, pages, E]``: each page's embedding (``set_embedding``)."""
        return self._embedded[:, :, :self.pages]

    @property
    def codes(self) -> torch.Tensor:
        """``[B, Hkv, C, length]``: each stored token's code (``set_token_codes``), channel by channel, so
        a step scores every token with one contiguous pass per channel."""
        return self._codes[..., :self.length]

    @property
    def scored(self) -> torch.Tensor:
        """What scoring a step reads: the token codes or page embeddings where kept, else the features."""
        if self.encode is not None:
            return self.codes
        return self.features if self.embed is None else self.embedded

    @property
    def nbytes(self) -> int:
        return sum(0 if t is None else t.nbytes for t in (self._summaries, self._embedded, self._codes))

    def set_token_codes(self, encode: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Keep ``encode(keys)`` (``[B, Hkv, n, D]`` -> ``[B, Hkv, n, C]``) of every token appended from
        now on (set before the first append), instead of the page bounds: the selector scores from
        the codes alone, so the bounds' bytes and their update at every append are saved."""
        if self.length:
            raise ValueError(f"token codes are set before any token is appended ({self.length} held)")
        self.encode, self._codes = encode, None

    @torch.no_grad()
    def _append_codes(self, keys: torch.Tensor) -> None:
        codes = self.encode(keys).transpose(2, 3)  # [B, Hkv, C, n]
        end = self.length + codes.shape[3]
        if self._codes is None or self._codes.shape[3] < end:
            held = 0 if self._codes is None else self._codes.shape[3]
            grown = codes.new_empty((*codes.shape[:3], max(end, math.ceil(held * GROWTH))))
            if self._codes is not None:
                grown[..., :self.length] = self.codes
            self._codes = grown
        self._codes[..., self.length:end] = codes

    def set_embedding(self, embed: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Keep ``embed(features)`` of every page (OVAL's page embeddings, in the storage dtype) instead
        of the features (set before the first append): a selector that scores ``E`` numbers per page
        reads those, and only the open page's features are held, to update it as tokens arrive."""
        if self.length:
            raise ValueError(f"a page embedding is set before any token is appended ({self.length} held)")
        self.embed, self._embedded, self._summaries = embed, None, None

    def _held(self, page: int) -> torch.Tensor:
        """``[B, Hkv, F]``: the held features of ``page`` (with an embedding, only the open page's)."""
        return self._summaries[:, :, 0 if self.embed is not None else page]

    def _write(self, first: int, last: int, new: torch.Tensor, end: int) -> None:
        """Store the features ``new [B, Hkv, last - first, F]`` of pages ``[first, last)``, which then hold
        ``end`` tokens."""
        stored = self._stored(new)
        if self.embed is None:
            self._summaries[:, :, first:last] = stored
            return
        self._summaries[:, :, 0] = stored[:, :, -1]
        self._embed(first, last, stored, end)

    @torch.no_grad()
    def _embed(self, first: int, last: int, stored: torch.Tensor, end: int) -> None:
        """Embed pages ``[first, last)`` from their ``stored`` features as they fill (those before
        ``first`` are embedded already). A page still filling is embedded only where the embeddings
        grow: a decode step always reads the page of its newest token whole and never ranks it, so its
        slot only has to hold numbers until the page fills."""
        grow = self._embedded is None or self._embedded.shape[2] < last
        full = last if grow else min(last, end // self.page_size)
        if full <= first:
            return
        embedded = self.embed(stored[:, :, :full - first]).to(stored.dtype)
        if grow:
            held = 0 if self._embedded is None else self._embedded.shape[2]
            grown = embedded.new_zeros((*embedded.shape[:2], max(last, math.ceil(held * GROWTH)),
                                        embedded.shape[-1]))
            if self._embedded is not None:
                grown[:, :, :first] = self._embedded[:, :, :first]
            self._embedded = grown
        self._embedded[:, :, first:full] = embedded

    def append(self, keys: torch.Tensor) -> None:
        """Add ``keys [B, Hkv, n, D]`` after the ``length`` tokens already covered."""
        b, h, n, d = keys.shape
        if n == 0:
            return
        if self.encode is not None:  # a selector that scores tokens from their codes reads no bounds
            self._append_codes(keys)
            self.length += n
            return
        ps, first = self.page_size, self.length // self.page_size
        last = (self.length + n - 1) // ps + 1
        self._reserve(last, keys)
        offset = self.length - first * ps
        if n == 1:  # a decode step: widen one page's bounds in place
            self._add_one(keys[:, :, 0], first, offset, d)
            return
        span = (last - first) * ps
        lo = keys.new_full((b, h, span, d), float("inf"))
        lo[:, :, offset:offset + n] = keys
        hi = lo.clone()
        hi[:, :, :offset] = hi[:, :, offset + n:] = float("-inf")
        shape = (b, h, last - first, ps, d)
        parts = [hi.view(shape).amax(3), lo.view(shape).amin(3)]
        if self.with_mean:
            total = lo.masked_fill(lo == float("inf"), 0).view(shape).sum(3)
            starts = torch.arange(first, last, device=keys.device) * ps
            filled = (self.length + n - starts).clamp_(max=ps)  # tokens each page holds after the append
            if offset:
                total[:, :, 0] += self._held(first)[..., 2 * d:] * offset
            parts.append(total / filled[:, None].to(total.dtype))
        new = torch.cat(parts, -1)
        if offset:  # the first page already holds tokens: combine with its bounds
            old = self._held(first)
            new[:, :, 0, :d] = torch.maximum(new[:, :, 0, :d], old[..., :d])
            new[:, :, 0, d:2 * d] = torch.minimum(new[:, :, 0, d:2 * d], old[..., d:2 * d])
        self._write(first, last, new, self.length + n)
        self.length += n

    def _add_one(self, key: torch.Tensor, page: int, offset: int, d: int) -> None:
        slot = self._held(page)
        if offset:
            parts = [torch.maximum(slot[..., :d], key), torch.minimum(slot[..., d:2 * d], key)]
            if self.with_mean:
                parts.append((slot[..., 2 * d:] * offset + key) / (offset + 1))
        else:
            parts = [key] * (3 if self.with_mean else 2)
        self._write(page, page + 1, torch.cat(parts, -1)[:, :, None], self.length + 1)
        self.length += 1

    def _stored(self, new: torch.Tensor) -> torch.Tensor:
        """Features ``new [..., (2 or 3) * D]`` in the storage dtype: maxima rounded up and minima down
        (negated, so one upward rounding does both), means to nearest."""
        if self.dtype is None or new.dtype == self.dtype:
            return new
        d = new.shape[-1] // (3 if self.with_mean else 2)
        bounds = torch.cat([new[..., :d], -new[..., d:2 * d]], -1)
        low = bounds.to(self.dtype)
        up = torch.where(low.to(bounds.dtype) < bounds, low.nextafter(low.new_full((), INF)), low)
        up[..., d:].neg_()
        return torch.cat([up, new[..., 2 * d:].to(self.dtype)], -1) if self.with_mean else up

    def _reserve(self, pages: int, like: torch.Tensor) -> None:
        if self.embed is not None:  # the open page's features only
            pages = 1
        if self._summaries is not None and self._summaries.shape[2] >= pages:
            return
        b, h, _, d = like.shape
        held = 0 if self._summaries is None else self._summaries.shape[2]
        capacity = max(pages, math.ceil(held * GROWTH))
        width = (3 if self.with_mean else 2) * d
        grown = like.new_empty((b, h, capacity, width), dtype=self.dtype or like.dtype)
        if self._summaries is not None:
            grown[:, :, :self.pages] = self._summaries[:, :, :self.pages]
        self._summaries = grown

    def select_rows(self, rows: torch.Tensor) -> None:
        if self._summaries is not None:
            self._summaries = self._summaries[rows.to(self._summaries.device)]
        if self._embedded is not None:
            self._embedded = self._embedded[rows.to(self._embedded.device)]
        if self._codes is not None:
            self._codes = self._codes[rows.to(self._codes.device)]

    def rebuild(self, keys: torch.Tensor | None) -> None:
        """Recompute from all stored ``keys`` (after a crop, a row selection or a compaction)."""
        self.clear()
        if keys is not None:
            self.append(keys)

    def clear(self) -> None:
        self._summaries = self._embedded = self._codes = None
        self.length = 0
