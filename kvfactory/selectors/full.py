"""Full: read every page. The lossless baseline, with the same metrics as the sparse selectors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.pages import PageSummaries


@dataclass
class FullSelector(Selector):
    """Every page, every step: decode reads the whole layer and matches DynamicCache exactly."""

    reads_all: ClassVar[bool] = True

    def page_scores(self, queries: torch.Tensor, summaries: PageSummaries, context: RoutingContext
                    ) -> torch.Tensor:
        b, h = queries.shape[:2]
        return queries.new_zeros((b, h, summaries.pages))
