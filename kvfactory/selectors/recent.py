"""Recent: read the latest pages. A control baseline (a sliding window that drops nothing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.pages import PageSummaries


@dataclass
class RecentSelector(Selector):
    """Scores pages by position: the newest page scores highest."""

    reads_summaries: ClassVar[bool] = False

    def page_scores(self, queries: torch.Tensor, summaries: PageSummaries, context: RoutingContext
                    ) -> torch.Tensor:
        b, h = queries.shape[:2]
        return torch.arange(summaries.pages, device=queries.device, dtype=torch.float32).expand(b, h, -1)
