"""OVAL's co-occurrence locality: pages read together recently are likely read together again.

Pages selected in the same decode step over the last ``window`` (128) steps are counted
into a page-by-page graph, rebuilt every ``rebuild_every`` (100) steps and aggregated with one
GCN layer (Kipf & Welling, 2017): a page's score is mixed with the normalised sum of its
neighbours' scores, ``(1 - w) s + w D^-1/2 (A + I) D^-1/2 s``. The graph is over page positions
and summed over a cache's batch rows; with several processes (``torch.distributed`` initialised,
gloo on CPU) the counts are summed with ``all_reduce`` before each rebuild, so every process
routes with the same graph.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from kvfactory.selectors.pages import row_dots


class CooccurrenceGraph:
    """Counts of pages read in the same step; ``adjacency`` is the last rebuild's normalised graph,
    kept in float16 (every sparse layer reads it every step)."""

    def __init__(self, window: int = 128, rebuild_every: int = 100) -> None:
        self.window, self.rebuild_every = window, rebuild_every
        self._steps: deque[torch.Tensor] = deque(maxlen=window)  # per step: pages read (1-D indices)
        self._current = torch.zeros(0, dtype=torch.bool)  # pages read so far in this step
        self.steps = 0
        self.adjacency: torch.Tensor | None = None  # [P, P], symmetric normalised, self-loops included
        self.density = float("nan")  # non-zero off-diagonal fraction of the last rebuild's counts

    def record(self, pages: torch.Tensor) -> None:
        """Pages one layer read this step (any shape of page indices)."""
        pages = pages.flatten().cpu()
        needed = int(pages.max()) + 1 if pages.numel() else 0
        if needed > self._current.numel():
            grown = torch.zeros(max(needed, 2 * self._current.numel()), dtype=torch.bool)
            grown[:self._current.numel()] = self._current
            self._current = grown
        self._current[pages] = True

    def end_step(self) -> None:
        """Close the step: keep what it read, rebuild every ``rebuild_every`` steps."""
        if self._current.any():
            self._steps.append(self._current.nonzero().flatten())
            self._current.zero_()
        self.steps += 1
        if self.steps % self.rebuild_every == 0:
            self.rebuild()

    def counts(self) -> torch.Tensor:
        """``[P, P]`` co-reads over the window (summed over processes when distributed)."""
        pages = max((int(s.max()) + 1 for s in self._steps), default=0)
        if dist.is_available() and dist.is_initialized():
            size = torch.tensor([pages])
            dist.all_reduce(size, op=dist.ReduceOp.MAX)
            pages = int(size)
        reads = torch.zeros(len(self._steps), pages)
        for i, step in enumerate(self._steps):
            reads[i, step] = 1.0
        counts = reads.T @ reads
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        return counts

    def rebuild(self) -> None:
        counts = self.counts()
        pages = counts.shape[0]
        if pages == 0:
            return
        off = counts.clone().fill_diagonal_(0)
        self.density = float((off > 0).sum()) / max(pages * (pages - 1), 1)
        links = (counts > 0).float().fill_diagonal_(1.0)
        scale = links.sum(-1).rsqrt()
        self.adjacency = (scale[:, None] * links * scale[None, :]).half()  # read by every layer each step

    def aggregate(self, scores: torch.Tensor, weight: float) -> torch.Tensor:
        """One GCN step over ``scores [..., P]``: mixed with their neighbours' by ``weight``; pages the
        graph does not know yet (newer than the last rebuild) keep their own score."""
        if self.adjacency is None or weight == 0.0:
            return scores
        known = min(self.adjacency.shape[0], scores.shape[-1])
        head = scores[..., :known]
        rows = head.reshape(1, 1, -1, known)
        mixed = row_dots(rows, self.adjacency[None, None, :known, :known]).view(head.shape)  # A is symmetric
        return torch.cat([(1 - weight) * head + weight * mixed.to(scores.dtype), scores[..., known:]], -1)
