"""Sliding window with optional attention sinks: keep the first ``n_sink`` and the most recent tokens.

"Keep the first N and the last M" is this policy with ``n_sink = N`` and a budget of ``N + M``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.eviction.base import Observation, Policy, check_positive


@dataclass
class WindowPolicy(Policy):
    """The most recent tokens, plus the ``n_sink`` oldest ones."""

    n_sink: int = 0

    def __post_init__(self) -> None:
        check_positive("n_sink", self.n_sink, minimum=0)

    def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
        b, h, t, _ = obs.keys.shape
        order = torch.arange(t, device=obs.keys.device, dtype=torch.float32).expand(b, h, t)
        valid = obs.valid if obs.valid is not None else order.new_ones((b, h, t), dtype=torch.bool)
        sinks = valid & (valid.cumsum(-1) <= self.n_sink)  # the first real tokens, after any padding
        return order + sinks * t  # sinks above every recent token
