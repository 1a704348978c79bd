"""One request inside the engine: its tokens, progress and timings, and what a step hands back.

A request's tokens are its prompt followed by what it has generated; ``computed`` counts those whose
K/V its cache holds (a prefix hit starts it above zero, a recompute preemption sets it back to zero).
Text is detokenized incrementally; a stop string ends generation before it, and text that might still
become a stop string (or an unfinished UTF-8 character) is held back until it is settled.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvfactory.engine.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted, not scheduled yet (or preempted by recompute)
    RUNNING = "running"  # holds K/V in the pool
    SWAPPED = "swapped"  # preempted: its K/V is on the host tier
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What ``Engine.step`` reports for a request that advanced: the step's new tokens and text, and
    everything so far. ``finish_reason``: ``stop`` (EOS, a stop token or string), ``length``
    (``max_tokens``), ``abort`` or ``error`` (this request alone failed: ``error`` says why); None while
    it runs."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None  # with ``finish_reason='error'``: why this request failed


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    computed: int = 0  # tokens whose K/V the cache holds
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    text: str = ""
    sent_text: int = 0  # characters of ``text`` already reported
    sent_tokens: int = 0  # tokens already reported
    tier_read: Future | None = None  # its prompt's chunks being read from the tiers, until it runs

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens to feed before the next one can be sampled."""
        return self.length - self.computed

    @property
    def decoding(self) -> bool:
        """Its prompt is in the cache and it feeds one token: decode work, not prefill."""
        return self.remaining == 1 and self.computed >= len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def settled_text(self) -> str:
        """The text that can be reported now: all of it once finished, else without a trailing
        replacement character (an unfinished UTF-8 sequence) or a tail that may start a stop string."""
        if self.finished:
            return self.text
        end = len(self.text)
        while end and self.text[end - 1] == "\ufffd":
            end -= 1
        hold = max((len(s) - 1 for s in self.params.stop), default=0)
        return self.text[:max(self.sent_text, end - hold)]
