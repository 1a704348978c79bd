"""Quest: read the pages whose keys could score highest against the query.

Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference". For a
page with per-channel key bounds ``[m, M]``, ``sum_c max(q_c m_c, q_c M_c)`` is an upper bound of
``q · k`` over its keys; the paper ranks pages by it, for one query head per KV head.

Two departures, both measured on held-out books (SmolLM2, 6144 tokens, read budget 1/8,
``benchmarks/quest_scale.py``; ``docs/benchmarks.md``):

- ``bound_scale`` s ranks by ``q · c + s |q| · h``, with ``c`` the centre and ``h`` the half-width
  of each channel's range: s = 1 is Quest's bound. After RoPE, the fast-rotating channels of a
  16-token page span nearly ``±|k|`` on every page alike, so the full bound ranks pages mostly by a
  width they share; halving it (the default, s = 0.5) lets the channels that differ decide.
- ``aggregate`` joins the query heads of a KV head (and the step's queries). ``"max"`` keeps a
  page's best score, so a page any head may need stays in the running. ``"softmax"`` (the default)
  sums each head's softmax over the pages' scores (at attention's temperature ``1/sqrt(D)``): the
  attention share each head would give the page, so one head's clear favourite outranks a page
  that several heads rate as mediocre, and a head with flat scores spreads its vote thin.

Where the read budget is split by a layer profile (``layer_budgets.py``) that holds a bound scale
per layer, each layer ranks with its own, unless the config sets ``bound_scale`` or another
aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvfactory.errors import ConfigError
from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.pages import PageSummaries, best_dot, softmax_mass

if TYPE_CHECKING:
    from kvfactory.selectors.layer_budgets import LayerProfile

AGGREGATES = ("softmax", "max")


@dataclass
class QuestSelector(Selector):
    """Training-free: needs only the page key bounds. Ranks by its share plus twice the prompt's last
    queries' share by default (``SelectorSpec.prompt_weight``): the bounds of a page holding one
    needle token among 15 others rank it poorly, the question's attention does not."""

    prompt_weight: ClassVar[float] = 2.0

    bound_scale: float = 0.5  # 1: Quest's upper bound; below 1: ranges shrunk about their centres
    aggregate: str = "softmax"  # how a KV head's query heads combine: summed softmax, or the best score

    def __post_init__(self) -> None:
        if not 0.0 <= self.bound_scale <= 1.0:
            raise ConfigError("bound_scale", self.bound_scale, "a number in [0, 1] (1: Quest's bound)")
        if self.aggregate not in AGGREGATES:
            raise ConfigError("aggregate", self.aggregate, f"one of {', '.join(AGGREGATES)}")

    @classmethod
    def profiled_options(cls, options: dict[str, Any], profile: LayerProfile, layer: int) -> dict[str, Any]:
        """The profile's bound scale for ``layer`` (measured with the softmax aggregate), unless the
        config sets a scale or another aggregate."""
        scale = profile.bound_scale(layer)
        if scale is None or "bound_scale" in options or options.get("aggregate", cls.aggregate) != "softmax":
            return options
        return options | {"bound_scale": scale}

    def page_scores(self, queries: torch.Tensor, summaries: PageSummaries, context: RoutingContext
                    ) -> torch.Tensor:
        bounds = summaries.bounds  # [B, Hkv, pages, 2D]
        if self.aggregate == "max":
            return best_dot(queries, bounds, split=self.bound_scale)
        return softmax_mass(queries, bounds, queries.shape[-1] ** -0.5, split=self.bound_scale)

    def with_prompt(self, scores: torch.Tensor, prompt: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The best head's bounds taken as logits at attention's temperature; or the heads' summed
        softmax shares, whose sum ``S`` normalises them: ranked as ``scores + S · prompt``, the order
        of ``scores / S + prompt`` without a division."""
        if self.aggregate == "max":
            return (scores * head_dim ** -0.5).softmax(-1).add_(prompt)
        return torch.addcmul(scores, prompt, scores.sum(-1, keepdim=True))
