"""What a forward step must compute and read, and the rates this core reaches: the rooflines the
serving benchmarks hold the engine to (Williams, Waterman and Patterson, "Roofline: an insightful
visual performance model for multicore architectures", CACM 2009).

A prompt token costs two FLOPs per weight of every decoder linear layer, plus four per attention
head dimension per key it attends to (the scores and the weighted sum of values): all earlier
positions under full attention, at most a layer's window under sliding attention. A token that
produces logits also multiplies the output embedding. A decode step must read every linear weight
once and the K/V of every sequence it decodes. ``gemm_rate`` and ``read_rate`` measure the two
ceilings on this core, on the thread count torch is set to.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvfactory.cache import attention_layout


@dataclass(frozen=True)
class ModelCost:
    """Per-token arithmetic and per-step weight bytes of a decoder (``model_cost``)."""

    linear_flops: int  # per token, every decoder layer's linear layers
    head_flops: int  # per token that produces logits (the output embedding)
    key_flops: int  # per key a token attends to, per layer
    windows: tuple[tuple[int | None, int], ...]  # (window or None for full attention, layers)
    weight_bytes: int  # the linear weights (output embedding included) a decode step reads

    def prefill_flops(self, start: int, end: int) -> int:
        """FLOPs of computing positions ``start`` to ``end - 1`` of one sequence (its logits aside)."""
        if end <= start:
            return 0
        keys = sum(layers * (_keys_through(end, window) - _keys_through(start, window))
                   for window, layers in self.windows)
        return (end - start) * self.linear_flops + keys * self.key_flops


def _keys_through(n: int, window: int | None) -> int:
    """Keys the tokens at positions ``0 .. n-1`` attend to together: ``sum(min(p + 1, window))``."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def model_cost(model: Any) -> ModelCost:
    """``model``'s ``ModelCost`` from its ``nn.Linear`` modules (a weight tied to the input embedding
    is read once) and its attention layout (``kvfactory.cache.attention_layout``)."""
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    decoder = sum(m.weight.numel() for m in linears if m is not head)
    distinct = {m.weight.data_ptr(): m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)
                for m in linears}
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelCost(linear_flops=2 * decoder, head_flops=2 * head.weight.numel(),
                     key_flops=4 * config.num_attention_heads * head_dim,
                     windows=tuple(sorted(Counter(attention_layout(model.config)).items(),
                                          key=lambda item: item[0] or 0)),
                     weight_bytes=sum(distinct.values()))


def median_seconds(run: Any, runs: int) -> float:
    """The median wall time of ``runs`` calls of ``run`` after one untimed call (caches and workspaces
    warm): what every timing here and in ``benchmarks/`` reports."""
    run()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def gemm_rate(model: Any, rows: int = 512, runs: int = 3) -> float:
    """GFLOP/s of every decoder linear layer of ``model`` multiplying ``rows`` rows in the layout the
    engine takes for that many (``kvfactory.engine.weights.pack_weight``), else through ``F.linear``: the
    arithmetic ceiling of a prefill chunk of ``rows`` tokens."""
    from kvfactory.engine.weights import pack_weight

    head = model.get_output_embeddings()
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    packed = [pack_weight(w) for w in weights]

    def run() -> None:
        for w, p in zip(weights, packed, strict=True):
            x = inputs[w.shape[1]]
            F.linear(x, w) if p is None else p.linear(x, w, None)

    with torch.inference_mode():
        seconds = median_seconds(run, runs)
    return 2 * rows * sum(w.numel() for w in weights) / seconds / 1e9


def read_rate(nbytes: int = 2**30, runs: int = 5) -> float:
    """GB/s at which this core streams ``nbytes`` of float32 from memory (a sum over a buffer far
    larger than the caches): the bandwidth ceiling of a decode step."""
    buffer = torch.ones(nbytes // 4)
    return nbytes / median_seconds(buffer.sum, runs) / 1e9
