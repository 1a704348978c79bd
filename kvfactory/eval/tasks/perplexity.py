"""Perplexity through the cache: prefill a WikiText window, then teacher-force one token at a time.

Each window prefills its context (2048 tokens by default, or 6144), then scores the next tokens
one decode step at a time through the same cache, so a cache that evicts or compresses is scored
on what it keeps; ``kvfactory.eval.settings`` sets how many windows and tokens (4 x 512).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvfactory.eval.data import PerplexityWindow
from kvfactory.eval.footprint import cache_footprint
from kvfactory.eval.scoring import perplexity
from kvfactory.eval.tasks.result import TaskResult


@dataclass(frozen=True)
class PerplexityResult(TaskResult):
    """One window: summed NLL (nats) of ``scored_tokens`` tokens after ``prefill_tokens`` (the first
    scored token is predicted by the prefill, each later one by a decode step)."""

    prefill_tokens: int
    scored_tokens: int
    nll: float
    ppl: float


@torch.inference_mode()
def run_perplexity(model: Any, make_cache: Callable[[], Any],
                   windows: Sequence[PerplexityWindow]) -> list[PerplexityResult]:
    """Perplexity of every window, each through a fresh cache."""
    return [_score_window(model, make_cache(), window) for window in windows]


def _next_logits(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]


def _score_window(model: Any, cache: Any, window: PerplexityWindow) -> PerplexityResult:
    ids = torch.tensor([window.input_ids])
    prefill, total = window.prefill, ids.shape[1]
    if not 0 < prefill < total:
        raise ValueError(f"window of {total} tokens with prefill {prefill}: nothing to score")
    start = time.perf_counter()
    logits = _next_logits(model, ids[:, :prefill], cache)
    prefill_s = time.perf_counter() - start
    log_probs = []
    for position in range(prefill, total):
        log_probs.append(torch.log_softmax(logits.double(), dim=-1)[ids[0, position]])
        if position + 1 < total:
            logits = _next_logits(model, ids[:, position:position + 1], cache)
    decode_s = time.perf_counter() - start - prefill_s
    nll = -torch.stack(log_probs).sum().item()
    scored = total - prefill
    return PerplexityResult(task=window.task, context=window.context, sample=window.sample,
                            prefill_s=prefill_s, decode_s=decode_s, decode_steps=scored - 1,
                            footprint=cache_footprint(cache), prefill_tokens=prefill, scored_tokens=scored,
                            nll=nll, ppl=perplexity(nll, scored))
