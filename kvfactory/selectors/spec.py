"""What a config asks of page selection: the selector, its read budget and what is always read.

In a composite config, after a paged storage entry: ``{"name": "quest", "read_budget": 0.125}``
(``full``, ``quest``, ``oval``, ``random``, ``recent``, or a registered selector), plus the
selector's own hyperparameters under their names. Every option, its default and the held-out
evidence for it: ``docs/sparse-reads.md``.

- ``read_budget`` (fraction of the stored pages a decode step reads, rounded up) or ``top_k``
  (pages per step); both count the always-read pages and default to ``read_budget: 0.125``.
- ``sink_pages`` (first pages) and ``local_pages`` (last pages, and always every page holding the
  step's new tokens) are read every step; the first ``dense_layers`` layers and prefills (more than
  ``kvfactory.attention.MAX_CHUNKED_QUERY`` new tokens) read everything.
- ``prompt_weight``: how much the attention the prompt's last 32 queries put on each page at
  prefill counts in each step's ranking (SnapKV's observation window, Li et al., 2024, "SnapKV:
  LLM Knows What You are Looking for Before Generation", used to steer reads, not to evict).
  Unset: the selector's default (Quest 2, the others 0).
- ``layer_budgets``: how the read budget is split between the routed layers (``layer_budgets.py``):
  ``"auto"`` (default) by the profile shipped for the embedded model when the model has its shape,
  else evenly; ``"uniform"`` evenly; or the path of a profile written by ``kvfactory selectors
  calibrate``. The mean over the layers stays ``read_budget``; with ``top_k`` every layer reads
  ``top_k``.
- ``shadow_every``: every so many decode steps each sparse layer also computes full attention to
  measure hit rate and attention-mass recall (0: never); telemetry, it changes no output.
- ``summary_dtype``: how the page summaries are stored, ``"float16"`` (default: half the bytes each
  step reads; maxima rounded up and minima down) or ``"float32"``.

Old spellings (``OLD_OPTIONS``) raise a ``ConfigError`` naming what to write instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvfactory.errors import ConfigError
from kvfactory.options import options_of, parse_spec
from kvfactory.selectors import SELECTORS, Selector
from kvfactory.selectors.layer_budgets import resolve

DEFAULT_READ_BUDGET = 0.125
SUMMARY_DTYPES = {"float16": torch.float16, "float32": torch.float32}


# options of earlier versions: what to write instead
OLD_OPTIONS = {
    "bases_dtype": "'summary_dtype' (renamed: page bases are page summaries)",
    "prompt_mix": "'prompt_weight' (one name for the prompt's term)",
    **dict.fromkeys(("dynamic_pages", "max_page", "entropy_jump"),
                    "nothing: dynamic pages were removed (they read less attention mass than fixed "
                    "pages, docs/sparse-reads.md)"),
    "prompt_window": "nothing: the prompt term reads the prompt's last 32 queries (no longer an option)",
    "aggregate": "nothing: Quest joins a KV head's query heads by their best bound, as the paper "
                 "(the softmax aggregate was removed, docs/sparse-reads.md)",
    "bound_scale": "nothing: Quest ranks by the paper's bound (the bound scale was removed, "
                   "docs/sparse-reads.md)",
    "layer_floor": "nothing: the per-layer split has no floor (no floor reads more on held-out books, "
                   "docs/sparse-reads.md)",
    "decay": "nothing: OVAL's positional decay is part of its router, always applied (switch removed)",
    **dict.fromkeys(("graph", "window", "rebuild_every"),
                    "nothing: OVAL's co-occurrence graph was removed (it measured no change in the harness, "
                    "docs/sparse-reads.md)"),
}


@dataclass(frozen=True)
class SelectorSpec:
    """A validated selector entry; ``build_selector()`` makes a fresh selector for one layer."""

    selector: str
    read_budget: float | None = None
    top_k: int | None = None
    sink_pages: int = 1
    local_pages: int = 1
    dense_layers: int = 2
    shadow_every: int = 32
    summary_dtype: str = "float16"
    layer_budgets: str = "auto"
    prompt_weight: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.read_budget is not None and self.top_k is not None:
            raise ConfigError("read_budget", self.read_budget, "one of read_budget and top_k, not both")
        if self.read_budget is not None and not 0.0 < self.read_budget <= 1.0:
            raise ConfigError("read_budget", self.read_budget, "a fraction of the stored pages in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError("top_k", self.top_k, "an integer >= 1 (pages read per step)")
        for key in ("sink_pages", "local_pages", "dense_layers", "shadow_every"):
            if getattr(self, key) < 0:
                raise ConfigError(key, getattr(self, key), "an integer >= 0")
        if self.summary_dtype not in SUMMARY_DTYPES:
            raise ConfigError("summary_dtype", self.summary_dtype, " or ".join(SUMMARY_DTYPES))
        if self.layer_budgets not in ("auto", "uniform") and not Path(self.layer_budgets).is_file():
            raise ConfigError("layer_budgets", self.layer_budgets,
                              "'auto', 'uniform' or a profile from `kvfactory selectors calibrate`")
        if self.top_k is not None and self.layer_budgets not in ("auto", "uniform"):
            raise ConfigError("layer_budgets", self.layer_budgets, "a profile with read_budget, not top_k")
        if self.prompt_weight is None:  # the selector's own default
            object.__setattr__(self, "prompt_weight", SELECTORS[self.selector].prompt_weight)
        weight = self.prompt_weight
        if weight is not None and not (math.isfinite(weight) and weight >= 0):
            raise ConfigError("prompt_weight", self.prompt_weight, "a number >= 0 (0: the selector alone)")
        self.build_selector()

    @classmethod
    def parse(cls, name: str, options: dict[str, Any], where: str = "") -> SelectorSpec:
        for key in options:
            if key in OLD_OPTIONS and key not in options_of(SELECTORS[name]):
                raise ConfigError(f"{where}{key}", options[key], OLD_OPTIONS[key])
        own = {k: hint for k, hint in options_of(cls).items() if k not in ("selector", "options")}
        return parse_spec(cls, name, options, own, options_of(SELECTORS[name]), where, "selector", "name")

    @property
    def summary_torch_dtype(self) -> torch.dtype:
        return SUMMARY_DTYPES[self.summary_dtype]

    def build_selector(self) -> Selector:
        return SELECTORS[self.selector](**self.options)

    def per_layer(self, model_config: Any, layers: Sequence[int]) -> dict[int, SelectorSpec]:
        """The spec each of the routed ``layers`` decodes with: the selector's options for this model
        (``Selector.options_for_model``), or the selector it hands the layer to
        (``Selector.layer_selectors``), and its share of the read budget under ``layer_budgets``."""
        if not layers:
            return {}
        spec = replace(self, options=SELECTORS[self.selector].options_for_model(self.options, model_config))
        handed = SELECTORS[self.selector].layer_selectors(spec.options, tuple(layers))
        # a layer handed to another selector takes that selector's defaults, and the same read budget
        by_layer = {layer: replace(spec, selector=handed[layer], options={}, prompt_weight=None)
                    if layer in handed else spec for layer in layers}
        profile = None if self.top_k is not None else resolve(self.layer_budgets, model_config)
        if profile is None:
            return by_layer
        split = profile.allocate(self.read_budget or DEFAULT_READ_BUDGET, layers)
        return {layer: replace(by_layer[layer], read_budget=budget, layer_budgets="uniform")
                for layer, budget in split.items()}

    def pages_to_read(self, pages: int) -> int:
        """Pages one decode step reads out of ``pages`` stored, always-read pages included."""
        if self.top_k is not None:
            wanted = self.top_k
        else:
            wanted = math.ceil((self.read_budget or DEFAULT_READ_BUDGET) * pages)
        return min(pages, max(wanted, self.sink_pages + self.local_pages))
