"""The Prometheus endpoint (scraped over HTTP, parsed with prometheus_client) and the hit-rate alert."""

from __future__ import annotations

import math
import urllib.request

import pytest
import torch
from helpers import attn_implementation, generate
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import random_prompt, tiny_model

from kvfactory import KVCacheFactory
from kvfactory.metrics import GAUGES, PREFIX, HitRateAlert, RoutingExporter
from kvfactory.selectors.metrics import RoutingMetrics


def routed_cache(selector: str = "quest"):
    model = tiny_model("llama")
    config = {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 4},
        {"name": selector, "read_budget": 0.25, "dense_layers": 0, "shadow_every": 1}]}
    with attn_implementation(model, "kvfactory"):
        cache = KVCacheFactory(model.config, config).create_cache()
        generate(model, {"input_ids": random_prompt(48)}, cache, max_new_tokens=6, min_new_tokens=6)
    return cache


def test_the_endpoint_serves_every_routing_metric() -> None:
    cache = routed_cache()
    exporter = RoutingExporter()
    exporter.track("chat", cache)
    server, _ = exporter.serve(port=0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read()
    finally:
        server.shutdown()
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    expected = cache.routing_metrics()
    for metric, (key, _) in GAUGES.items():
        (sample,) = families[f"{PREFIX}_{metric}"].samples
        assert sample.labels == {"cache": "chat"}
        assert sample.value == pytest.approx(expected[key], rel=1e-6, nan_ok=True)
    latency = {s.labels["quantile"]: s.value for s in families[f"{PREFIX}_router_latency_seconds"].samples}
    assert latency["0.5"] == pytest.approx(expected["router_latency_p50_ms"] / 1e3, rel=1e-6)
    assert latency["0.99"] >= latency["0.5"] > 0
    (steps,) = [s for s in families[f"{PREFIX}_routing_steps"].samples if s.name.endswith("_total")]
    assert steps.value == expected["steps"] == 5
    assert 0 < expected["read_fraction"] < 1 and expected["shadow_samples"] == 10


def test_tracking_needs_routing_metrics_and_untrack_removes() -> None:
    exporter = RoutingExporter()
    with pytest.raises(ValueError, match="no routing metrics"):
        exporter.track("plain", KVCacheFactory(tiny_model("llama").config, {"type": "paged"}).create_cache())
    exporter.track("x", RoutingMetrics())
    assert exporter.registry.get_sample_value(f"{PREFIX}_routing_steps_total", {"cache": "x"}) == 0
    exporter.untrack("x")
    assert exporter.registry.get_sample_value(f"{PREFIX}_routing_steps_total", {"cache": "x"}) is None


def test_the_alert_fires_once_the_hit_rate_stays_low_for_the_duration() -> None:
    now, calls = [0.0], []
    alert = HitRateAlert(lambda rate, seconds: calls.append((rate, seconds)), threshold=0.82,
                         duration_s=180, window=2, clock=lambda: now[0])
    for t, rate in [(0, 0.9), (10, 0.7), (20, 0.7), (150, 0.7), (199, 0.7)]:
        now[0] = t
        alert.update(rate)
    assert calls == [(0.7, 189)]  # the mean of the last 2 is low from t=10 (0.8): 189 s at t=199
    now[0] = 300
    alert.update(0.7)
    assert len(calls) == 1  # once per low stretch
    for t in (301, 302, 303):
        now[0] = t
        alert.update(0.95)  # recovers: re-armed
    for t in (400, 401, 600):
        now[0] = t
        alert.update(0.5)
    assert len(calls) == 2 and calls[1][1] == 200
    alert.update(math.nan)  # steps without a shadow sample are not evidence
    with pytest.raises(ValueError, match="threshold"):
        HitRateAlert(print, threshold=1.5)


def test_the_alert_watches_a_caches_shadow_samples() -> None:
    calls = []
    alert = HitRateAlert(lambda rate, seconds: calls.append(rate), threshold=1.0, duration_s=0)
    cache = routed_cache("random")
    alert.attach(cache)
    missed = torch.tensor([[[True, False]]]), torch.tensor([[[0.0, 1.0]]])  # read page 0: all mass missed
    cache.routing.record_shadow(*missed)
    assert calls and calls[-1] < 1.0
