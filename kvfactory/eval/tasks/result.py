"""What every task reports per prompt: which prompt it was, and what it cost."""

from __future__ import annotations

from dataclasses import dataclass

from kvfactory.eval.footprint import CacheFootprint


@dataclass(frozen=True)
class TaskResult:
    """A prompt's task, context and sample; ``prefill_s`` to the first token, ``decode_steps`` one-token
    forward passes after it in ``decode_s``, and the cache's ``footprint`` at the end."""

    task: str
    context: int
    sample: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    footprint: CacheFootprint
