"""Sparse decode: a paged layer store whose decode steps read only the pages a selector picks.

``SparseStore`` wraps the config's paged storage and keeps page bases (``pages.py``) as tokens
arrive. For a decode step of a sparse layer it hands kvfactory's attention function a
``SparseRead``: the selector scores the pages from the step's queries, the sink, local and
new-token pages are added, and exact softmax attention runs over the selected pages' K/V,
gathered block by block from the pool (the whole layer is never copied out). Prefills, the first
``dense_layers`` layers and budgets that cover every page read the whole layer, unchanged.
The selected K/V go to transformers' SDPA like any other (``kvfactory.attention.NarrowRead``).

The store also takes part in its attention call (``kvfactory.attention.Observer``): on shadow steps
it computes full attention for the same queries to measure hit rate and recall
(``metrics.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvfactory import attention
from kvfactory.attention import NarrowRead
from kvfactory.selectors.base import Selector
from kvfactory.selectors.metrics import RoutingMetrics
from kvfactory.selectors.pages import PageBases
from kvfactory.selectors.spec import SelectorSpec
from kvfactory.storage.base import LayerStore, MemoryReport
from kvfactory.storage.paged import PagedStore


class SparseStore(LayerStore):
    """One layer's paged K/V in ``inner``, read sparsely at decode as ``spec`` asks."""

    def __init__(self, inner: PagedStore, selector: Selector, spec: SelectorSpec,
                 metrics: RoutingMetrics) -> None:
        self.inner, self.selector, self.spec, self.metrics = inner, selector, spec, metrics
        self.bases = PageBases(inner.page_size)
        self.steps = 0  # decode steps seen by this layer
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None  # the last append's K/V
        self._mask: torch.Tensor | None = None
        self._read: SparseRead | None = None  # this step's selection, for the shadow measurement
        self._last_read: torch.Tensor | None = None  # [B, Hkv, pages]: step each page was last read
        self._always: tuple[tuple, torch.Tensor] | None = None  # always-read pages of the last step
        metrics.register(self)

    def bind(self, layer_idx: int) -> None:
        super().bind(layer_idx)
        self.inner.bind(layer_idx)

    def attach(self, pool: object) -> None:
        self.inner.attach(pool)

    def __getattr__(self, name: str) -> Any:  # what the inner store adds (page_size, pool, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- storage, delegated; bases follow ---------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.inner.append(key, value)
        self.bases.append(key)
        self._new = (key, value)

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.gather()

    def size(self) -> int:
        return self.inner.size()

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    def clear(self) -> None:
        self.inner.clear()
        self.bases.clear()
        self._new, self._last_read = None, None

    def _rebuild(self) -> None:
        self.bases.rebuild(self.inner.gather()[0] if self.inner.size() else None)
        self._last_read = None

    def keep(self, index: torch.Tensor) -> None:
        self.inner.keep(index)
        self._rebuild()

    def drop_front(self, n: int) -> None:
        self.inner.drop_front(n)
        self._rebuild()

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)
        self._rebuild()

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)
        self.bases.select_rows(rows)
        self._last_read = None

    def block_requests(self, new_tokens: int, batch: int, key: torch.Tensor,
                       value: torch.Tensor) -> list:
        return self.inner.block_requests(new_tokens, batch, key, value)

    def memory_report(self) -> MemoryReport:
        """The pages plus the page bases (held for the selector)."""
        report = self.inner.memory_report()
        held = self.bases.nbytes
        return MemoryReport(report.allocated + held, report.used + held, report.tokens)

    # -- reads ------------------------------------------------------------------------------
    def _token_bytes(self) -> int:
        """K/V bytes of one stored token in every KV head."""
        return self.inner._table.pool.block_bytes // self.inner.page_size

    def deferred_read(self) -> SparseRead | None:
        """A sparse read for a decode step of a sparse layer; None (read whole) otherwise."""
        self._read = None
        new = 0 if self._new is None else self._new[0].shape[2]
        if not new or new > attention.MAX_CHUNKED_QUERY:
            return None  # a prefill: read whole, not a decode step
        self.steps += 1
        pages = self.bases.pages
        wanted = self.spec.pages_to_read(pages)
        full_bytes = self.batch_size * self.size() * self._token_bytes()
        sparse = self.layer_idx >= self.spec.dense_layers and wanted < pages and not self.selector.reads_all \
            and self.inner._table.start == 0
        if not sparse:
            self.metrics.record_read(self.steps, full_bytes, full_bytes, 0.0)
            return None
        self._read = SparseRead(self, wanted)
        return self._read

    def always_read(self, lo: int, hi: int, pages: int, device: torch.device) -> torch.Tensor:
        """Pages ``[0, lo)`` and ``[hi, pages)``, kept from the last step while they are the same."""
        key = (lo, hi, pages, device)
        if self._always is None or self._always[0] != key:
            self._always = key, torch.cat([torch.arange(lo), torch.arange(hi, pages)]).to(device)
        return self._always[1]

    def page_utilisation(self, steps: int) -> float:
        """Fraction of stored pages read in the last ``steps`` decode steps (NaN if never sparse)."""
        if self._last_read is None:
            return float("nan")
        last = self._last_read[:, :, :self.bases.pages]
        return float((last > self.steps - steps).float().mean())

    def _mark_read(self, pages: torch.Tensor) -> None:
        b, h, total = *pages.shape[:2], self.bases.pages
        if self._last_read is None or self._last_read.shape[2] < total:
            grown = torch.zeros((b, h, max(total, 2 * (0 if self._last_read is None else
                                                       self._last_read.shape[2]))), dtype=torch.long)
            if self._last_read is not None:
                grown[:, :, :self._last_read.shape[2]] = self._last_read
            self._last_read = grown
        self._last_read.scatter_(2, pages.cpu(), self.steps)

    # -- Observer: shadow full attention on sampled steps -------------------------------------
    def attention_mask(self, mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
        self._mask = mask
        return mask

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        read, self._read = self._read, None
        every = self.spec.shadow_every
        if read is None or read.pages is None or not every or self.steps % every:
            return
        b, hq, q, d = query.shape
        keys = self.inner.gather()[0]
        hkv, length = keys.shape[1], keys.shape[2]
        with torch.no_grad():
            scores = query.reshape(b, hkv, -1, d) @ keys.transpose(-1, -2) * scaling
            attention.mask_scores(scores, self._mask, q, length)
            probs = scores.float().softmax(-1).mean(2)  # [B, Hkv, length]: mean over the group's queries
            ps, pages = self.inner.page_size, self.bases.pages
            mass = probs.new_zeros((b, hkv, pages * ps))
            mass[:, :, :length] = probs
            self.metrics.record_shadow(read.pages, mass.view(b, hkv, pages, ps).sum(-1))


class SparseRead(NarrowRead):
    """One decode step's read of the pages chosen for its query (chosen in ``narrow``)."""

    def __init__(self, store: SparseStore, wanted: int) -> None:
        self.store, self.wanted = store, wanted
        self.pages: torch.Tensor | None = None  # [B, Hkv, k] selected pages (the last page last)

    @property
    def length(self) -> int:
        return self.store.size()

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store._new

    def select(self, queries: torch.Tensor) -> torch.Tensor:
        """The pages to read ``[B, Hkv, k]`` for ``queries [B, Hkv, R, D]``: the sink pages, the
        selector's best of the pages between, then the local and new-token pages (the last page last)."""
        store, spec = self.store, self.store.spec
        pages, ps = store.bases.pages, store.inner.page_size
        first_new = (self.length - store._new[0].shape[2]) // ps
        lo = min(spec.sink_pages, pages)
        hi = max(lo, min(first_new, pages - spec.local_pages))
        b, h = queries.shape[:2]
        always = store.always_read(lo, hi, pages, queries.device).expand(b, h, -1)
        chosen = min(self.wanted - always.shape[-1], hi - lo)
        if chosen <= 0:
            return always
        scores = store.selector.page_scores(queries, store.bases)[..., lo:hi]
        best = scores.topk(chosen, dim=-1, sorted=False).indices + lo
        return torch.cat([always[..., :lo], best, always[..., lo:]], -1)

    def narrow(self, query: torch.Tensor, attention_mask: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        store, length = self.store, self.length
        table, ps = store.inner._table, store.inner.page_size
        block_pool = table.pool
        b, hq, q, d = query.shape
        hkv = block_pool.k.shape[0]
        started = time.perf_counter()
        self.pages = self.select(query.reshape(b, hkv, -1, d))
        seconds = time.perf_counter() - started
        k = self.pages.shape[-1]
        device = block_pool.k.device
        blocks = table.ids.gather(1, self.pages.flatten(1).cpu()).view(b, hkv, k).to(device)
        rows = (blocks + torch.arange(hkv, device=device)[None, :, None] * block_pool.num_blocks).flatten()
        n = k * ps - (store.bases.pages * ps - length)  # the last page, read last, may not be full
        keys, values = (  # [B, Hkv, n, D]: one row copy per selected block
            t.flatten(0, 1).index_select(0, rows).view(b, hkv, k * ps, t.shape[-1])[:, :, :n]
            for t in (block_pool.k, block_pool.v))
        mask = attention_mask
        if mask is not None or q > 1:  # the mask's columns of the tokens read, per KV head's pages
            columns = (self.pages[..., None] * ps + torch.arange(ps, device=device)).flatten(2)[:, :, :n]
            columns = columns.repeat_interleave(hq // hkv, dim=1)[:, :, None, :]  # [B, Hq, 1, n]
            if mask is None:  # causal: query i sees stored positions up to length - q + i
                mask = columns <= length - q + torch.arange(q, device=device)[:, None]
            else:
                mask = mask.expand(b, hq, q, mask.shape[-1]).gather(-1, columns.expand(b, hq, q, n))
        bases_bytes = store.bases.bounds.nbytes if store.selector.reads_bases else 0
        token_bytes = store._token_bytes()
        store.metrics.record_read(store.steps, b * n * token_bytes + bases_bytes, b * length * token_bytes,
                                  seconds)
        store._mark_read(self.pages)
        return keys, values, mask
