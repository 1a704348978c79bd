"""What a cache holds after a task: bytes, tokens seen and stored, compression ratio."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvfactory.cache import dynamic_cache_bytes


@dataclass(frozen=True)
class CacheFootprint:
    """A cache's holdings for one batch row, from its tensors.

    ``bytes``: kvfactory caches report ``memory_report()["allocated"]``, other transformers caches
    the storage of their key/value tensors. ``tokens_stored`` is the mean over layers (sliding
    layers and eviction keep fewer than seen); ``compression_ratio`` is kvpress's
    ``1 - stored / seen``. Quantized kvfactory caches add the relative MSE of their stored keys and
    values, averaged over quantized layers (``KVCache.quantization_error``); None elsewhere. Caches
    with a page selector add its routing metrics (``KVCache.routing_metrics``): the fraction of KV
    bytes decode read, hit rate and attention-mass recall, the oracle's recall at the same number of
    pages (NaN without shadow samples), the router's p99 latency per decode step, and the tokens a
    decode step read over those stored with their split: always read (sink, local and new-token
    pages), selected, and read whole (dense layers); others read everything (``read_fraction`` 1.0).
    """

    bytes: int
    tokens_seen: int
    tokens_stored: float
    bytes_per_token: float
    compression_ratio: float
    key_rel_mse: float | None = None
    value_rel_mse: float | None = None
    read_fraction: float = 1.0
    hit_rate: float | None = None
    recall: float | None = None
    router_p99_ms: float | None = None
    oracle_recall: float | None = None
    token_read_fraction: float | None = None
    always_read_fraction: float | None = None
    selected_read_fraction: float | None = None
    whole_read_fraction: float | None = None


def cache_footprint(cache: Any) -> CacheFootprint:
    """The footprint of a kvfactory cache or any transformers ``Cache`` of batch size 1."""
    seen = cache.get_seq_length()
    memory_report = getattr(cache, "memory_report", None)
    if memory_report is not None:
        report = memory_report()
        held = int(report["allocated"])
        stored = report["tokens_stored"] / (len(cache.layers) * max(cache.batch_size, 1))
    else:
        held = dynamic_cache_bytes(cache)
        lengths = [layer.keys.shape[-2] for layer in cache.layers if isinstance(layer.keys, torch.Tensor)]
        stored = sum(lengths) / len(lengths) if lengths else float(seen)
    errors = list(cache.quantization_error().values()) if hasattr(cache, "quantization_error") else []
    errors = [e for e in errors if not math.isnan(e["key"])]
    key_mse = sum(e["key"] for e in errors) / len(errors) if errors else None
    value_mse = sum(e["value"] for e in errors) / len(errors) if errors else None
    routing = cache.routing.as_dict() if getattr(cache, "routing", None) is not None else None
    read = routing["read_fraction"] if routing and not math.isnan(routing["read_fraction"]) else 1.0
    fields = ("hit_rate", "recall", "router_latency_p99_ms", "oracle_recall", "token_read_fraction",
              "always_read_fraction", "selected_read_fraction", "whole_read_fraction")
    return CacheFootprint(held, seen, stored, held / seen if seen else 0.0,
                          1.0 - stored / seen if seen else 0.0, key_mse, value_mse, read,
                          *(routing[f] if routing else None for f in fields))
