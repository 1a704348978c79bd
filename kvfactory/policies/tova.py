"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs").

Token Omission Via Attention: keep the tokens the current query attends to most, its weights
averaged over every head of the layer (one choice for all heads, as in the paper); the newest token
is always kept. At decode it drops the least attended token each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.policies.base import Observation, Policy, protect_last


@dataclass
class TOVAPolicy(Policy):
    """The last query's attention, averaged over heads."""

    def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
        weights = obs.attention(1)[:, :, 0].mean(1, keepdim=True)  # [B, 1, T]
        return protect_last(weights.expand(-1, obs.keys.shape[1], -1).clone(), 1, obs.valid)
