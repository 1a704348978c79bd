"""Sparse decode: a paged layer store whose decode steps read only the pages a selector picks.

``SparseStore`` wraps the config's paged storage and keeps page bases (``pages.py``) as tokens
arrive. For a decode step of a sparse layer it hands kvfactory's attention function a
``SparseRead``: the selector scores the pages from the step's queries, the sink, local and
new-token pages are added, and exact softmax attention runs over the selected pages' K/V,
gathered block by block from the pool (the whole layer is never copied out). Prefills, the first
``dense_layers`` layers and budgets that cover every page read the whole layer, unchanged.

The store also takes part in its attention call (``kvfactory.attention.Observer``): on shadow steps
it computes full attention for the same queries to measure hit rate and recall
(``metrics.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvfactory import attention
from kvfactory.attention import DeferredRead
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


class SparseRead(DeferredRead):
    """One decode step's read of the pages chosen for its queries (chosen when ``scores`` is called)."""

    def __init__(self, store: SparseStore, wanted: int) -> None:
        self.store, self.wanted = store, wanted
        self.pages: torch.Tensor | None = None  # [B, Hkv, k] selected pages, ascending
        self._values: torch.Tensor | None = None
        self._columns: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.store.size()

    @property
    def kv_heads(self) -> int:
        return self.store.inner._table.pool.k.shape[0]

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store._new

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.inner.gather()

    def columns(self) -> torch.Tensor | None:
        return self._columns

    def select(self, queries: torch.Tensor) -> torch.Tensor:
        """The pages to read ``[B, Hkv, k]`` (ascending) for ``queries [B, Hkv, R, D]``."""
        store, spec = self.store, self.store.spec
        pages, ps = store.bases.pages, store.inner.page_size
        scores = store.selector.page_scores(queries, store.bases).float()
        first_new = (self.length - store._new[0].shape[2]) // ps
        forced = torch.zeros(pages, dtype=torch.bool, device=scores.device)
        forced[:spec.sink_pages] = True
        forced[min(first_new, pages - spec.local_pages):] = True
        scores = scores.masked_fill(forced, float("inf"))
        wanted = max(self.wanted, int(forced.sum()))
        return scores.topk(min(wanted, pages), dim=-1, sorted=False).indices.sort(-1).values

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        store = self.store
        started = time.perf_counter()
        self.pages = self.select(query)
        seconds = time.perf_counter() - started
        table, ps = store.inner._table, store.inner.page_size
        block_pool = table.pool
        b, hkv, k = self.pages.shape
        device = block_pool.k.device
        blocks = table.ids.gather(1, self.pages.flatten(1).cpu()).view(b, hkv, k).to(device)
        rows = (blocks + torch.arange(hkv, device=device)[None, :, None] * block_pool.num_blocks).flatten()
        keys, self._values = (  # [B, Hkv, k * ps, D]: one row copy per selected block
            t.flatten(0, 1).index_select(0, rows).view(b, hkv, k * ps, t.shape[-1])
            for t in (block_pool.k, block_pool.v))
        columns = (self.pages[..., None] * ps + torch.arange(ps, device=self.pages.device)).flatten(2)
        self._columns = columns.clamp(max=self.length - 1)
        scores = query @ keys.transpose(-1, -2)
        unfilled = store.bases.pages * ps - self.length
        if unfilled:  # the last page (read by all, sorted last) is not full: its free slots hold garbage
            self._values[:, :, -unfilled:] = 0.0
            scores[..., -unfilled:] = float("-inf")
        bases_bytes = store.bases.bounds.nbytes if store.selector.reads_bases else 0
        token_bytes = store._token_bytes()
        store.metrics.record_read(store.steps, b * k * ps * token_bytes + bases_bytes,
                                  b * self.length * token_bytes, seconds)
        store._mark_read(self.pages)
        return scores

    def weighted_sum(self, probs: torch.Tensor) -> torch.Tensor:
        return probs.to(self._values.dtype) @ self._values
