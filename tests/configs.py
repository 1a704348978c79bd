"""The shared test matrix: every valid composition the factory accepts, one row each.

A row is a cache composition with two option sets, ``small`` (gentle: large pages, mild compression,
a wide full-precision window) and ``demanding`` (tight: small pages, strong compression, no window),
as kvpress's ``tests/default_presses.py`` lists each press with easy and hard kwargs. Each row
states what holds for it, written out here rather than read from the code, so a test fails when
behaviour silently changes:

- ``bound``: 0.0 for a lossless row (the same greedy tokens as ``DynamicCache`` and logits within
  ``helpers.LOGITS_ATOL`` in fp32, at every step, in every test); otherwise the largest logit
  difference from ``DynamicCache`` allowed at the steps before the tokens first differ, on the tiny
  random models in fp32 (about twice the largest difference measured on the matrix's prompts, which
  the hybrid Gemma 3 sets for codecs: int8 0.005, fp8 0.03, int4 0.07, int2 0.18, eviction and
  sparse reads 0.34);
- ``raises``: the operations it does not support, each with the exception and a fragment of its
  message; every other operation of ``OPERATIONS`` is supported;
- ``bytes_per_token``: what the stored tokens cost, ``"fp32"`` (plain K/V), a codec name (quantized
  tokens cost that codec's bytes, the full-precision window fp32), either with ``SUMMARIES`` added
  (page summaries on top, so more than that), or ``MIXED`` (layers of different precisions: less
  than fp32, something quantized);
- ``evicts``: whether it holds fewer tokens than it has seen after the matrix's prompt;
- ``kvfactory_attention``: whether ``create_cache()`` switches the model to kvfactory's attention.

Adding a strategy means adding one row here: every cross-cutting test (``test_matrix_*.py``)
parametrizes over ``CASES`` and runs each case on the tiny random models of ``MATRIX_ARCHS``: a llama
with full attention in both layers and a hybrid Gemma 3 (a sliding-window layer, then a full-attention
one: eviction and sparse reads apply to the second only). The ``FirstAndLast`` of docs/storage.md
goes through them that way below.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from helpers import tiny_router
from tiny_models import TINY_HIDDEN, tiny_config

from kvfactory import ConfigError, DenseStore, UnsupportedError, register_cache_strategy
from kvfactory.cache import attention_layout
from kvfactory.presets import load_preset


@dataclass(eq=False)
class FirstAndLast(DenseStore):
    """Keep the first `first` and the last `last` tokens (docs/storage.md's own-strategy example)."""

    first: int = 4
    last: int = 1024

    def retain(self) -> None:
        n = self.size()
        if n > self.first + self.last:
            self.keep(torch.cat([torch.arange(self.first), torch.arange(n - self.last, n)]))


register_cache_strategy("first_and_last", FirstAndLast)

OPERATIONS = FORK, PAUSE, SAVE, BEAMS, PADDED, MANAGER = (
    "fork", "pause/resume", "save/load", "beams", "left-padded", "manager")
SUMMARIES, MIXED = "+summaries", "mixed"
MATRIX_ARCHS = ("llama", "gemma3")
ROUTER = "<tiny OVAL router>"  # replaced by a router file for the tiny model's shapes (a query scorer)
PREFETCH_ROUTER = "<tiny OVAL prefetch router>"  # the same, a prefetch router
GATE_ROUTER = "<tiny OVAL gate>"  # the same, a block gate
ROUTER_KINDS = {ROUTER: "query", PREFETCH_ROUTER: "prefetch", GATE_ROUTER: "gate"}

# What a cache the manager does not take raises, and what a cache that cannot fork raises.
NOT_MANAGED = (ConfigError, "paged storage")
DENSE_FORK = (UnsupportedError, "DenseStore cannot be forked")
SPARSE_FORK = (UnsupportedError, "SparseStore cannot be forked")
DENSE = {FORK: DENSE_FORK, PAUSE: NOT_MANAGED, SAVE: NOT_MANAGED, MANAGER: NOT_MANAGED}
SPARSE_STATE = (UnsupportedError, "SparseStore cannot be paused or saved")
SPARSE = {FORK: SPARSE_FORK, PAUSE: SPARSE_STATE, SAVE: SPARSE_STATE}  # managed: sharing one pool


@dataclass(frozen=True)
class Row:
    """One composition and what holds for it (see the module docstring)."""

    id: str
    small: dict[str, Any]
    demanding: dict[str, Any]
    bound: float
    raises: dict[str, tuple[type[Exception], str]] = field(default_factory=dict)
    bytes_per_token: str = "fp32"
    evicts: bool = False
    kvfactory_attention: bool = False

    @property
    def lossless(self) -> bool:
        return self.bound == 0.0

    def supports(self, operation: str) -> bool:
        return operation not in self.raises

    def refuses(self, operation: str, attempt: Callable[[], object]) -> bool:
        """True after checking that ``attempt`` raises the exception this row states for ``operation``;
        False (nothing run) where the row supports it."""
        if self.supports(operation):
            return False
        error, match = self.raises[operation]
        with pytest.raises(error, match=match):
            attempt()
        return True

    def config(self, level: str, arch: str = "llama") -> dict[str, Any]:
        """The cache config at ``level`` ("small" or "demanding") for tiny model ``arch``, a fresh copy."""
        config = copy.deepcopy(getattr(self, level))
        for entry in config.get("strategies", []):
            if entry.get("router") in ROUTER_KINDS:
                kind = ROUTER_KINDS[entry["router"]]
                model_config = tiny_config(arch)
                full = tuple(i for i, window in enumerate(attention_layout(model_config)) if window is None)
                entry["router"] = tiny_router(TINY_HIDDEN, model_config.num_key_value_heads,
                                              model_config.head_dim, full, kind)
        return config


def composite(*entries: dict[str, Any], page_size: int | None = 4) -> dict[str, Any]:
    storage = {"name": "dense"} if page_size is None else {"name": "paged", "page_size": page_size}
    return {"type": "composite", "strategies": [storage, *entries]}


def quantized(name: str, storage: str, small: dict[str, Any], demanding: dict[str, Any], bound: float,
              bytes_per_token: str | None = None, **expect: Any) -> Row:
    """A quantized row over ``storage`` ("dense" or "paged": pages of 4, then 3 tokens)."""
    def config(options: dict[str, Any], page_size: int) -> dict[str, Any]:
        paging = {} if storage == "dense" else {"page_size": page_size}
        return {"type": storage, **paging, "quantization": options}
    return Row(f"{name}-{storage}", config(small, 4), config(demanding, 3), bound,
               raises=DENSE if storage == "dense" else {},
               bytes_per_token=name if bytes_per_token is None else bytes_per_token,
               kvfactory_attention=True, **expect)


def eviction(policy: str, budget: str, bound: float, page_size: int | None = 4,
             quantization: dict[str, Any] | None = None, **own: Any) -> Row:
    """An eviction row: ``policy`` by compression ratio (0.25, then 0.75) or by a token budget (16
    with the default slack, then 8 with none), its own hyperparameters ``own``."""
    small, demanding = ({"compression_ratio": 0.25}, {"compression_ratio": 0.75}) if budget == "ratio" \
        else ({"budget": 16}, {"budget": 8, "slack": 0})
    quantize = [] if quantization is None else [{"name": "quantized", **quantization}]
    window_off = [] if quantization is None else [{"name": "quantized", **quantization, "residual": 0}]
    codec = "" if quantization is None else f"+{quantization['codec']}"
    storage = "dense" if page_size is None else "paged"
    name = f"{policy}-{budget}" + ("" if storage == "paged" and not codec else f"-{storage}{codec}")
    return Row(name, composite(*quantize, {"name": "eviction", "policy": policy, **own, **small},
                               page_size=page_size),
               composite(*window_off, {"name": "eviction", "policy": policy, **own, **demanding},
                         page_size=None if page_size is None else 3),
               bound, raises=DENSE if page_size is None else {},
               bytes_per_token="fp32" if quantization is None else quantization["codec"], evicts=True,
               kvfactory_attention=True)


def selector(name: str, bound: float, quantization: dict[str, Any] | None = None, summaries: bool = True,
             variant: str = "", **own: Any) -> Row:
    """A selector row: reads half the pages per decode step (pages of 4), then a quarter (pages of 2);
    ``summaries``: it keeps per-page key summaries besides the K/V; ``variant`` names the row apart."""
    quantize = [] if quantization is None else [{"name": "quantized", **quantization}]
    window_off = [] if quantization is None else [{"name": "quantized", **quantization, "residual": 0}]
    entry = {"name": name, "dense_layers": 0, **own}  # the tiny models have 2 layers: route both
    return Row(name + variant + ("" if quantization is None else f"+{quantization['codec']}"),
               composite(*quantize, entry | {"read_budget": 0.5}),
               composite(*window_off, entry | {"read_budget": 0.25}, page_size=2), bound, raises=SPARSE,
               bytes_per_token=("fp32" if quantization is None else quantization["codec"])
               + (SUMMARIES if summaries else ""),
               kvfactory_attention=True)


def preset(name: str, bound: float, **expect: Any) -> Row:
    """A shipped preset as ``kvfactory eval --cache NAME`` loads it (one option set)."""
    config = load_preset(name)
    return Row(f"preset:{name}", config, config, bound, **expect)


KIVI_SMALL = {"residual": 8, "group_size": 8}
KIVI_DEMANDING = {"residual": 0, "group_size": 4}
KIVI_PAGES = {"residual": 4, "group_size": 4}  # quantized pages of 4 tokens: a selector has pages to choose

ROWS: list[Row] = [
    # storage
    Row("dense", {"type": "dense"}, {"type": "dense", "growth": 1.0, "reserve_tokens": 0}, 0.0, raises=DENSE),
    Row("paged", {"type": "paged", "page_size": 4}, {"type": "paged", "page_size": 1}, 0.0),
    # quantization
    quantized("int8", "dense", {"codec": "int8", "residual": 8}, {"codec": "int8"}, 0.01),
    quantized("int8", "paged", {"codec": "int8", "residual": 8}, {"codec": "int8"}, 0.01),
    quantized("fp8", "paged", {"codec": "fp8", "residual": 8}, {"codec": "fp8"}, 0.06),
    quantized("fp8_e5m2", "dense", {"codec": "fp8_e5m2", "residual": 8}, {"codec": "fp8_e5m2"}, 0.12),
    quantized("int4", "dense", {"codec": "int4", **KIVI_SMALL}, {"codec": "int4", **KIVI_DEMANDING}, 0.15),
    quantized("int4", "paged", {"codec": "int4", **KIVI_SMALL}, {"codec": "int4", **KIVI_DEMANDING}, 0.15),
    quantized("int2", "dense", {"codec": "int2", **KIVI_SMALL}, {"codec": "int2", **KIVI_DEMANDING}, 0.35),
    quantized("int2", "paged", {"codec": "int2", **KIVI_SMALL}, {"codec": "int2", **KIVI_DEMANDING}, 0.35),
    quantized("per-layer", "paged", {"layers": ["int8", "int4"], **KIVI_SMALL},
              {"layers": ["int2", "fp8"], **KIVI_DEMANDING}, 0.3, bytes_per_token=MIXED),
    quantized("full_precision", "dense", {"codec": "int4", "full_precision_first": 1, **KIVI_SMALL},
              {"codec": "int2", "full_precision_last": 1, **KIVI_DEMANDING}, 0.3,
              bytes_per_token=MIXED),
    # eviction: every registered policy by ratio and by budget over paged storage
    *(eviction(policy, budget, 0.7, **own)
      for policy, own in [("window", {"n_sink": 2}), ("streaming_llm", {"n_sink": 2}), ("h2o", {}),
                          ("snapkv", {"window_size": 4}), ("pyramidkv", {"window_size": 4, "beta": 2}),
                          ("tova", {}), ("knorm", {})]
      for budget in ("ratio", "budget")),
    eviction("h2o", "budget", 0.7, page_size=None),
    eviction("tova", "ratio", 0.7, page_size=None),
    eviction("snapkv", "budget", 0.7, quantization={"codec": "int4", **KIVI_SMALL}, window_size=4),
    eviction("h2o", "budget", 0.7, page_size=None, quantization={"codec": "int8"}),
    # selectors (sparse reads) over plain and quantized pages
    selector("full", 0.0, summaries=False),
    selector("quest", 0.7),
    selector("oval", 0.7, router=ROUTER),
    selector("oval", 0.7, router=PREFETCH_ROUTER, variant="-prefetch"),
    selector("oval", 0.7, router=GATE_ROUTER, variant="-gate"),
    selector("random", 0.7),
    selector("recent", 0.7),
    selector("full", 0.15, quantization={"codec": "int4", **KIVI_SMALL}, summaries=False),
    selector("quest", 0.7, quantization={"codec": "int4", **KIVI_PAGES}),
    selector("oval", 0.7, quantization={"codec": "int4", **KIVI_PAGES}, router=ROUTER),
    selector("random", 0.7, quantization={"codec": "int4", **KIVI_PAGES}),
    selector("recent", 0.7, quantization={"codec": "int4", **KIVI_PAGES}),
    selector("quest", 0.7, quantization={"codec": "int8"}),
    # eviction compresses the prompt, then a selector reads part of what it kept (RocketKV's two stages)
    Row("snapkv-ratio+quest",
        composite({"name": "eviction", "policy": "snapkv", "window_size": 4, "compression_ratio": 0.25},
                  {"name": "quest", "dense_layers": 0, "read_budget": 0.5}),
        composite({"name": "eviction", "policy": "snapkv", "window_size": 4, "compression_ratio": 0.75},
                  {"name": "quest", "dense_layers": 0, "read_budget": 0.25}, page_size=2),
        0.7, raises=SPARSE, bytes_per_token="fp32" + SUMMARIES, evicts=True, kvfactory_attention=True),
    # presets
    preset("dense", 0.0, raises=DENSE),
    preset("paged16", 0.0),
    preset("paged256", 0.0),
    preset("int8", 0.01, bytes_per_token="int8", kvfactory_attention=True),
    preset("fp8", 0.06, bytes_per_token="fp8", kvfactory_attention=True),
    # KIVI's 128-token full-precision window holds every prompt of the matrix: nothing is quantized yet
    preset("int4", 0.0, kvfactory_attention=True),
    preset("int2", 0.0, kvfactory_attention=True),
    preset("snapkv@0.5", 0.7, evicts=True, kvfactory_attention=True),
    # Quest reads its first 2 layers whole (dense_layers), every layer of the tiny models: lossless here
    preset("quest@0.25", 0.0, raises=SPARSE, kvfactory_attention=True),
    # a strategy defined in a test: docs/storage.md's FirstAndLast
    Row("first_and_last", {"type": "first_and_last", "first": 4, "last": 12},
        {"type": "first_and_last", "first": 1, "last": 4}, 0.7, evicts=True,
        raises=DENSE | {FORK: (UnsupportedError, "FirstAndLast cannot be forked")}),
]

BY_ID = {row.id: row for row in ROWS}
LEVELS = ("small", "demanding")
CASES = [(row, level) for row in ROWS for level in LEVELS if level == "small" or row.demanding != row.small]
CASE_IDS = [f"{row.id}/{level}" for row, level in CASES]
