"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You Are Looking for Before Generation").

The last ``window_size`` queries of the prompt (the observation window, where the question sits)
already attend to what generation will need: each earlier token is scored by the attention of
those queries, averaged, smoothed by average pooling over ``kernel_size`` neighbours (so clusters
stay whole) and averaged over the query heads of its KV head; the window itself is always kept.
``window_size`` 64 and ``kernel_size`` 5 are kvpress's defaults (and those of the reference code's
``SnapKVCluster``, whose model patch defaults to a 32-token window). With the question inside the
compressed prompt the window holds the question (26 tokens of the needle prompt) and the text before
it; fed after the compressed context, the window is context only.
Scores a prefill (or a chunk of one); it does not score single decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kvfactory.errors import ConfigError
from kvfactory.eviction.base import Observation, Policy, check_positive, protect_last


@dataclass
class SnapKVPolicy(Policy):
    """Pooled attention of an observation window of the last queries."""

    window_size: int = 64
    kernel_size: int = 5

    decodes = False

    def __post_init__(self) -> None:
        check_positive("window_size", self.window_size)
        check_positive("kernel_size", self.kernel_size)
        if self.kernel_size % 2 == 0:
            raise ConfigError("kernel_size", self.kernel_size, "an odd integer (a centred pooling window)")

    def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
        b, hq, t = obs.queries.shape[0], obs.queries.shape[1], obs.keys.shape[2]
        window = min(self.window_size, obs.queries.shape[2], t - 1)  # short prompts: a shorter window
        weights = obs.attention(window)[..., :t - window].mean(2)  # [B, Hq, T - window]
        pooled = F.avg_pool1d(weights.reshape(b * hq, 1, -1), self.kernel_size, stride=1,
                              padding=self.kernel_size // 2).view(b, hq, -1)
        scores = torch.cat([obs.per_kv_head(pooled), pooled.new_zeros(b, obs.keys.shape[1], window)], -1)
        return protect_last(scores, window, obs.valid)
