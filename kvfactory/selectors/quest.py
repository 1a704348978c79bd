"""Quest: read the pages whose keys could score highest against the query.

Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference". For a
page with per-channel key bounds ``[m, M]``, ``sum_c max(q_c m_c, q_c M_c)`` is an upper bound of
``q · k`` over its keys; pages are ranked by it. Quest is written for one query head per KV head;
with grouped queries a page's score is the largest bound over the KV head's query heads (and the
step's queries), so a page any of them may need stays in the running.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.pages import PageBases, best_dot


@dataclass
class QuestSelector(Selector):
    """Training-free: needs only the page key bounds (no hyperparameters of its own)."""

    def page_scores(self, queries: torch.Tensor, bases: PageBases, context: RoutingContext) -> torch.Tensor:
        bounds = bases.bounds  # [B, Hkv, pages, 2D]: max then min per channel
        split = torch.cat([queries.clamp(min=0), queries.clamp(max=0)], -1)  # q+ meets the max, q- the min
        return best_dot(split, bounds)
