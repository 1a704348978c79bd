"""Timing of ``generate()`` split into prefill and decode (the measurement protocol, docs/evaluation.md),
and the CPU a measurement ran on (``cpu_model``: benchmarks name it beside their ratios)."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class _StepClock(LogitsProcessor):
    """Records the wall time at which each generation step's logits are ready."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(time.perf_counter())
        return scores


@dataclass(frozen=True)
class GenerationTiming:
    """Result of ``timed_generate``: tokens, prefill seconds and decode throughput."""

    sequences: torch.Tensor
    new_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second after the first (batch rows counted), prefill excluded."""
        steps = self.new_tokens - 1
        rows = self.sequences.shape[0]
        return steps * rows / self.decode_s if self.decode_s > 0 else float("nan")


@torch.inference_mode()
def timed_generate(model: Any, inputs: dict[str, torch.Tensor], cache: Any, max_new_tokens: int,
                   **generate_kwargs: Any) -> GenerationTiming:
    """Greedy ``generate`` (unless overridden) with prefill and decode timed separately.

    Prefill time is from the call to the first token's logits; decode time covers the remaining
    ``max_new_tokens - 1`` steps. EOS is ignored so every config decodes the same number of steps.
    """
    clock = _StepClock()
    kwargs = {"do_sample": False, "min_new_tokens": max_new_tokens} | generate_kwargs
    start = time.perf_counter()
    sequences = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens,
                               logits_processor=LogitsProcessorList([clock]), **kwargs)
    end = time.perf_counter()
    new_tokens = sequences.shape[1] - inputs["input_ids"].shape[1]
    first = clock.stamps[0] if clock.stamps else end
    return GenerationTiming(sequences, new_tokens, prefill_s=first - start, decode_s=end - first)


def timed_continue(model: Any, sequences: torch.Tensor, cache: Any, max_new_tokens: int,
                   **generate_kwargs: Any) -> GenerationTiming:
    """``timed_generate`` continuing ``sequences`` ``[B, T]`` (no padding) whose first ``T - 1`` tokens
    ``cache`` holds, as it does after a ``generate`` call: decode speed measured in segments.

    ``generate`` feeds only the last token, so every step is a decode step: ``prefill_s`` is the
    first step with generate's set-up, ``decode_tokens_per_s`` the other ``max_new_tokens - 1``.
    Greedy segments give the tokens one longer call would.
    """
    inputs = {"input_ids": sequences, "attention_mask": torch.ones_like(sequences)}
    return timed_generate(model, inputs, cache, max_new_tokens, **generate_kwargs)
