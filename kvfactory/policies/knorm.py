"""K-norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression").

Keys with a small L2 norm tend to receive high attention, so the lowest-norm keys are kept; needs
no queries, only the stored keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.policies.base import Observation, Policy


@dataclass
class KnormPolicy(Policy):
    """Keep the keys of lowest L2 norm."""

    def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
        return -torch.linalg.vector_norm(obs.keys.float(), dim=-1)
