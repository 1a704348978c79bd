"""OVAL: pages chosen by a trained router from the decoder's state, scored against page summaries.

``OvalSelector`` scores each layer's pages with ``router.Router`` from the decoder's last hidden
state of the previous step (``RoutingContext.hidden``, handed over by
``kvfactory.cache.watch_hidden_states``, which kvfactory installs on the cache's first forward). The
router for the embedded model ships in this package (``router = "embedded"``); ``kvfactory oval
train`` (``train.py``) trains one for any model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import ClassVar

import torch

from kvfactory.errors import ConfigError
from kvfactory.selectors.base import RoutingContext, Selector
from kvfactory.selectors.oval.router import Router
from kvfactory.selectors.pages import PageSummaries

EMBEDDED_ROUTER = "smollm2_router.safetensors"


def router_path(name: str) -> Path:
    """``"embedded"``: the shipped router of the embedded model; else a file path."""
    if name == "embedded":
        return Path(str(resources.files("kvfactory.selectors.oval").joinpath(EMBEDDED_ROUTER)))
    return Path(name)


def load_router(path: str) -> Router:
    """One router per file (and version of it), shared by every layer and cache that uses it."""
    return _load_router(path, Path(path).stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_router(path: str, version: int) -> Router:
    router = Router.load(path)
    router.requires_grad_(False)  # inference only
    return router


@dataclass
class OvalSelector(Selector):
    """``router``: a router file or ``"embedded"``. The router's positional decay is part of the
    router (its weight is trained), always applied."""

    router: str = "embedded"
    uses_mean: ClassVar[bool] = True
    _layer: int = field(default=0, init=False, repr=False)
    _router: Router | None = field(default=None, init=False, repr=False, compare=False)  # on first use

    def __post_init__(self) -> None:
        path = router_path(self.router)
        if not path.is_file():
            raise ConfigError("router", self.router, "'embedded' or the path of a router file written by "
                              "`kvfactory oval train`")

    def bind(self, layer_idx: int, num_layers: int) -> None:
        self._layer = layer_idx

    @property
    def loaded_router(self) -> Router:
        """The router, read from its file once per selector (files are shared through ``load_router``)."""
        if self._router is None:
            self._router = load_router(str(router_path(self.router)))
        return self._router

    @torch.no_grad()
    def page_scores(self, queries: torch.Tensor, summaries: PageSummaries, context: RoutingContext
                    ) -> torch.Tensor:
        router = self.loaded_router
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

    def page_embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        router = self.loaded_router

        def embed(features: torch.Tensor) -> torch.Tensor:
            shape = router.shape
            if features.shape[1] != shape.kv_heads or features.shape[-1] != 3 * shape.head_dim:
                raise ConfigError("router", self.router, f"a router for {features.shape[1]} KV heads of "
                                  f"{features.shape[-1] // 3} channels (this one was trained for "
                                  f"{shape.kv_heads} of {shape.head_dim}, {shape.model}): train one with "
                                  f"`kvfactory oval train`")
            return router.embed_pages(features, shape.group_of(self._layer))
        return embed
