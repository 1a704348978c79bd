"""``Sequence``: what the manager knows about one sequence, and the one place its status changes.

A sequence is ``WAITING`` from ``create`` (possibly starting from cached prefix blocks) until its first
write, then ``RUNNING``; ``pause`` moves its K/V to the host tier (``PAUSED``), ``prefetch`` starts
bringing them back (``PREFETCHING``), ``resume`` writes them into the pool again (``RUNNING``) and
``free`` ends it (``FINISHED``). This is the record a continuous-batching scheduler reads, as vLLM's
``Request`` and nano-vllm's ``Sequence`` are. ``KVCache`` keeps only what a transformers cache needs:
the record is its ``hooks`` (``kvfactory.cache.SequenceHooks``), which refuse writes while the
sequence is paused and hear what was written (prefix blocks are hashed then, when they fill).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvfactory.cache import KVCache
from kvfactory.errors import SequenceStateError
from kvfactory.manager.state import SequenceState


class SequenceStatus(enum.Enum):
    """Where a sequence's K/V are and what it may do."""

    WAITING = "waiting"  # created, nothing written by it yet (it may hold a cached prefix)
    RUNNING = "running"  # its K/V are in the pool and it takes writes
    PAUSED = "paused"  # its K/V (or its oldest pages) are in the host tier; writes are refused
    PREFETCHING = "prefetching"  # paused, its host copy on its way to the pool's device
    FINISHED = "finished"  # freed: its blocks went back to the pool (cached prompt blocks stay cached)


S = SequenceStatus
LIVE = (S.WAITING, S.RUNNING)  # its K/V are in the pool
# action -> (the statuses it starts from, the status it ends in): every legal transition
ACTIONS: dict[str, tuple[tuple[SequenceStatus, ...], SequenceStatus]] = {
    "write": ((S.WAITING,), S.RUNNING),
    "pause": (LIVE, S.PAUSED),
    "prefetch": ((S.PAUSED,), S.PREFETCHING),
    "resume": ((S.PAUSED, S.PREFETCHING), S.RUNNING),
    "free": ((S.WAITING, S.RUNNING, S.PAUSED, S.PREFETCHING), S.FINISHED),
}
TRANSITIONS: frozenset[tuple[SequenceStatus, SequenceStatus]] = frozenset(
    (start, end) for starts, end in ACTIONS.values() for start in starts)
HINTS = {S.PAUSED: "resume it first", S.PREFETCHING: "resume it first",
         S.FINISHED: "it was freed; create it again"}


def refuse(seq_id: str, action: str, current: SequenceStatus, allowed: tuple[SequenceStatus, ...]) -> None:
    """Raise ``SequenceStateError`` naming the sequence's status and those ``action`` needs."""
    hint = HINTS.get(current)
    raise SequenceStateError(f"{action}({seq_id!r}): sequence {seq_id!r} is {current.value}, not "
                             f"{' or '.join(s.value for s in allowed)}" + (f": {hint}" if hint else ""))


@dataclass(eq=False)
class Sequence:
    """One sequence of a ``KVCacheManager``: its cache and every piece of its state.

    ``prompt_tokens``: the tokens of its declared prompt whose full blocks are cached once written
    (None: created without a prompt, or prefix caching is off); ``cached_tokens``: the tokens it
    started with from cached or shared blocks; ``host``: its K/V in the host tier while paused;
    ``prefetch``: the staged copy on its way back; ``hashed_tokens``: the tokens whose full blocks
    were offered to the prefix cache; ``window_blocks``: the prompt blocks before which every block's
    full-precision window pages were named (``WindowPages``); ``tier_chunks``: the leading chunks of
    its prompt the tiers hold (``PrefixTiers``); ``last_used``: when the manager last handed it out
    (LRU).
    """

    seq_id: str
    cache: KVCache
    status: SequenceStatus = SequenceStatus.WAITING
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    host: SequenceState | None = None
    prefetch: Future[SequenceState] | None = None
    hashed_tokens: int = 0
    looked_blocks: int = -1  # the whole blocks it held when the fill point last looked
    window_blocks: int = 0
    tier_chunks: int = 0
    last_used: int = 0
    on_written: Callable[[Sequence], None] | None = field(default=None, repr=False)  # the fill point

    def check(self, action: str) -> SequenceStatus:
        """The status ``action`` moves the sequence to; ``SequenceStateError`` (naming the states) if
        it may not from this one. The only place transitions are checked."""
        starts, end = ACTIONS[action]
        if self.status not in starts:
            refuse(self.seq_id, action, self.status, starts)
        return end

    def move(self, action: str) -> None:
        """Take ``action``'s transition (checked: an illegal one changes nothing)."""
        self.status = self.check(action)

    def require_live(self, action: str) -> None:
        """``SequenceStateError`` unless the sequence's K/V are in the pool (waiting or running)."""
        if self.status not in LIVE:
            refuse(self.seq_id, action, self.status, LIVE)

    @property
    def paused(self) -> bool:
        """Its K/V (or its oldest pages) are in the host tier."""
        return self.status in (S.PAUSED, S.PREFETCHING)

    # -- kvfactory.cache.SequenceHooks ------------------------------------------------------------
    def check_write(self) -> None:
        if self.paused:
            raise SequenceStateError(f"sequence {self.seq_id!r} is paused (its KV is in the host tier): "
                                     f"resume it before generating")

    def written(self, cache: KVCache) -> None:
        if self.status is S.WAITING:
            self.move("write")
        if self.on_written is not None:
            self.on_written(self)

    def truncated(self, cache: KVCache) -> None:
        self.hashed_tokens = min(self.hashed_tokens, cache.get_seq_length())
        self.looked_blocks = -1
