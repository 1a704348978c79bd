"""Sliding window with optional attention sinks: keep the first ``n_sink`` and the most recent tokens.

"Keep the first N and the last M" is this policy with ``n_sink = N`` and a budget of ``N + M``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.errors import ConfigError
from kvfactory.eviction.base import Observation, Policy, check_positive


@dataclass
class WindowPolicy(Policy):
    """The most recent tokens, plus the ``n_sink`` oldest ones."""

    n_sink: int = 0

    def __post_init__(self) -> None:
        check_positive("n_sink", self.n_sink, minimum=0)

    def check_budget(self, budget: int) -> None:
        """The budget holds the sinks and at least one recent token."""
        if self.n_sink >= budget:
            raise ConfigError("n_sink", self.n_sink, f"fewer than budget={budget} tokens: a budget keeps the "
                              f"n_sink first tokens and at least one recent one (the first N and the last M "
                              f"is n_sink: N, budget: N + M)")

    def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
        b, h, t, _ = obs.keys.shape
        order = torch.arange(t, device=obs.keys.device, dtype=torch.float32).expand(b, h, t)
        valid = obs.valid if obs.valid is not None else order.new_ones((b, h, t), dtype=torch.bool)
        sinks = valid & (valid.cumsum(-1) <= self.n_sink)  # the first real tokens, after any padding
        return order + sinks * t  # sinks above every recent token
