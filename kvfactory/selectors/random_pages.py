"""Random: read uniformly drawn pages. A control baseline: what a read budget gives without any signal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.pages import PageSummaries


@dataclass
class RandomSelector(Selector):
    """Draws fresh pages every step from its own generator (``seed``), so runs repeat."""

    reads_summaries: ClassVar[bool] = False

    seed: int = 0
    _generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._generator = torch.Generator().manual_seed(self.seed)

    def page_scores(self, queries: torch.Tensor, summaries: PageSummaries, context: RoutingContext
                    ) -> torch.Tensor:
        b, h = queries.shape[:2]
        return torch.rand((b, h, summaries.pages), generator=self._generator).to(queries.device)
