"""Page bases: what a selector knows about each stored page of a layer without reading it.

A page is ``page_size`` consecutive stored tokens (the paged store's blocks); per page, batch row
and KV head the bases keep the per-channel maximum and minimum of its keys, Quest's bound
(Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"),
side by side in one ``[B, Hkv, pages, 2 * D]`` tensor so that scoring is one matrix product.
They are updated as tokens are appended, one vectorised reduction per append.
"""

from __future__ import annotations

import math

import torch

GROWTH = 1.25  # capacity grows by a quarter, as paged pools do


class PageBases:
    """Per-page key bounds of one layer's stored tokens: ``bounds`` = ``[kmax | kmin]``."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.length = 0
        self._bounds: torch.Tensor | None = None  # [B, Hkv, capacity, 2 * D]

    @property
    def pages(self) -> int:
        return math.ceil(self.length / self.page_size)

    @property
    def bounds(self) -> torch.Tensor:
        """``[B, Hkv, pages, 2 * D]``: each page's per-channel key maximum, then minimum."""
        return self._bounds[:, :, :self.pages]

    @property
    def kmax(self) -> torch.Tensor:
        return self.bounds[..., :self._bounds.shape[-1] // 2]

    @property
    def kmin(self) -> torch.Tensor:
        return self.bounds[..., self._bounds.shape[-1] // 2:]

    @property
    def nbytes(self) -> int:
        return 0 if self._bounds is None else self._bounds.nbytes

    def append(self, keys: torch.Tensor) -> None:
        """Add ``keys [B, Hkv, n, D]`` after the ``length`` tokens already covered."""
        b, h, n, d = keys.shape
        if n == 0:
            return
        ps, first = self.page_size, self.length // self.page_size
        last = (self.length + n - 1) // ps + 1
        self._reserve(last, keys)
        offset = self.length - first * ps
        if n == 1:  # a decode step: widen one page's bounds in place
            page, key = self._bounds[:, :, first], keys[:, :, 0]
            if offset:
                key = torch.cat([torch.maximum(page[..., :d], key), torch.minimum(page[..., d:], key)], -1)
            else:
                key = torch.cat([key, key], -1)
            page.copy_(key)
            self.length += 1
            return
        span = (last - first) * ps
        lo = keys.new_full((b, h, span, d), float("inf"))
        lo[:, :, offset:offset + n] = keys
        hi = lo.clone()
        hi[:, :, :offset] = hi[:, :, offset + n:] = float("-inf")
        shape = (b, h, last - first, ps, d)
        new = torch.cat([hi.view(shape).amax(3), lo.view(shape).amin(3)], -1)
        if offset:  # the first page already holds tokens: combine with its bounds
            old = self._bounds[:, :, first]
            new[:, :, 0, :d] = torch.maximum(new[:, :, 0, :d], old[..., :d])
            new[:, :, 0, d:] = torch.minimum(new[:, :, 0, d:], old[..., d:])
        self._bounds[:, :, first:last] = new
        self.length += n

    def _reserve(self, pages: int, like: torch.Tensor) -> None:
        if self._bounds is not None and self._bounds.shape[2] >= pages:
            return
        b, h, _, d = like.shape
        capacity = max(pages, math.ceil((0 if self._bounds is None else self._bounds.shape[2]) * GROWTH))
        grown = like.new_empty((b, h, capacity, 2 * d))
        if self._bounds is not None:
            grown[:, :, :self.pages] = self.bounds
        self._bounds = grown

    def select_rows(self, rows: torch.Tensor) -> None:
        if self._bounds is not None:
            self._bounds = self._bounds[rows.to(self._bounds.device)]

    def rebuild(self, keys: torch.Tensor | None) -> None:
        """Recompute from all stored ``keys`` (after a crop, a row selection or a compaction)."""
        self.clear()
        if keys is not None:
            self.append(keys)

    def clear(self) -> None:
        self._bounds = None
        self.length = 0
