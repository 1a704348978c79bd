"""Quest: read the pages whose keys could score highest against the query.

Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference". For a
page with per-channel key bounds ``[m, M]``, ``sum_c max(q_c m_c, q_c M_c)`` is an upper bound of
``q · k`` over its keys; the paper ranks pages by it and reads the best under a token budget. With
grouped-query attention a KV head's pages are read for all its query heads, so a page scores the
best bound of any of them (still an upper bound of every query head's ``q · k``).

Beyond the paper, two options of every sparse cache apply (``SelectorSpec``, defaults chosen on
held-out books, ``docs/sparse-reads.md``): ``prompt_weight`` (Quest's default 2) and
``layer_budgets``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.pages import PageSummaries, best_dot


@dataclass
class QuestSelector(Selector):
    """Training-free: needs only the page key bounds. Ranks by its share plus twice the prompt's last
    queries' share by default (``SelectorSpec.prompt_weight``): the bounds of a page holding one
    needle token among 15 others rank it poorly, the question's attention does not."""

    prompt_weight: ClassVar[float] = 2.0

    def page_scores(self, queries: torch.Tensor, summaries: PageSummaries, context: RoutingContext
                    ) -> torch.Tensor:
        return best_dot(queries, summaries.bounds, bound=True)

    def with_prompt(self, scores: torch.Tensor, prompt: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The best head's bounds taken as logits at attention's temperature."""
        return (scores * head_dim ** -0.5).softmax(-1).add_(prompt)
