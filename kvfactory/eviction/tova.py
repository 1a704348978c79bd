"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs").

Token Omission Via Attention: keep the tokens the current query attends to most, its weights
averaged over every query head of the layer (one choice shared by all KV heads, as in the paper's
code). The newest token is always kept, as kvpress's ``TOVAPress`` does; the paper's code ranks it
with the others, but a token's attention to itself is usually high. With the question inside the
compressed prompt the current query is the question's last token, so the choice is query-aware; fed
after the compressed context (kvpress's pipeline) it is the context's last token. At decode it drops
the least attended token each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.eviction.base import Observation, Policy, protect_last


@dataclass
class TOVAPolicy(Policy):
    """The last query's attention, averaged over heads."""

    def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
        weights = obs.attention(1)[:, :, 0].mean(1, keepdim=True)  # [B, 1, T]
        return protect_last(weights.expand(-1, obs.keys.shape[1], -1).clone(), 1, obs.valid)
