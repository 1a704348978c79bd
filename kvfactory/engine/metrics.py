"""The engine's Prometheus metrics, in a registry of its own (``kvfactory serve`` exposes it at
``/metrics``): queues, pool usage (blocks held by requests apart from idle prefix-cache blocks),
prefix-cache hits, rejected and failed requests, preemptions, token rates, time to first token,
inter-token latency and, for sparse configs, the page selector's routing quality."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from kvfactory.engine.engine import Engine
    from kvfactory.engine.request import Request
    from kvfactory.engine.scheduler import Plan

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_WINDOW = 10.0  # seconds the token rates average over
ROUTING = ("hit_rate", "recall", "read_fraction", "token_read_fraction")


class EngineMetrics:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.registry = registry = CollectorRegistry()
        gauge = _maker(Gauge, registry)
        counter = _maker(Counter, registry)
        self.running = gauge("kvfactory_requests_running", "Requests holding K/V in the pool")
        self.waiting = gauge("kvfactory_requests_waiting", "Requests waiting to be scheduled")
        self.swapped = gauge("kvfactory_requests_swapped", "Preempted requests whose K/V is on the host tier")
        self.pool_used = gauge("kvfactory_pool_blocks_used", "Pool blocks allocated (all layer groups): "
                               "held by requests plus idle prefix-cache blocks")
        self.pool_held = gauge("kvfactory_pool_blocks_held", "Pool blocks held by requests (all layer "
                               "groups); 0 with no request in flight")
        self.prefix_idle = gauge("kvfactory_prefix_cache_idle_blocks", "Pool blocks only the prefix cache "
                                 "keeps for later prompts (evicted when the pool needs room)")
        self.pool_total = gauge("kvfactory_pool_blocks_total", "Pool blocks (all layer groups; a block holds "
                                "one page of each layer of its group)")
        self.pool_usage = gauge("kvfactory_pool_usage", "Fraction of the pool's blocks held by requests")
        self.prefix_queried = counter("kvfactory_prefix_cache_queried_tokens",
                                      "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("kvfactory_prefix_cache_hit_tokens",
                                   "Prompt tokens found in the prefix cache")
        self.preemptions = counter("kvfactory_preemptions", "Sequences preempted to make room", ["mode"])
        self.prompt_tokens = counter("kvfactory_prompt_tokens", "Prompt tokens computed (prefill)")
        self.generation_tokens = counter("kvfactory_generation_tokens", "Tokens generated")
        self.finished_requests = counter("kvfactory_requests_finished", "Requests finished, by "
                                         "finish_reason: stop, length, abort (client gone, shutdown) or "
                                         "error (failed)", ["reason"])
        self.rejected = counter("kvfactory_requests_rejected", "Requests answered with an error before they "
                                "ran, by HTTP status and reason", ["status", "reason"])
        self.prompt_rate = gauge("kvfactory_prompt_tokens_per_second",
                                 f"Prefill tokens/s over the last {RATE_WINDOW:g} s")
        self.generation_rate = gauge("kvfactory_generation_tokens_per_second",
                                     f"Generated tokens/s over the last {RATE_WINDOW:g} s")
        histogram = _maker(Histogram, registry, buckets=LATENCY_BUCKETS)
        self.ttft = histogram("kvfactory_time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = histogram("kvfactory_inter_token_latency_seconds", "Between a request's generated tokens")
        self.step_seconds = histogram("kvfactory_step_seconds", "One engine step (forward and sampling)")
        self.routing = {name: gauge(f"kvfactory_routing_{name}", f"Page selector {name.replace('_', ' ')}, "
                                    "mean over finished requests") for name in ROUTING}
        self.tier_chunks = gauge("kvfactory_tier_chunks", "Prompt chunks loaded from and stored to tiers, "
                                 "and chunks that failed to load", ["what"])
        self.tier_seconds = gauge("kvfactory_tier_seconds", "Seconds spent loading and storing prompt chunks",
                                  ["what"])
        self.tier_stats = gauge("kvfactory_tier_stat", "Each tier's hits, misses, bytes read and written, "
                                "dropped writes, evictions and errors", ["tier", "stat"])
        self._routing_sums = {name: 0.0 for name in ROUTING}
        self._routing_count = 0
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)

    def prefix_tokens(self, prompt: int, cached: int) -> None:
        self.prefix_queried.inc(prompt)
        self.prefix_hits.inc(cached)

    def rejected_request(self, status: int, reason: str) -> None:
        self.rejected.labels(status=str(status), reason=reason).inc()

    def preempted(self, mode: str) -> None:
        self.preemptions.labels(mode=mode).inc()

    def step(self, plan: Plan, sampled: int, seconds: float) -> None:
        prefill = sum(tokens for request, tokens in plan if tokens > 1 or not request.output_ids)
        self.prompt_tokens.inc(prefill)
        self.generation_tokens.inc(sampled)
        self.step_seconds.observe(seconds)
        now = time.perf_counter()
        self._recent.append((now, prefill, sampled))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()
        span = max(now - self._recent[0][0], seconds, 1e-9) if len(self._recent) > 1 else max(seconds, 1e-9)
        self.prompt_rate.set(sum(p for _, p, _ in self._recent) / span)
        self.generation_rate.set(sum(g for _, _, g in self._recent) / span)

    def token(self, request: Request, now: float) -> None:
        if request.first_token_at is None:
            request.first_token_at = now
            self.ttft.observe(now - request.arrival)
        else:
            self.itl.observe(now - request.last_token_at)
        request.last_token_at = now

    def finished(self, request: Request, reason: str) -> None:
        """Called before the request's cache is freed (its routing metrics are read here)."""
        self.finished_requests.labels(reason=reason).inc()
        manager = self.engine.manager
        if request.request_id not in manager:
            return
        cache = manager.get(request.request_id)
        if cache.routing is None or not cache.routing.steps:
            return
        values = cache.routing_metrics()
        if any(math.isnan(values[name]) for name in ROUTING):
            return
        self._routing_count += 1
        for name in ROUTING:
            self._routing_sums[name] += values[name]
            self.routing[name].set(self._routing_sums[name] / self._routing_count)

    def update_gauges(self) -> None:
        scheduler, stats = self.engine.scheduler, self.engine.manager.stats()
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.swapped.set(len(scheduler.swapped))
        self.pool_used.set(stats["pool_blocks_used"])
        self.pool_held.set(stats["pool_blocks_held"])
        self.prefix_idle.set(stats["pool_blocks_used"] - stats["pool_blocks_held"])
        self.pool_total.set(stats["pool_blocks"])
        self.pool_usage.set(stats["pool_blocks_held"] / stats["pool_blocks"] if stats["pool_blocks"] else 0.0)
        tiers = self.engine.manager.tiers
        if tiers is not None:
            for name, value in vars(tiers.counters).items():
                if name.endswith("_seconds"):
                    self.tier_seconds.labels(name.removesuffix("_seconds")).set(value)
                else:
                    self.tier_chunks.labels(name).set(value)
            for tier in getattr(tiers.tiers, "tiers", [tiers.tiers]):
                for name, value in tier.stats.as_dict().items():
                    self.tier_stats.labels(tier.name, name).set(value)


def _maker(kind: type, registry: CollectorRegistry, **defaults: object):
    """``kind(name, help, labels)`` registered in ``registry``."""
    def make(name: str, documentation: str, labels: tuple[str, ...] | list[str] = ()) -> object:
        return kind(name, documentation, labels, registry=registry, **defaults)
    return make
