"""Quest: read the pages whose keys could score highest against the query.

Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference". For a
page with per-channel key bounds ``[m, M]``, ``sum_c max(q_c m_c, q_c M_c)`` is an upper bound of
``q · k`` over its keys; pages are ranked by it. Quest is written for one query head per KV head;
with grouped queries a page's score is the largest bound over the KV head's query heads (and the
step's queries), so a page any of them may need stays in the running.

``bound_scale`` s ranks by ``q · c + s |q| · h``, with ``c`` the centre and ``h`` the half-width of
each channel's range: s = 1 is Quest's bound. After RoPE, the fast-rotating channels of a 16-token
page span nearly ``±|k|`` on every page alike, so the full bound ranks pages mostly by a width they
share; halving it (the default, s = 0.5) lets the channels that differ decide. On held-out books
(SmolLM2, 6144 tokens, read budget 1/8, ``benchmarks/quest_scale.py``) that reads 0.833 of the
attention mass against the bound's 0.823 (the oracle's 0.882), and it keeps the passkey pages the
bound loses in layer 18 (``docs/benchmarks.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.errors import ConfigError
from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.pages import PageBases, best_dot


@dataclass
class QuestSelector(Selector):
    """Training-free: needs only the page key bounds."""

    bound_scale: float = 0.5  # 1: Quest's upper bound; below 1: ranges shrunk about their centres

    def __post_init__(self) -> None:
        if not 0.0 <= self.bound_scale <= 1.0:
            raise ConfigError("bound_scale", self.bound_scale, "a number in [0, 1] (1: Quest's bound)")

    def page_scores(self, queries: torch.Tensor, bases: PageBases, context: RoutingContext) -> torch.Tensor:
        return best_dot(queries, bases.bounds, split=self.bound_scale)  # bounds: [B, Hkv, pages, 2D]
