"""Routing metrics of one sparse cache (OVAL's metrics), measured, never assumed.

- hit rate: of the pages a step read, the fraction that are among the same number of pages with
  the most attention mass under full attention (shadow steps, every ``shadow_every`` decode steps);
- attention-mass recall: the full-attention mass that falls on the pages read (shadow steps), and
  the oracle's: the mass on as many pages per head chosen by full attention itself, the most any
  selector reading that many pages can reach;
- page utilisation: stored pages read at least once in the last ``UTILISATION_STEPS`` steps;
- router latency: seconds spent choosing pages per decode step (all layers), p50 and p99;
- KV bytes read per decode step against reading every page (page summaries included, and apart);
- tokens read per decode step against the tokens stored, over every layer the cache routes or reads
  whole, split into what is always read (the sink, local and new-token pages), what the selector
  chose, and what layers read whole (the ``dense_layers``, or a budget that covers every page).
Means are over sparse layers, batch rows and KV heads.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvfactory.selectors.sparse import SparseStore

UTILISATION_STEPS = 128
TOKEN_PARTS = ("always", "selected", "whole")  # what a decode step's tokens read are
LATENCY_STEPS = 4096  # per-step latencies kept for the percentiles


class RoutingMetrics:
    """Counters the sparse layer stores of one cache write into; ``as_dict()`` reads them."""

    def __init__(self) -> None:
        self.steps = 0
        self.bytes_read = 0
        self.bytes_full = 0
        self.bytes_index = 0  # of bytes_read: page summaries the selector scored
        self.tokens = dict.fromkeys(TOKEN_PARTS + ("stored",), 0)  # summed over layers, rows and KV heads
        self.shadow_samples = 0
        self._hit_sum = self._recall_sum = self._oracle_sum = 0.0  # sums over shadow samples
        self._latency: dict[int, float] = {}
        self._latencies: deque[float] = deque(maxlen=LATENCY_STEPS)
        self._stores: weakref.WeakSet[SparseStore] = weakref.WeakSet()
        self.listeners: list[Callable[[float], None]] = []  # called with each shadow sample's hit rate
        # called with each shadow sample's store, queries [B, Hq, q, D] and full-attention page mass
        self.sample_hooks: list[Callable[[SparseStore, torch.Tensor, torch.Tensor], None]] = []

    def register(self, store: SparseStore) -> None:
        self._stores.add(store)

    def records(self, store: object) -> bool:
        """Whether ``store`` (a layer's) counts its reads here."""
        return store in self._stores

    def record_read(self, step: int, read_bytes: int, full_bytes: int, seconds: float,
                    index_bytes: int = 0) -> None:
        """One layer's decode step ``step`` (counted by each layer alike); ``read_bytes`` includes the
        ``index_bytes`` of page summaries read to choose the pages."""
        if step not in self._latency:
            self._close_steps()
            self.steps += 1
        self._latency[step] = self._latency.get(step, 0.0) + seconds
        self.bytes_read += read_bytes
        self.bytes_full += full_bytes
        self.bytes_index += index_bytes

    def record_tokens(self, stored: int, always: int = 0, selected: int = 0, whole: int = 0) -> None:
        """One layer's decode step, summed over its rows and KV heads: ``stored`` tokens held, of which
        it read ``always`` (sink, local and new-token pages), ``selected`` (the selector's pages) and
        ``whole`` (a layer read in full)."""
        for key, count in (("stored", stored), ("always", always), ("selected", selected), ("whole", whole)):
            self.tokens[key] += count

    def _close_steps(self) -> None:
        self._latencies.extend(self._latency.values())
        self._latency.clear()

    def record_shadow(self, read: torch.Tensor, mass: torch.Tensor) -> None:
        """``read [B, Hkv, pages]`` (bool) the pages read and ``mass [B, Hkv, pages]`` the full-attention
        mass per page; each head reads its own number of pages."""
        k = read.sum(-1, keepdim=True)
        ordered, order = mass.sort(-1, descending=True)
        rank = order.argsort(-1)  # 0: the page with the most mass
        hit = float(((rank < k) & read).sum(-1).div(k.squeeze(-1).clamp_min(1)).mean())
        best = ordered.cumsum(-1).gather(-1, (k - 1).clamp_min(0)).squeeze(-1) * (k.squeeze(-1) > 0)
        self.shadow_samples += 1
        self._hit_sum += hit
        self._recall_sum += float((mass * read).sum(-1).mean())
        self._oracle_sum += float(best.mean())
        for listener in self.listeners:
            listener(hit)

    def latency_quantiles(self) -> tuple[float, float]:
        """p50 and p99 router seconds per decode step (NaN before any step)."""
        values = list(self._latencies) + list(self._latency.values())
        if not values:
            return float("nan"), float("nan")
        q = torch.tensor(values, dtype=torch.float64).quantile(torch.tensor([0.5, 0.99], dtype=torch.float64))
        return float(q[0]), float(q[1])

    def page_utilisation(self) -> float:
        fractions = [s.page_utilisation(UTILISATION_STEPS) for s in self._stores]
        fractions = [f for f in fractions if f == f]
        return sum(fractions) / len(fractions) if fractions else float("nan")

    def as_dict(self) -> dict[str, float]:
        p50, p99 = self.latency_quantiles()
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "hit_rate": self._hit_sum / self.shadow_samples if self.shadow_samples else float("nan"),
            "recall": self._recall_sum / self.shadow_samples if self.shadow_samples else float("nan"),
            "oracle_recall": self._oracle_sum / self.shadow_samples if self.shadow_samples else float("nan"),
            "shadow_samples": self.shadow_samples,
            "page_utilisation": self.page_utilisation(),
            "router_latency_p50_ms": p50 * 1e3,
            "router_latency_p99_ms": p99 * 1e3,
            "kv_bytes_read_per_step": self.bytes_read / steps,
            "kv_bytes_full_per_step": self.bytes_full / steps,
            "index_bytes_read_per_step": self.bytes_index / steps,
            "read_fraction": self.bytes_read / self.bytes_full if self.bytes_full else float("nan"),
            "token_read_fraction": self._token_share(*TOKEN_PARTS),
            **{f"{part}_read_fraction": self._token_share(part) for part in TOKEN_PARTS},
        }

    def _token_share(self, *parts: str) -> float:
        """The tokens of ``parts`` over the tokens stored, over every recorded decode step."""
        stored = self.tokens["stored"]
        return sum(self.tokens[p] for p in parts) / stored if stored else float("nan")
