"""Routing metrics on a Prometheus endpoint, and the alert on a falling hit rate.

``RoutingExporter`` collects the ``RoutingMetrics`` of the caches it tracks (by name) into a
``prometheus_client`` registry, read at scrape time, and serves them over HTTP. ``HitRateAlert``
calls back when the hit rate of the shadow samples stays under a threshold for a while (default
0.82 for three minutes: a router whose picks drift from full attention can then be retrained).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfactory.selectors.metrics import RoutingMetrics

PREFIX = "kvfactory"
GAUGES = {  # metric name: (RoutingMetrics.as_dict key, help)
    "routing_hit_rate": ("hit_rate", "Pages read among the same number with the most attention mass"),
    "routing_recall": ("recall", "Full-attention mass on the pages read (shadow steps)"),
    "routing_oracle_recall": ("oracle_recall", "The same for as many pages chosen by full attention"),
    "routing_page_utilisation": ("page_utilisation", "Stored pages read in the last 128 decode steps"),
    "kv_bytes_read_per_step": ("kv_bytes_read_per_step", "KV bytes a decode step read, summaries included"),
    "kv_bytes_full_per_step": ("kv_bytes_full_per_step", "KV bytes a decode step reading every page reads"),
    "index_bytes_read_per_step": ("index_bytes_read_per_step", "Of the bytes read: page summaries scored"),
    "kv_read_fraction": ("read_fraction", "KV bytes read over reading every page"),
    "token_read_fraction": ("token_read_fraction", "Tokens a decode step read over the tokens stored"),
    "always_read_fraction": ("always_read_fraction", "Of them: sink, local and new-token pages"),
    "selected_read_fraction": ("selected_read_fraction", "Of them: pages the selector chose"),
    "whole_read_fraction": ("whole_read_fraction", "Of them: layers read whole (dense layers)"),
}


def metrics_of(source: Any) -> RoutingMetrics:
    """The ``RoutingMetrics`` of ``source``: a cache with a page selector, or the metrics themselves."""
    metrics = source if isinstance(source, RoutingMetrics) else getattr(source, "routing", None)
    if not isinstance(metrics, RoutingMetrics):
        raise ValueError(f"{type(source).__name__} has no routing metrics: pass a cache with a page "
                         f"selector or its RoutingMetrics")
    return metrics


class RoutingExporter(Collector):
    """Exports tracked caches' routing metrics, labelled ``cache=NAME``, to ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._tracked: dict[str, RoutingMetrics] = {}
        self.registry.register(self)

    def track(self, name: str, source: Any) -> None:
        """Export ``source`` (a cache with a selector, or its ``RoutingMetrics``) as ``cache=name``."""
        self._tracked[name] = metrics_of(source)

    def untrack(self, name: str) -> None:
        self._tracked.pop(name, None)

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> tuple[Any, Any]:
        """Serve ``/metrics`` on a background thread; returns ``(server, thread)`` (``server.server_port``
        is the port taken when ``port`` is 0). ``server.shutdown()`` stops it."""
        return start_http_server(port, addr=addr, registry=self.registry)

    def collect(self) -> Iterator[Any]:
        snapshot = {name: metrics.as_dict() for name, metrics in list(self._tracked.items())}
        for metric, (key, help_text) in GAUGES.items():
            family = GaugeMetricFamily(f"{PREFIX}_{metric}", help_text, labels=["cache"])
            for name, values in snapshot.items():
                family.add_metric([name], values[key])
            yield family
        latency = GaugeMetricFamily(f"{PREFIX}_router_latency_seconds",
                                    "Seconds choosing pages per decode step (all layers), by quantile",
                                    labels=["cache", "quantile"])
        steps = CounterMetricFamily(f"{PREFIX}_routing_steps", "Decode steps routed", labels=["cache"])
        for name, values in snapshot.items():
            latency.add_metric([name, "0.5"], values["router_latency_p50_ms"] / 1e3)
            latency.add_metric([name, "0.99"], values["router_latency_p99_ms"] / 1e3)
            steps.add_metric([name], values["steps"])
        yield latency
        yield steps


class HitRateAlert:
    """Calls ``callback(hit_rate, seconds_below)`` once the mean hit rate of the last ``window`` shadow
    samples has stayed under ``threshold`` for ``duration_s``; re-arms when it recovers."""

    def __init__(self, callback: Callable[[float, float], None], threshold: float = 0.82,
                 duration_s: float = 180.0, window: int = 64, clock: Callable[[], float] = time.monotonic):
        if not 0.0 <= threshold <= 1.0 or duration_s < 0 or window < 1:
            raise ValueError(f"threshold={threshold}, duration_s={duration_s}, window={window}: expected a "
                             f"threshold in [0, 1], duration_s >= 0 and window >= 1")
        self.callback, self.threshold, self.duration_s, self.clock = callback, threshold, duration_s, clock
        self._recent: deque[float] = deque(maxlen=window)
        self._below_since: float | None = None
        self.fired = False

    def attach(self, source: Any) -> HitRateAlert:
        """Watch ``source``'s shadow samples (a cache with a selector, or its ``RoutingMetrics``)."""
        metrics_of(source).listeners.append(self.update)
        return self

    def update(self, hit_rate: float) -> None:
        """One shadow sample's hit rate."""
        if math.isnan(hit_rate):
            return
        self._recent.append(hit_rate)
        mean = sum(self._recent) / len(self._recent)
        now = self.clock()
        if mean >= self.threshold:
            self._below_since, self.fired = None, False
            return
        if self._below_since is None:
            self._below_since = now
        if not self.fired and now - self._below_since >= self.duration_s:
            self.fired = True
            self.callback(mean, now - self._below_since)
