"""OVAL: learned page selection, scored against what each page keeps.

A router file holds one of three trained scorers (``files.py``, ``docs/sparse-reads.md``):

- ``"query"`` (``lowrank.LowRankScorer``, shipped as ``router = "embedded"`` for SmolLM2 and Gemma 3
  270M: a cache takes the one trained for its model): the step's own query
  at each layer, projected to a few learned channels, against int8 codes of every stored key in
  the same channels: an estimate of each page's attention mass from a quarter of Quest's bytes.
- ``"gate"`` (``gate.BlockGate``, SeerAttention's block gate, shipped as ``router =
  "embedded-gate"`` for both models): the step's queries of a KV head, joined into one gate query, against a
  learned embedding of each page's key summary.
- ``"prefetch"`` (``router.Router``, shipped as ``router = "embedded-prefetch"``): pages predicted
  from the decoder's last hidden state of the previous step (``RoutingContext.hidden``, handed over
  by ``kvfactory.cache.watch_hidden_states``, which kvfactory installs on the cache's first
  forward), known before the layer runs, so a slower tier could prefetch them.

``kvfactory oval train`` (``train.py``) trains any kind for any model, and chooses on held-out text
which routed layers Quest or recent pages read with a lower attention-output error; ``"mix": true``
reads those layers with them (the per-layer mix, ``files.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvfactory.errors import ConfigError
from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.oval.files import load_module
from kvfactory.selectors.oval.gate import BlockGate, GateShape
from kvfactory.selectors.oval.lowrank import LowRankScorer, LowRankShape
from kvfactory.selectors.oval.router import Router, RouterShape
from kvfactory.selectors.pages import PageSummaries

# The routers shipped with the package, per name; a cache takes the one trained for its model's shapes.
SHIPPED = {"embedded": ("smollm2_lowrank.safetensors", "gemma3_270m_lowrank.safetensors"),
           "embedded-gate": ("smollm2_gate.safetensors", "gemma3_270m_gate.safetensors"),
           "embedded-prefetch": ("smollm2_router.safetensors",)}
EMBEDDED = {name: files[0] for name, files in SHIPPED.items()}  # the embedded model's (SmolLM2's)


def _shipped_file(file: str) -> Path:
    return Path(str(resources.files("kvfactory.selectors.oval").joinpath(file)))


def router_path(name: str) -> Path:
    """A name of ``SHIPPED``: the router shipped under it for the embedded model; else a path."""
    if name in EMBEDDED:
        return _shipped_file(EMBEDDED[name])
    return Path(name)


def fits(shape: LowRankShape | RouterShape | GateShape, model_config: Any) -> bool:
    """Whether a router of ``shape`` scores this model: its KV heads, head size (and hidden size for a
    prefetch router), and layers that are full-attention layers of the model."""
    from kvfactory.cache import attention_layout

    config = model_config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full = {i for i, window in enumerate(attention_layout(model_config)) if window is None}
    hidden = getattr(shape, "hidden_size", config.hidden_size)
    wanted = (config.num_key_value_heads, head_dim, config.hidden_size)
    return (shape.kv_heads, shape.head_dim, hidden) == wanted and set(shape.layers) <= full


def shipped_router(name: str, model_config: Any) -> str:
    """The path of the router shipped as ``name`` for this model (``SHIPPED``); ``ConfigError`` naming
    the command that trains one where none fits."""
    for file in SHIPPED[name]:
        path = str(_shipped_file(file))
        if fits(load_router(path).shape, model_config):
            return path
    trained = sorted(load_router(str(_shipped_file(file))).shape.model for file in SHIPPED[name])
    config = model_config.get_text_config(decoder=True)
    raise ConfigError("router", name, f"a router trained for this model ({config.model_type}, "
                      f"{config.num_key_value_heads} KV heads): kvfactory ships {name!r} for "
                      f"{', '.join(trained)} only. Train one on text you will not evaluate on with "
                      f"`kvfactory oval train --model MODEL --text book.txt --val-text other.txt --out "
                      f"router.safetensors` and set \"router\": \"router.safetensors\"")


@dataclass
class RouterSlot:
    """The scorer every selector of one router file reads, held in one place so that a retrained
    scorer (``drift.DriftRetrainer``) replaces it for all of them with one assignment."""

    module: Router | LowRankScorer | BlockGate


def router_slot(path: str) -> RouterSlot:
    """One slot per file (and version of it), shared by every layer and cache that uses it."""
    return _router_slot(path, Path(path).stat().st_mtime_ns)


def load_router(path: str) -> Router | LowRankScorer | BlockGate:
    """The scorer in ``path`` as the selectors read it now (``router_slot``)."""
    return router_slot(path).module


@functools.lru_cache(maxsize=8)
def _router_slot(path: str, version: int) -> RouterSlot:
    router = load_module(path)
    router.requires_grad_(False)  # inference only
    return RouterSlot(router)


@dataclass
class OvalSelector(Selector):
    """``router``: a router file, ``"embedded"`` (the query scorer shipped for the embedded model),
    ``"embedded-gate"`` (the block gate shipped for it) or ``"embedded-prefetch"`` (the prefetch
    router shipped for it). ``mix``: read the layers the router file hands to Quest or recent pages
    with them. A prefetch router's positional decay is part of it (its weight is trained), always
    applied."""

    router: str = "embedded"
    mix: bool = False
    prompt_weight: ClassVar[float] = 2.0  # chosen on held-out book windows (docs/sparse-reads.md)
    _layer: int = field(default=0, init=False, repr=False)
    _slot: RouterSlot | None = field(default=None, init=False, repr=False, compare=False)  # on first use

    def __post_init__(self) -> None:
        if not isinstance(self.mix, bool):
            raise ConfigError("mix", self.mix, "true or false (read the layers the router file hands to "
                              "Quest or recent pages with them)")
        path = router_path(self.router)
        if not path.is_file():
            raise ConfigError("router", self.router, f"one of {sorted(EMBEDDED)} or the path of a router "
                              f"file written by `kvfactory oval train`")

    @classmethod
    def options_for_model(cls, options: dict[str, Any], model_config: Any) -> dict[str, Any]:
        """A shipped router's name resolved to the file trained for this model (``shipped_router``)."""
        router = options.get("router", cls.router)
        return options | {"router": shipped_router(router, model_config)} if router in SHIPPED else options

    @classmethod
    def layer_selectors(cls, options: dict[str, Any], layers: tuple[int, ...]) -> dict[int, str]:
        """With ``mix``, the layers the router file hands to another selector (``files.py``)."""
        if not options.get("mix", cls.mix):
            return {}
        handed = load_router(str(router_path(options.get("router", cls.router)))).layer_selectors
        return {layer: name for layer, name in handed.items() if layer in layers}

    @property
    def uses_mean(self) -> bool:  # routers that embed pages embed the page's mean key too
        return self.loaded_router.embeds_pages

    def bind(self, layer_idx: int, num_layers: int) -> None:
        self._layer = layer_idx

    @property
    def slot(self) -> RouterSlot:
        """The slot of this selector's router file (read from the file once, shared by ``router_slot``)."""
        if self._slot is None:
            self._slot = router_slot(str(router_path(self.router)))
        return self._slot

    @property
    def loaded_router(self) -> Router | LowRankScorer | BlockGate:
        """The scorer as it is now: each layer's scoring reads it once (a retrained one may replace it)."""
        return self.slot.module

    @torch.no_grad()
    def page_scores(self, queries: torch.Tensor, summaries: PageSummaries, context: RoutingContext
                    ) -> torch.Tensor:
        """The scores of the router file's kind (``SCORING``)."""
        router = self.loaded_router
        return self.SCORING[router.kind](self, router, queries, summaries, context)

    def _query_scores(self, scorer: LowRankScorer, queries: torch.Tensor, summaries: PageSummaries,
                      context: RoutingContext) -> torch.Tensor:
        self._check_shape(queries.shape[1], queries.shape[-1])
        if queries.shape[2] % scorer.group:
            raise ConfigError("router", self.router, f"a router for {queries.shape[2]} query rows per KV "
                              f"head (this one was trained for {scorer.group} query heads per KV head, "
                              f"{scorer.shape.model}): train one with `kvfactory oval train`")
        return scorer.page_log_mass(queries, summaries.codes, self._layer, summaries.page_size)

    def _gate_scores(self, gate: BlockGate, queries: torch.Tensor, summaries: PageSummaries,
                     context: RoutingContext) -> torch.Tensor:
        self._check_shape(queries.shape[1], queries.shape[-1])
        return gate.score_pages(queries, summaries.embedded, self._layer)

    def _prefetch_scores(self, router: Router, queries: torch.Tensor, summaries: PageSummaries,
                         context: RoutingContext) -> torch.Tensor:
        if context.hidden is None:
            raise RuntimeError("OVAL routes from the decoder's last hidden state, which this cache never "
                               "received: its model ran outside transformers' decoder forward; call "
                               "kvfactory.watch_hidden_states(model) once")
        if context.hidden.shape[-1] != router.shape.hidden_size:
            raise ConfigError("router", self.router, f"a router for hidden size {context.hidden.shape[-1]} "
                              f"(this one was trained for {router.shape.hidden_size}, "
                              f"{router.shape.model}): train one with `kvfactory oval train`")
        queries = context.remember(("oval", id(router)), lambda: router.routing_queries(context.hidden))
        group = router.shape.group_of(self._layer)
        pages = summaries.pages
        positional = context.remember("oval.decay", lambda: router.positional(pages, queries.device))
        return router.logits(queries[:, group], summaries.embedded, positional)

    # how each kind of router file scores a decode step's pages (its ``kind``, ``files.py``)
    SCORING: ClassVar[dict[str, Callable[..., torch.Tensor]]] = {
        "query": _query_scores, "gate": _gate_scores, "prefetch": _prefetch_scores}

    def with_prompt(self, scores: torch.Tensor, prompt: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The query scorer's log page shares, or the prefetch router's logits, as shares."""
        return scores.float().softmax(-1).add_(prompt)

    def _check_shape(self, kv_heads: int, head_dim: int) -> None:
        shape = self.loaded_router.shape
        if kv_heads != shape.kv_heads or head_dim != shape.head_dim:
            raise ConfigError("router", self.router, f"a router for {kv_heads} KV heads of {head_dim} "
                              f"channels (this one was trained for {shape.kv_heads} of {shape.head_dim}, "
                              f"{shape.model}): train one with `kvfactory oval train`")

    def token_codes(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        router = self.loaded_router
        if not router.encodes_keys:
            return None
        router.shape.index_of(self._layer)  # a layer it was not trained for is refused at create_cache()

        def encode(keys: torch.Tensor) -> torch.Tensor:
            self._check_shape(keys.shape[1], keys.shape[-1])
            return self.loaded_router.encode(keys, self._layer)  # a retrained scorer keeps the key side
        return encode

    def page_embedding(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        router = self.loaded_router
        if not router.embeds_pages:
            return None
        router.shape.index_of(self._layer)  # a layer it was not trained for is refused at create_cache()

        def embed(features: torch.Tensor) -> torch.Tensor:
            self._check_shape(features.shape[1], features.shape[-1] // 3)
            return self.loaded_router.embed_pages(features, self._layer)
        return embed
