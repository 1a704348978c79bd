"""Which sequences run in the next step, and who makes room when the pool is full.

First come, first served under two limits: ``max_num_batched_tokens`` tokens per step and
``max_num_seqs`` sequences holding K/V. Each step takes the running sequences' decode tokens
first, then continues their chunked prefills, then brings back preempted sequences (before any new
one, so nobody starves), then admits waiting requests with a prefill chunk that fills the budget.
When a step's writes do not fit in the pool, the most recently admitted running sequence is
preempted (``Memory.preempt``: swapped to the host tier or dropped for recompute) until they do;
nothing is resumed or admitted in a step that preempted. The next ``max_num_seqs`` waiting requests
are prepared ahead (``Memory.prepare``: their prompt chunks read from the tiers off the step), and a
request is admitted once that is done; those behind it in the queue go first meanwhile. A request
whose admission or resume fails
(``RequestFailed``: a tier error loading its chunks, say) leaves the queues for ``failed``, where
the engine ends it with the cause; the others are scheduled as if it had never come.

With ``prefill_first`` a step that has a prompt to prefill (a running chunked prefill, a swapped
sequence, or a waiting request with a free slot) carries no decode tokens, as SGLang's default and
vLLM's scheduler without chunked prefill do: decodes then run together, as wide as the batch gets,
at the price of pausing them while a new prompt prefills. Mixed steps (the default, as vLLM's V1)
keep every running sequence decoding one token per step.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Protocol

from kvfactory.engine.request import Request, RequestStatus

Plan = list[tuple[Request, int]]  # (request, tokens it feeds this step), in packing order


class RequestFailed(Exception):
    """One request cannot go on (raised by ``Memory.admit`` / ``Memory.resume``, which undo what they
    began); the message is the cause."""


class Memory(Protocol):
    """The pool as the scheduler sees it (``kvfactory.engine.engine.EngineMemory``)."""

    def fits(self, plan: Plan) -> bool:
        """Whether the pool can take every write of ``plan`` (after freeing cached prefixes)."""

    def prepare(self, request: Request) -> None:
        """Start what a waiting request needs before it can be admitted (reading its prompt's chunks
        from the tiers), off the step."""

    def ready(self, request: Request) -> bool:
        """Whether what ``prepare`` started for the request is done."""

    def admit(self, request: Request) -> None:
        """Give a waiting request a cache (starting from its cached prefix: sets ``computed``);
        ``RequestFailed`` if that fails, with nothing held."""

    def release(self, request: Request) -> None:
        """Drop the request's cache (finished, aborted, or preempted by recompute)."""

    def preempt(self, request: Request) -> RequestStatus:
        """Make room by taking the request out of the pool: SWAPPED (its K/V on the host tier) or
        WAITING (its K/V dropped, recomputed when it comes back)."""

    def fits_resume(self, request: Request, plan: Plan) -> bool:
        """Whether a swapped request's K/V fits back, with the writes of ``plan`` (which ends with the
        request's own next tokens)."""

    def resume(self, request: Request) -> None:
        """Bring a swapped request's K/V back into the pool; ``RequestFailed`` if that fails."""


class Scheduler:
    def __init__(self, memory: Memory, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, prefill_first: bool = False) -> None:
        self.memory = memory
        self.chunked_prefill, self.prefill_first = chunked_prefill, prefill_first
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.failed: list[tuple[Request, str]] = []  # taken out of the queues, with the cause
        self.preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.swapped) + len(self.running)

    def schedule(self) -> Plan:
        for request in itertools.islice(self.waiting, self.max_num_seqs):  # the next to be admitted
            self.memory.prepare(request)
        if not (self.prefill_first and self._prefill_pending()):
            return self._plan(decodes=True, prefills=True)
        return self._plan(decodes=False, prefills=True) or self._plan(decodes=True, prefills=False)

    def _prefill_pending(self) -> bool:
        return (any(not r.decoding for r in [*self.running, *self.swapped])
                or (bool(self.waiting) and len(self.running) < self.max_num_seqs))

    def _plan(self, decodes: bool, prefills: bool) -> Plan:
        """Decode tokens first (if ``decodes``), then prompt chunks, resumes and admissions (if
        ``prefills``; swapped sequences come back in order, whichever kind of work they have)."""
        plan: Plan = []
        budget = self.max_num_batched_tokens
        preempted = False
        for request in [r for r in self.running if r.decoding and decodes] + [
                r for r in self.running if not r.decoding and prefills]:
            tokens = self._chunk(request, budget, plan) if request in self.running and budget > 0 else 0
            if not tokens:
                continue
            while not self.memory.fits([*plan, (request, tokens)]):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                for planned in [item for item in plan if item[0] is victim]:
                    plan.remove(planned)
                    budget += planned[1]
                if victim is request:
                    break
            else:
                plan.append((request, tokens))
                budget -= tokens
        if preempted:
            return plan
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            if not (decodes if request.decoding else prefills):
                break
            tokens = self._chunk(request, budget, plan)
            if not tokens or not self.memory.fits_resume(request, [*plan, (request, tokens)]):
                return plan
            self.swapped.popleft()
            try:
                self.memory.resume(request)
            except RequestFailed as exc:
                self.failed.append((request, str(exc)))
                continue
            self._run(request)
            plan.append((request, tokens))
            budget -= tokens
        if self.swapped or not prefills:
            return plan
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not self.memory.ready(request):  # its chunks are still being read: those behind go first
                continue
            try:
                self.memory.admit(request)
            except RequestFailed as exc:
                self.waiting.remove(request)
                self.failed.append((request, str(exc)))
                continue
            tokens = self._chunk(request, budget, plan)
            if not tokens or not self.memory.fits([*plan, (request, tokens)]):
                self.memory.release(request)
                break
            self.waiting.remove(request)
            self._run(request)
            plan.append((request, tokens))
            budget -= tokens
        return plan

    def finish(self, request: Request) -> None:
        """Take a finished or aborted request out of every queue and give its memory back."""
        if request in self.running:
            self.running.remove(request)
            self.memory.release(request)
        elif request in self.swapped:
            self.swapped.remove(request)
            self.memory.release(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _chunk(self, request: Request, budget: int, plan: Plan) -> int:
        """Tokens ``request`` feeds this step (0: none): a chunk of the budget, or with chunked prefill
        off (eviction policies compress a whole prompt) its whole prompt, alone in a step if need be."""
        if self.chunked_prefill or request.remaining <= budget:
            return min(request.remaining, budget)
        return 0 if plan else request.remaining

    def _run(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.preemptions += 1
        request.status = self.memory.preempt(request)
        if request.status is RequestStatus.SWAPPED:
            self.swapped.append(request)
        else:
            self.waiting.appendleft(request)
