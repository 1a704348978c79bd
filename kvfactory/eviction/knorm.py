"""K-norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression").

Keys with a small L2 norm tend to receive high attention, so the lowest-norm keys are kept in each
KV head; needs no queries, only the stored keys. Nothing is protected: with the question inside the
compressed prompt, its tokens (and the newest) stay only if their keys' norms are low.

By default every layer is compressed, as kvpress's ``KnormPress`` does. The paper's code
(``l2compress``) leaves the layers in ``skip_layers`` whole, because the norm-attention correlation
does not hold in the first layers (its README skips layers 0 and 1); ``skip_layers: [0, 1]`` does
the same here: those layers keep every token, prefill and decode, so the cache holds more than the
ratio says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.errors import ConfigError
from kvfactory.eviction.base import Observation, Policy


@dataclass
class KnormPolicy(Policy):
    """Keep the keys of lowest L2 norm (except in ``skip_layers``, which are not compressed)."""

    skip_layers: tuple[int, ...] | list[int] = ()

    def __post_init__(self) -> None:
        layers = self.skip_layers
        if not isinstance(layers, (tuple, list)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
            raise ConfigError("skip_layers", layers, "a list of layer indices (integers >= 0)")
        self.skip_layers = tuple(layers)

    def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
        return -torch.linalg.vector_norm(obs.keys.float(), dim=-1)

    def layer_budget(self, kept: int, stored: int, layer_idx: int, num_layers: int) -> int:
        return stored if layer_idx in self.skip_layers else kept
