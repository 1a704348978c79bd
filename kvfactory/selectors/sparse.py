"""Sparse decode: a paged layer store whose decode steps read only the pages a selector picks.

``SparseStore`` wraps the config's paged storage and keeps page summaries (``pages.py``) as tokens
arrive. For a decode step of a sparse layer it hands kvfactory's attention function a
``SparseRead``: the selector scores the pages from the step's queries, the sink, local and
new-token pages are added, and exact softmax attention runs over the selected pages' K/V,
gathered block by block from the pool (the whole layer is never copied out). Prefills, the first
``dense_layers`` layers and budgets that cover every page read the whole layer, unchanged.
The selected K/V go to transformers' SDPA like any other (``kvfactory.attention.NarrowRead``).

The store also takes part in its attention call (``kvfactory.attention.Observer``): on shadow steps
it computes full attention for the same queries to measure hit rate and recall
(``metrics.py``).

Over an evicting store (``{eviction, selector}`` in one config) the two stages compose as in
RocketKV (Behnam et al., 2025): eviction compresses each prefill (``compression_ratio``), its
observer running first, and decode steps read a fraction of the pages of what it kept; the page
summaries are rebuilt from the kept keys after each eviction.
"""

from __future__ import annotations

import time

import torch

from kvfactory import attention
from kvfactory.attention import DeferredRead, NarrowRead
from kvfactory.eviction.store import EvictionStore
from kvfactory.quantization.store import QuantizedStore
from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.metrics import RoutingMetrics
from kvfactory.selectors.pages import PageSummaries, top_pages
from kvfactory.selectors.spec import SelectorSpec
from kvfactory.storage.base import MemoryReport, PrefixLayout, WrappedStore
from kvfactory.storage.paged import PagedStore

PROMPT_WINDOW = 32  # the prompt's last queries whose attention the prompt term keeps (SnapKV's window)


class SparseStore(WrappedStore):
    """One layer's paged K/V in ``inner`` (plain or quantized pages), read sparsely at decode as
    ``spec`` asks; ``inner`` serves whole pages (``pageable``, ``read_pages``, ``read_bytes``)."""

    observes_attention = True  # shadow steps measure full attention for the same queries

    def __init__(self, inner: PagedStore | QuantizedStore | EvictionStore, selector: Selector,
                 spec: SelectorSpec, metrics: RoutingMetrics, context: RoutingContext,
                 num_layers: int) -> None:
        self.inner, self.selector, self.spec, self.metrics = inner, selector, spec, metrics
        self.context, self.num_layers = context, num_layers
        self.page_size = inner.page_size
        self.summaries = PageSummaries(self.page_size, selector.uses_mean, spec.summary_torch_dtype)
        self.steps = 0  # decode steps seen by this layer
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None  # the last append's K/V (decode steps)
        self._heads = 0  # KV heads stored
        self._mask: torch.Tensor | None = None
        self._read: SparseRead | None = None  # this step's selection, for the shadow measurement
        self._last_read: torch.Tensor | None = None  # [B, Hkv, pages]: step each page was last read
        self._always: tuple[tuple, torch.Tensor] | None = None  # the sink pages of the last step
        self.prompt_mass: torch.Tensor | None = None  # [B, Hkv, pages]: the prompt's last queries' mass
        self.prompt_weight = spec.prompt_weight
        self._prompt_term: tuple[torch.Tensor, int, int, torch.Tensor] | None = None  # of prompt_mass, lo, hi
        metrics.register(self)

    def bind(self, layer_idx: int) -> None:
        super().bind(layer_idx)
        self.selector.bind(layer_idx, self.num_layers)
        if self.routed:
            self.summaries.set_embedding(self.selector.page_embedding())
            self.summaries.set_token_codes(self.selector.token_codes())

    # -- storage, delegated; summaries follow ---------------------------------------------------
    @property
    def evicts(self) -> bool:
        """Whether the store below evicts (its memory may be rewritten under a returned read)."""
        return self.inner.evicts

    def evicts_during(self, new_tokens: int) -> bool:
        """Only prefills evict below a selector (``_observe_below``): decode steps read in place."""
        return new_tokens > 1 and self.inner.evicts_during(new_tokens)

    @property
    def keeps_causal_mask(self) -> bool:
        """It records transformers' mask (for the shadow measurements and the prompt's page mass) and
        hands it on unchanged, unless an evicting store below builds one from the slots it kept."""
        return not self.inner.observes_attention

    @property
    def routed(self) -> bool:
        """Whether decode may read this layer sparsely (else it keeps no page summaries)."""
        return self.layer_idx >= self.spec.dense_layers and not self.selector.reads_all

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.inner.append(key, value)
        self.track(key, value)

    def track(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """What ``append`` does beside writing ``inner``, for a caller that wrote ``key`` / ``value`` into
        ``inner`` itself (the engine's batched decode write): the page summaries and the step's tail."""
        self._heads = key.shape[1]
        if self.routed:
            self.summaries.append(key)
        # a prompt's K/V is not kept: only a decode step's tail is handed back to attention
        self._new = (key, value) if key.shape[2] <= attention.MAX_CHUNKED_QUERY else None

    def clear(self) -> None:
        self.inner.clear()
        self.summaries.clear()
        self._new, self._last_read, self.prompt_mass = None, None, None

    def _rebuild(self) -> None:
        self.summaries.rebuild(self.inner.gather()[0] if self.inner.size() and self.routed else None)
        self._last_read = self.prompt_mass = None

    def keep(self, index: torch.Tensor) -> None:
        self.inner.keep(index)
        self._rebuild()

    # -- prefix sharing (``KVCache.prefix_blocks``): the pages are ``inner``'s, the summaries its own --
    def prefix_layout(self) -> PrefixLayout | None:
        return self.inner.prefix_layout()

    def sequence_blocks(self) -> torch.Tensor | None:
        return self.inner.sequence_blocks()

    def stored_from(self) -> int:
        return self.inner.stored_from()

    def adopt(self, ids: torch.Tensor, tokens: int, first: int = 0) -> None:
        """Start from a cached prefix's blocks (``PagedStore.adopt``); their page summaries are made from
        their keys, as writing them would have made them."""
        self.inner.adopt(ids, tokens, first)
        keys = self.inner.gather()[0]
        self._heads = keys.shape[1]
        self._rebuild()

    def drop_front(self, n: int) -> None:
        self.inner.drop_front(n)
        self._rebuild()

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)
        self._rebuild()

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)
        self.summaries.select_rows(rows)
        self._last_read = None
        if self.prompt_mass is not None:
            self.prompt_mass = self.prompt_mass[rows.to(self.prompt_mass.device)]

    def memory_report(self) -> MemoryReport:
        """The pages plus the page summaries (held for the selector)."""
        report = self.inner.memory_report()
        held = self.summaries.nbytes
        return MemoryReport(report.allocated + held, report.used + held, report.tokens)

    # -- reads ------------------------------------------------------------------------------
    def full_bytes(self) -> int:
        """Bytes a decode step reading everything reads (all rows)."""
        pageable = self.inner.pageable()
        return self.batch_size * self.inner.read_bytes(pageable, self.size() - pageable)

    def deferred_read(self) -> DeferredRead | SparseRead | None:
        """A sparse read for a decode step of a sparse layer; otherwise what the inner store reads
        (quantized pages: chunked attention; plain pages: None, read whole)."""
        self._read = None
        if self._new is None:
            return self.inner.deferred_read()  # a prefill: not a decode step
        self.steps += 1
        pages = -(-self.size() // self.page_size)
        wanted = self.spec.pages_to_read(pages)
        selectable = min(self.inner.pageable() // self.page_size, pages - self.spec.local_pages)
        sparse = self.routed and wanted < pages and selectable > self.spec.sink_pages
        if not sparse:
            full = self.full_bytes()
            self.metrics.record_read(self.steps, full, full, 0.0)
            tokens = self.batch_size * self._heads * self.size()
            self.metrics.record_tokens(tokens, whole=tokens)
            return self.inner.deferred_read()
        self._read = SparseRead(self, wanted)
        return self._read

    def reads_blocks(self) -> bool:
        """Whether the next decode step may read through ``decode_blocks`` (plain pages held from the
        first token, and no shadow measurement due: that needs the step's attention call)."""
        every = self.spec.shadow_every
        shadow = self.routed and every and (self.steps + 1) % every == 0
        return self.inner.plain_pages and not shadow and self.inner.pageable() == self.size() > 0

    def decode_blocks(self, query: torch.Tensor) -> tuple[torch.Tensor, int]:
        """For a one-row decode step whose token is stored (``reads_blocks`` held before the write),
        with ``query [Hq, D]``: the pool blocks each KV head reads, ``[Hkv, n]`` (the selected pages,
        then the tail's), and the tokens they hold from the first block's start, the same for every
        head; the step counted and accounted as ``SparseRead.narrow`` does. A step that is not
        sparse reads every block."""
        read = self.deferred_read()
        self._read = None  # no attention call observes this step
        _, ids, _, length = self.inner.pages_in_place()
        hkv = self._heads
        if not isinstance(read, SparseRead):
            return ids.expand(hkv, -1), length
        chosen, tail = read.choose(query.view(1, hkv, -1, query.shape[-1]))
        return ids[read.pages[0]], chosen.shape[-1] * self.page_size + length - tail * self.page_size

    def always_read(self, lo: int, device: torch.device) -> torch.Tensor:
        """The sink pages ``[0, lo)``, kept from the last step while they are the same."""
        if self._always is None or self._always[0] != (lo, device):
            self._always = (lo, device), torch.arange(lo, device=device)
        return self._always[1]

    def page_utilisation(self, steps: int) -> float:
        """Fraction of stored pages read in the last ``steps`` decode steps (NaN if never sparse)."""
        if self._last_read is None:
            return float("nan")
        last = self._last_read[:, :, :self.summaries.pages]
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
        if self.inner.observes_attention:  # an evicting store: the slots it kept decide the mask
            mask = self.inner.attention_mask(mask, query)
        self._mask = mask
        return mask

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        if self.inner.observes_attention:
            self._observe_below(query, scaling)
        read, self._read = self._read, None
        if read is None and self.prompt_weight and query.shape[2] > attention.MAX_CHUNKED_QUERY \
                and self.routed:
            self.prompt_mass = self._prompt_page_mass(query, scaling)
        every = self.spec.shadow_every
        if read is None or read.read is None or not every or self.steps % every:
            return
        mass = self._page_mass(query, self._mask, scaling)
        for hook in self.metrics.sample_hooks:  # before the hit rate's listeners, which may act on them
            hook(self, query, mass)
        self.metrics.record_shadow(read.read, mass)

    def _observe_below(self, query: torch.Tensor, scaling: float) -> None:
        """The evicting store's turn: a prefill may evict (then the summaries follow the kept keys, and
        the prompt's mask no longer fits them); a decode step only closes the prefill, since a
        ``compression_ratio`` evicts prefills alone and what it would accumulate is never used."""
        if query.shape[2] == 1:
            self.inner.end_prefill()
            return
        held = self.inner.size()
        self.inner.observe(query, scaling)
        if self.inner.size() != held:
            self._rebuild()
            self._mask = None

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
        mass = probs.new_zeros((b, hkv, self.summaries.pages))
        return mass.index_add_(2, torch.arange(length, device=probs.device) // self.page_size, probs)

    def _prompt_page_mass(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The page mass of the prefill's last ``PROMPT_WINDOW`` queries."""
        window = min(PROMPT_WINDOW, query.shape[2])
        mask = None if self._mask is None else self._mask[..., -window:, :]
        return self._page_mass(query[:, :, -window:], mask, scaling)

    def with_prompt_mass(self, scores: torch.Tensor, head_dim: int, lo: int, hi: int) -> torch.Tensor:
        """The pages ``[lo, hi)`` of the selector's ``scores [B, Hkv, pages]`` ranked by its shares
        plus ``SelectorSpec.prompt_weight`` times the prompt's last queries' shares (pages stored
        since the prefill have none), per KV head (``Selector.with_prompt``): ``[B, Hkv, hi - lo]``."""
        scores = scores[..., lo:hi]
        if self.prompt_mass is None:
            return scores
        cached = self._prompt_term  # the same until the pages [lo, hi) or the prompt change
        if cached is None or cached[0] is not self.prompt_mass or cached[1:3] != (lo, hi):
            mass = self.prompt_mass[..., lo:hi].to(scores.device)
            total = mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)
            term = scores.new_zeros(scores.shape, dtype=torch.float32)
            term[..., :mass.shape[2]] = mass.mul(self.prompt_weight).div_(total)
            cached = self._prompt_term = self.prompt_mass, lo, hi, term
        return self.selector.with_prompt(scores, cached[3], head_dim)


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


class SparseRead(NarrowRead):
    """One decode step's read of the ``wanted`` pages chosen for its query (chosen in ``narrow``),
    gathered block by block."""

    def __init__(self, store: SparseStore, wanted: int) -> None:
        self.store, self.wanted = store, wanted
        self.read: torch.Tensor | None = None  # [B, Hkv, pages]: every page read (set by ``narrow``)
        self.pages: torch.Tensor | None = None  # [B, Hkv, k] in the order read (the tail's last)

    @property
    def length(self) -> int:
        return self.store.size()

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store._new

    def select(self, queries: torch.Tensor) -> tuple[torch.Tensor, int]:
        """For ``queries [B, Hkv, R, D]``: the sink pages and the selector's best of the pages after
        them ``[B, Hkv, k]``, and the first page of the tail read whole (the local pages, the
        step's new tokens and what the inner store cannot serve as pages, e.g. a full-precision window)."""
        store, spec = self.store, self.store.spec
        pages, ps = store.summaries.pages, store.page_size
        first_new = (self.length - store._new[0].shape[2]) // ps
        lo = min(spec.sink_pages, pages)
        hi = max(lo, min(first_new, pages - spec.local_pages, store.inner.pageable() // ps))
        b, h = queries.shape[:2]
        sink = store.always_read(lo, queries.device).expand(b, h, -1)
        chosen = min(self.wanted - lo - (pages - hi), hi - lo)
        if chosen <= 0:
            return sink, hi
        scores = store.selector.page_scores(queries, store.summaries, store.context)
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
        chosen, tail = self.choose(query.reshape(b, hkv, -1, d))
        keys, values = store.inner.read_pages(chosen, tail)  # [B, Hkv, n, D]
        at = chosen.device
        columns = torch.cat([(chosen[..., None] * ps + torch.arange(ps, device=at)).flatten(2),
                             torch.arange(tail * ps, length, device=at).expand(b, hkv, -1)], -1)
        return keys, values, column_mask(columns, None, attention_mask, query, length)

    def choose(self, queries: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``select`` for ``queries [B, Hkv, R, D]``, with the step's read accounted: which pages it
        read (``pages``, ``read``, the layer's last-read steps) and its bytes and selection time in the
        routing metrics."""
        store = self.store
        started = time.perf_counter()
        chosen, tail = self.select(queries)
        seconds = time.perf_counter() - started
        b, hkv, k = chosen.shape
        at, pages, ps = chosen.device, store.summaries.pages, store.page_size
        self.pages = torch.cat([chosen, torch.arange(tail, pages, device=at).expand(b, hkv, -1)], -1)
        self.read = torch.zeros((b, hkv, pages), dtype=torch.bool, device=at).scatter_(2, self.pages, True)
        summary_bytes = store.summaries.scored.nbytes if store.selector.reads_summaries else 0
        read = b * store.inner.read_bytes(k * ps, self.length - tail * ps) + summary_bytes
        store.metrics.record_read(store.steps, read, store.full_bytes(), seconds, summary_bytes)
        sink, rows = min(store.spec.sink_pages, pages) * ps, b * hkv
        store.metrics.record_tokens(rows * self.length, always=rows * (sink + self.length - tail * ps),
                                    selected=rows * (k * ps - sink))
        store._mark_read(self.read)
        return chosen, tail
