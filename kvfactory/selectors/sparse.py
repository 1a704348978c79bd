"""Sparse decode: a paged layer store whose decode steps read only the pages a selector picks.

``SparseStore`` wraps the config's paged storage and keeps page bases (``pages.py``) as tokens
arrive. For a decode step of a sparse layer it hands kvfactory's attention function a
``SparseRead``: the selector scores the pages from the step's queries, the sink, local and
new-token pages are added, and exact softmax attention runs over the selected pages' K/V,
gathered block by block from the pool (the whole layer is never copied out). Prefills, the first
``dense_layers`` layers and budgets that cover every page read the whole layer, unchanged.
The selected K/V go to transformers' SDPA like any other (``kvfactory.attention.NarrowRead``).

With ``dynamic_pages`` the pages are the token ranges of a ``PageLayout`` (``layout.py``), shared by
the cache's layers and cut at prefill by the first sparse layer from its attention entropy; a
``DynamicRead`` then reads the best pages up to a token budget, token by token from the pool.

The store also takes part in its attention call (``kvfactory.attention.Observer``): on shadow steps
it computes full attention for the same queries to measure hit rate and recall
(``metrics.py``).
"""

from __future__ import annotations

import time

import torch

from kvfactory import attention
from kvfactory.attention import DeferredRead, NarrowRead
from kvfactory.quantization.store import QuantizedStore
from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.layout import OVERLAP, PageLayout, attention_entropy
from kvfactory.selectors.metrics import RoutingMetrics
from kvfactory.selectors.pages import DynamicPageBases, PageBases, top_pages
from kvfactory.selectors.spec import SelectorSpec
from kvfactory.storage.base import MemoryReport, WrappedStore
from kvfactory.storage.paged import PagedStore


class SparseStore(WrappedStore):
    """One layer's paged K/V in ``inner`` (plain or quantized pages), read sparsely at decode as
    ``spec`` asks; ``inner`` serves whole pages (``pageable``, ``read_pages``, ``read_bytes``)."""

    observes_attention = True  # shadow steps measure full attention for the same queries

    def __init__(self, inner: PagedStore | QuantizedStore, selector: Selector, spec: SelectorSpec,
                 metrics: RoutingMetrics, context: RoutingContext, num_layers: int) -> None:
        self.inner, self.selector, self.spec, self.metrics = inner, selector, spec, metrics
        self.context, self.num_layers = context, num_layers
        paged = inner if isinstance(inner, PagedStore) else inner.inner
        self.page_size = paged.page_size
        self.layout: PageLayout | None = None
        if spec.dynamic_pages:
            self.layout = context.shared.setdefault(
                "pages.layout", PageLayout(self.page_size, spec.max_page, spec.entropy_jump))
            self.bases = DynamicPageBases(self.layout, selector.uses_mean, spec.bases_torch_dtype)
        else:
            self.bases = PageBases(self.page_size, selector.uses_mean, spec.bases_torch_dtype)
        self.steps = 0  # decode steps seen by this layer
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None  # the last append's K/V (decode steps)
        self._heads = 0  # KV heads stored
        self._mask: torch.Tensor | None = None
        self._read: PageRead | None = None  # this step's selection, for the shadow measurement
        self._last_read: torch.Tensor | None = None  # [B, Hkv, pages]: step each page was last read
        self._always: tuple[tuple, torch.Tensor] | None = None  # the sink pages of the last step
        self._salient: torch.Tensor | None = None  # [B, Hkv, pages]: the prompt's last queries' mass
        self.prompt_weight = spec.prompt_mix
        self._prompt_term: tuple[torch.Tensor, int, int, torch.Tensor] | None = None  # of _salient, lo, hi
        metrics.register(self)

    def bind(self, layer_idx: int) -> None:
        super().bind(layer_idx)
        self.selector.bind(layer_idx, self.num_layers)
        if self.routed:
            self.bases.set_embedding(self.selector.page_embedding())

    # -- storage, delegated; bases follow ---------------------------------------------------
    @property
    def routed(self) -> bool:
        """Whether decode may read this layer sparsely (else it keeps no page bases)."""
        return self.layer_idx >= self.spec.dense_layers and not self.selector.reads_all

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.inner.append(key, value)
        self._heads = key.shape[1]
        if self.routed and self.layout is None:  # dynamic pages: once the prefill is cut (sync_bases)
            self.bases.append(key)
        # a prompt's K/V is not kept: only a decode step's tail is handed back to attention
        self._new = (key, value) if key.shape[2] <= attention.MAX_CHUNKED_QUERY else None

    def clear(self) -> None:
        self.inner.clear()
        self.bases.clear()
        if self.layout is not None:
            self.layout.clear()
        self._new, self._last_read, self._salient = None, None, None

    def _rebuild(self) -> None:
        if self.layout is not None:  # dynamic pages: rebuilt from the layout at the next decode step
            self.layout.truncate(self.size())
            self.bases.clear()
        else:
            self.bases.rebuild(self.inner.gather()[0] if self.inner.size() and self.routed else None)
        self._last_read = self._salient = None

    def sync_bases(self) -> None:
        """Dynamic pages: bring the bases up to the stored tokens (the step's own, or all after a prefill)."""
        size, covered = self.size(), self.bases.length
        if covered == size:
            return
        if self._new is not None and covered == size - self._new[0].shape[2]:
            self.bases.append(self._new[0])
        else:
            self.bases.rebuild(self.inner.gather()[0])

    def page_index(self, length: int, device: torch.device) -> torch.Tensor:
        """The page of each of the first ``length`` stored tokens ``[length]``."""
        if self.layout is not None:
            return self.layout.page_of(0, length).to(device)
        return torch.arange(length, device=device) // self.page_size

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
        if self._salient is not None:
            self._salient = self._salient[rows.to(self._salient.device)]

    def memory_report(self) -> MemoryReport:
        """The pages plus the page bases (held for the selector)."""
        report = self.inner.memory_report()
        held = self.bases.nbytes
        return MemoryReport(report.allocated + held, report.used + held, report.tokens)

    # -- reads ------------------------------------------------------------------------------
    def full_bytes(self) -> int:
        """Bytes a decode step reading everything reads (all rows)."""
        pageable = self.inner.pageable()
        return self.batch_size * self.inner.read_bytes(pageable, self.size() - pageable)

    def deferred_read(self) -> DeferredRead | PageRead | None:
        """A sparse read for a decode step of a sparse layer; otherwise what the inner store reads
        (quantized pages: chunked attention; plain pages: None, read whole)."""
        self._read = None
        if self._new is None:
            return self.inner.deferred_read()  # a prefill: not a decode step
        self.steps += 1
        if self.layout is not None and self.routed:
            self.sync_bases()
            wanted = self.spec.tokens_to_read(self.size())
            if wanted < self.size() and self.bases.pages > self.spec.sink_pages + self.spec.local_pages:
                self._read = DynamicRead(self, wanted)
                return self._read
        pages = -(-self.size() // self.page_size)
        wanted = self.spec.pages_to_read(pages)
        selectable = min(self.inner.pageable() // self.page_size, pages - self.spec.local_pages)
        sparse = self.routed and self.layout is None and wanted < pages and selectable > self.spec.sink_pages
        if not sparse:
            full = self.full_bytes()
            self.metrics.record_read(self.steps, full, full, 0.0)
            return self.inner.deferred_read()
        self._read = SparseRead(self, wanted)
        return self._read

    def always_read(self, lo: int, device: torch.device) -> torch.Tensor:
        """The sink pages ``[0, lo)``, kept from the last step while they are the same."""
        if self._always is None or self._always[0] != (lo, device):
            self._always = (lo, device), torch.arange(lo, device=device)
        return self._always[1]

    def page_utilisation(self, steps: int) -> float:
        """Fraction of stored pages read in the last ``steps`` decode steps (NaN if never sparse)."""
        if self._last_read is None:
            return float("nan")
        last = self._last_read[:, :, :self.bases.pages]
        return float((last > self.steps - steps).float().mean())

    def _mark_read(self, read: torch.Tensor) -> None:
        """``read [B, Hkv, pages]``: the pages this step read."""
        b, h, total = read.shape
        if self._last_read is None or self._last_read.shape[2] < total:
            grown = torch.zeros((b, h, max(total, 2 * (0 if self._last_read is None else
                                                       self._last_read.shape[2]))), dtype=torch.long)
            if self._last_read is not None:
                grown[:, :, :self._last_read.shape[2]] = self._last_read
            self._last_read = grown
        self._last_read[:, :, :total].masked_fill_(read.cpu(), self.steps)

    # -- Observer: shadow full attention on sampled steps -------------------------------------
    def attention_mask(self, mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
        self._mask = mask
        return mask

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        read, self._read = self._read, None
        if read is None and self.layout is not None and query.shape[2] > attention.MAX_CHUNKED_QUERY \
                and self.routed and self.layer_idx == self.spec.dense_layers:
            self._cut_pages(query, scaling)  # a prefill: the first sparse layer sizes the pages
        if read is None and self.prompt_weight and query.shape[2] > attention.MAX_CHUNKED_QUERY \
                and self.routed:
            self._salient = self._prompt_mass(query, scaling)
        every = self.spec.shadow_every
        if read is None or read.read is None or not every or self.steps % every:
            return
        self.metrics.record_shadow(read.read, self._page_mass(query, self._mask, scaling))

    @torch.no_grad()
    def _page_mass(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """``[B, Hkv, pages]``: the full attention mass ``query [B, Hq, q, D]`` (the last ``q`` of the
        stored tokens, ``mask`` SDPA's) puts on each stored page, mean over its rows and the KV
        head's query heads."""
        b, _, q, d = query.shape
        keys = self.inner.gather()[0]
        hkv, length = keys.shape[1], keys.shape[2]
        scores = query.reshape(b, hkv, -1, d) @ keys.transpose(-1, -2) * scaling
        attention.mask_scores(scores, mask, q, length)
        probs = scores.float().softmax(-1).mean(2)  # [B, Hkv, length]
        mass = probs.new_zeros((b, hkv, self.bases.pages))
        return mass.index_add_(2, self.page_index(length, probs.device), probs)

    def _prompt_mass(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The page mass of the prefill's last ``prompt_window`` queries."""
        window = min(self.spec.prompt_window, query.shape[2])
        mask = None if self._mask is None else self._mask[..., -window:, :]
        return self._page_mass(query[:, :, -window:], mask, scaling)

    def with_prompt_mass(self, scores: torch.Tensor, head_dim: int, lo: int, hi: int) -> torch.Tensor:
        """The pages ``[lo, hi)`` of the selector's ``scores [B, Hkv, pages]`` ranked by its shares
        plus ``SelectorSpec.prompt_weight`` times the prompt's last queries' shares (pages stored
        since the prefill have none), per KV head (``Selector.with_prompt``): ``[B, Hkv, hi - lo]``."""
        scores = scores[..., lo:hi]
        if self._salient is None:
            return scores
        cached = self._prompt_term  # the same until the pages [lo, hi) or the prompt change
        if cached is None or cached[0] is not self._salient or cached[1:3] != (lo, hi):
            salient = self._salient[..., lo:hi].to(scores.device)
            total = salient.sum(-1, keepdim=True).clamp_min(torch.finfo(salient.dtype).tiny)
            term = scores.new_zeros(scores.shape, dtype=torch.float32)
            term[..., :salient.shape[2]] = salient.mul(self.prompt_weight).div_(total)
            cached = self._prompt_term = self._salient, lo, hi, term
        return self.selector.with_prompt(scores, cached[3], head_dim)

    @torch.no_grad()
    def _cut_pages(self, query: torch.Tensor, scaling: float) -> None:
        """Cut the prefill's ``query.shape[2]`` new tokens into pages by their attention entropy."""
        size = self.size()
        self.layout.cover(size - query.shape[2])  # tokens before the prefill (decoded ones)
        if self.layout.length == size - query.shape[2]:
            b, hkv = query.shape[0], self._heads
            positions = torch.arange(max(0, size - query.shape[2] - OVERLAP), size).expand(b, hkv, -1)
            self.layout.cut(attention_entropy(query, self.inner.read_tokens(positions)[0], scaling))


def column_mask(columns: torch.Tensor, valid: torch.Tensor | None, attention_mask: torch.Tensor | None,
                query: torch.Tensor, length: int) -> torch.Tensor | None:
    """The mask for attending to the stored tokens ``columns [B, Hkv, n]`` (``valid``: which of them
    count) with ``query [B, Hq, q, D]``: ``attention_mask``'s columns of them, else causal; broadcastable
    to ``[B, Hq, q, n]``; None where every token read is visible to every query."""
    b, hq, q, _ = query.shape
    if attention_mask is None and q == 1 and valid is None:
        return None
    hkv, device = columns.shape[1], query.device
    columns = columns.to(device).repeat_interleave(hq // hkv, dim=1)[:, :, None, :]  # [B, Hq, 1, n]
    if attention_mask is None:  # causal: query i sees stored positions up to length - q + i
        mask = columns <= length - q + torch.arange(q, device=device)[:, None]
    else:
        mask = attention_mask.expand(b, hq, q, attention_mask.shape[-1]).gather(
            -1, columns.expand(b, hq, q, -1))
    if valid is not None:
        valid = valid.to(device).repeat_interleave(hq // hkv, dim=1)[:, :, None, :]
        mask = mask & valid if mask.dtype == torch.bool else mask.masked_fill(~valid, float("-inf"))
    return mask


class PageRead(NarrowRead):
    """One decode step's read of the pages chosen for its query (chosen in ``narrow``), ``wanted``
    pages (fixed pages) or tokens (dynamic pages) in all."""

    def __init__(self, store: SparseStore, wanted: int) -> None:
        self.store, self.wanted = store, wanted
        self.read: torch.Tensor | None = None  # [B, Hkv, pages]: every page read (set by ``narrow``)

    @property
    def length(self) -> int:
        return self.store.size()

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store._new


class SparseRead(PageRead):
    """A decode step's read over the storage's fixed pages, gathered block by block."""

    def __init__(self, store: SparseStore, wanted: int) -> None:
        super().__init__(store, wanted)
        self.pages: torch.Tensor | None = None  # [B, Hkv, k] in the order read (the tail's last)

    def select(self, queries: torch.Tensor) -> tuple[torch.Tensor, int]:
        """For ``queries [B, Hkv, R, D]``: the sink pages and the selector's best of the pages after
        them ``[B, Hkv, k]``, and the first page of the tail read whole (the local pages, the
        step's new tokens and what the inner store cannot serve as pages, e.g. a full-precision window)."""
        store, spec = self.store, self.store.spec
        pages, ps = store.bases.pages, store.page_size
        first_new = (self.length - store._new[0].shape[2]) // ps
        lo = min(spec.sink_pages, pages)
        hi = max(lo, min(first_new, pages - spec.local_pages, store.inner.pageable() // ps))
        b, h = queries.shape[:2]
        sink = store.always_read(lo, queries.device).expand(b, h, -1)
        chosen = min(self.wanted - lo - (pages - hi), hi - lo)
        if chosen <= 0:
            return sink, hi
        scores = store.selector.page_scores(queries, store.bases, store.context)
        if store.prompt_weight:
            mixed = store.with_prompt_mass(scores, queries.shape[-1], lo, hi).contiguous()
            best = top_pages(mixed, 0, hi - lo, chosen) + lo
        else:
            best = top_pages(scores, lo, hi, chosen)
        return torch.cat([sink, best], -1), hi

    def narrow(self, query: torch.Tensor, attention_mask: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        store, length, ps = self.store, self.length, self.store.page_size
        b, hq, q, d = query.shape
        hkv = store._new[0].shape[1]
        started = time.perf_counter()
        chosen, tail = self.select(query.reshape(b, hkv, -1, d))
        seconds = time.perf_counter() - started
        keys, values = store.inner.read_pages(chosen, tail)  # [B, Hkv, n, D]
        at, k = chosen.device, chosen.shape[-1]
        columns = torch.cat([(chosen[..., None] * ps + torch.arange(ps, device=at)).flatten(2),
                             torch.arange(tail * ps, length, device=at).expand(b, hkv, -1)], -1)
        mask = column_mask(columns, None, attention_mask, query, length)
        pages = store.bases.pages
        self.pages = torch.cat([chosen, torch.arange(tail, pages, device=at).expand(b, hkv, -1)], -1)
        self.read = torch.zeros((b, hkv, pages), dtype=torch.bool, device=at).scatter_(2, self.pages, True)
        bases_bytes = store.bases.scored.nbytes if store.selector.reads_bases else 0
        read = b * store.inner.read_bytes(k * ps, length - tail * ps) + bases_bytes
        store.metrics.record_read(store.steps, read, store.full_bytes(), seconds, bases_bytes)
        store._mark_read(self.read)
        store.selector.selected(self.pages, store.context)
        return keys, values, mask


class DynamicRead(PageRead):
    """A decode step's read over dynamic pages (``layout.py``): the sink pages, the local pages and
    the step's new tokens, and the selector's best middle pages, best first, while their tokens fit
    the budget ``wanted`` (tokens). Heads read different numbers of tokens: the shorter reads are
    padded and masked."""

    def narrow(self, query: torch.Tensor, attention_mask: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        store, spec, length = self.store, self.store.spec, self.length
        layout, pages = store.layout, store.bases.pages
        b, hq, q, d = query.shape
        hkv = store._new[0].shape[1]
        started = time.perf_counter()
        starts = layout.starts[:pages]
        first_new = int(layout.page_of(length - store._new[0].shape[2], length - store._new[0].shape[2] + 1))
        lo = min(spec.sink_pages, pages)
        hi = max(lo, min(first_new, pages - spec.local_pages))
        sink_end = int(starts[lo]) if lo < pages else length
        tail = int(starts[hi]) if hi < pages else length
        read = torch.zeros((b, hkv, pages), dtype=torch.bool)
        read[..., :lo] = read[..., hi:] = True
        budget = self.wanted - sink_end - (length - tail)  # tokens left for the middle pages
        if budget > 0 and hi > lo:
            scores = store.selector.page_scores(query.reshape(b, hkv, -1, d), store.bases, store.context)
            order = scores[..., lo:hi].cpu().argsort(-1, descending=True)
            fits = layout.sizes(length)[lo:hi][order].cumsum(-1) <= budget
            read[..., lo:hi] = torch.zeros_like(fits).scatter_(-1, order, fits)
        middle = read[..., lo:hi].gather(-1, (layout.page_of(sink_end, tail) - lo).expand(b, hkv, -1))
        count = middle.sum(-1)  # [B, Hkv] middle tokens each head reads
        widest = int(count.max()) if middle.numel() else 0
        row, head, at = middle.nonzero(as_tuple=True)  # in order: each head's tokens ascending
        slot = torch.arange(at.numel()) - (count.flatten().cumsum(0) - count.flatten())[row * hkv + head]
        picked = torch.zeros((b, hkv, widest), dtype=torch.long)
        picked[row, head, slot] = at + sink_end
        columns = torch.cat([torch.arange(sink_end).expand(b, hkv, -1), picked,
                             torch.arange(tail, length).expand(b, hkv, -1)], -1)
        valid = torch.ones(columns.shape, dtype=torch.bool)
        valid[..., sink_end:sink_end + widest] = torch.arange(widest) < count[..., None]
        seconds = time.perf_counter() - started
        keys, values = store.inner.read_tokens(columns)
        mask = column_mask(columns, None if bool(valid.all()) else valid, attention_mask, query, length)
        self.read = read.to(query.device)
        tokens = int(valid.sum())
        bases_bytes = store.bases.scored.nbytes if store.selector.reads_bases else 0
        read_bytes = store.inner.read_bytes(tokens, 0) // hkv + bases_bytes
        store.metrics.record_read(store.steps, read_bytes, store.full_bytes(), seconds, bases_bytes)
        store._mark_read(read)
        store.selector.selected(read.any(1).any(0).nonzero().flatten(), store.context)
        return keys, values, mask
