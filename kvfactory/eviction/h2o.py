"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs").

A few "heavy hitter" tokens collect most of the attention over the whole generation; H2O keeps the
tokens with the largest accumulated attention (summed over every query that has seen them) plus a
window of the most recent tokens, ``recent_fraction`` of the budget (the paper splits it in half),
per KV head. kvpress has no H2O press: its ``ObservedAttentionPress`` ("related to H2O") ranks by the
*mean* attention a token received over the queries that saw it and keeps no recent window, so it
favours late tokens and is a different method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.errors import ConfigError
from kvfactory.eviction.base import Observation, Policy, protect_last


@dataclass
class H2OPolicy(Policy):
    """Heavy hitters by accumulated attention, plus recent tokens."""

    recent_fraction: float = 0.5

    accumulates = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.recent_fraction <= 1.0:
            raise ConfigError("recent_fraction", self.recent_fraction, "a fraction of the budget in [0, 1]")

    def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
        return protect_last(accumulated.clone(), int(kept * self.recent_fraction), obs.valid)
