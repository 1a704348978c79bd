"""The selector interface: score a layer's pages for one decode step, read the best.

A selector is a dataclass whose fields are its hyperparameters. ``page_scores`` sees the step's
queries grouped by KV head, the layer's page summaries (``kvfactory.selectors.pages``) and what the
cache's selectors share (``RoutingContext``: the decoder's last hidden state, per-step memos) and
returns one score per page and KV head, higher = read; ``kvfactory.selectors.sparse.SparseStore``
always adds the sink and local pages and reads the top-scoring rest up to the read budget.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvfactory.selectors.pages import PageSummaries


@dataclass
class RoutingContext:
    """What the selectors of one cache share. ``hidden`` ``[B, hidden_size]`` is the decoder's last
    hidden state of the previous forward (the state that produced the token now decoded), set by
    ``kvfactory.cache.watch_hidden_states``; ``remember`` computes a value once per step for all layers."""

    hidden: torch.Tensor | None = None
    _memo: dict[Any, tuple[torch.Tensor | None, Any]] = field(default_factory=dict)

    def remember(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed again only when ``hidden`` has changed (a new step)."""
        entry = self._memo.get(key)
        if entry is None or entry[0] is not self.hidden:
            entry = self.hidden, make()
            self._memo[key] = entry
        return entry[1]


@dataclass
class Selector(ABC):
    """Scores pages of one layer; one instance per layer store."""

    reads_all: ClassVar[bool] = False  # True: decode reads every page whatever the budget
    reads_summaries: ClassVar[bool] = True  # scoring reads the page summaries (counted in the bytes read)
    uses_mean: ClassVar[bool] = False  # the page summaries keep each page's mean key
    prompt_weight: ClassVar[float] = 0.0  # ``SelectorSpec.prompt_weight`` where the config leaves it unset

    @classmethod
    def options_for_model(cls, options: dict[str, Any], model_config: Any) -> dict[str, Any]:
        """The options this selector runs with on ``model_config``'s model (a name it resolves per
        model, as OVAL's shipped routers); called once by the factory."""
        return options

    @classmethod
    def layer_selectors(cls, options: dict[str, Any], layers: tuple[int, ...]) -> dict[int, str]:
        """Routed ``layers`` this selector, with ``options`` (after ``options_for_model``), hands to
        another selector, by its registry name (OVAL's per-layer mix); none by default."""
        return {}

    def bind(self, layer_idx: int, num_layers: int) -> None:  # noqa: B027 - an optional hook
        """Called once by the factory: which model layer this selector serves."""

    def page_embedding(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A map of page features ``[B, Hkv, n, F]`` to the ``[B, Hkv, n, E]`` this selector scores, for
        the summaries to keep up to date (``PageSummaries.set_embedding``); None: it reads the features."""
        return None

    def token_codes(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A map of keys ``[B, Hkv, n, D]`` to per-token codes ``[B, Hkv, n, C]`` this selector scores,
        for the summaries to keep (``PageSummaries.set_token_codes``); None: it keeps none."""
        return None

    def with_prompt(self, scores: torch.Tensor, prompt: torch.Tensor, head_dim: int) -> torch.Tensor:
        """``scores [..., P]`` from ``page_scores`` (queries of ``head_dim`` channels) ranked with
        ``prompt [..., P]``, the prompt's weighted shares of those pages (``SelectorSpec.prompt_weight``):
        in the order of the selector's own shares of the step's attention over the pages (summing
        to 1) plus ``prompt``. By default the scores are logits."""
        return scores.float().softmax(-1).add_(prompt)

    @abstractmethod
    def page_scores(self, queries: torch.Tensor, summaries: PageSummaries, context: RoutingContext
                    ) -> torch.Tensor:
        """``queries [B, Hkv, R, D]`` (the query heads of each KV head, after RoPE) against the
        ``summaries.pages`` stored pages: ``[B, Hkv, pages]`` scores, higher = read."""
