"""One place composes a layer's store from a validated config: storage → quantization → eviction →
sparse read.

Each layer wraps the one below it and adds one concern: quantization packs what storage holds,
eviction decides which stored tokens stay, a selector decides which pages a decode step reads. The
order is fixed because each needs the one below: a selector reads pages (of plain or quantized
storage), eviction keeps tokens of whatever stores them, and quantized pages live in the storage's
pool. No wrapper changes the options of the store it wraps: what a layer needs of storage is asked
for here, when storage is built (``storage_options``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvfactory.codecs.calibration import FirstUseScales
from kvfactory.config import CacheConfig
from kvfactory.eviction.store import EvictionStore
from kvfactory.quantization.store import QuantizedStore
from kvfactory.selectors.base import RoutingContext
from kvfactory.selectors.metrics import RoutingMetrics
from kvfactory.selectors.sparse import SparseStore
from kvfactory.selectors.spec import SelectorSpec
from kvfactory.storage.base import LayerStore
from kvfactory.storage.blocks import GroupTables, PagedPool
from kvfactory.storage.dense import DenseStore
from kvfactory.storage.paged import PagedStore
from kvfactory.storage.workspace import ReadWorkspace


@dataclass
class LayerContext:
    """What one layer's store is built with besides the config: its place in the model and what the
    cache's layers share."""

    layer_idx: int
    num_layers: int
    window: int | None  # sliding-window size, None for full attention
    pool: PagedPool | None = None  # the factory's shared pool (paged storage)
    workspace: ReadWorkspace | None = None  # quantized reads decode into it
    selector: SelectorSpec | None = None  # this layer's selector spec (its share of the read budget)
    routing: RoutingMetrics | None = None
    routing_context: RoutingContext | None = None
    tables: GroupTables | None = None  # the cache's block tables of the layer's group, None for a layer alone
    first_use: FirstUseScales | None = None  # the factory's first-use scales (quantization calibrate)


def storage_options(config: CacheConfig, unit: int | None) -> dict[str, Any]:
    """The storage entry's options, plus what the layers above need of storage. ``unit``: the tokens
    per codec unit of a quantized layer, None for a full-precision one. Quantized storage keeps only
    its full-precision window there (paged blocks of kind ``window``, dense headroom of at most one
    unit); a bounded (evicting) dense layer needs no growth headroom beyond its slack."""
    options = dict(config.storage.options)
    cls = config.storage.cls
    if unit is not None and issubclass(cls, PagedStore):
        options["kind"] = "window"
    if issubclass(cls, DenseStore):
        reserve = options.get("reserve_tokens", DenseStore.reserve_tokens)
        if unit is not None:
            options["reserve_tokens"] = min(reserve, unit)
        elif config.eviction is not None:
            options["growth"] = 1.0
            options["reserve_tokens"] = min(reserve, config.eviction.slack_for(None))
    return options


def eviction_slack(config: CacheConfig, quantized: bool) -> int:
    """Tokens decoded between evictions: one page over a plain paged layer unless the entry sets it."""
    paged = issubclass(config.storage.cls, PagedStore) and not quantized
    page_size = config.storage.options.get("page_size", PagedStore.page_size) if paged else None
    return config.eviction.slack_for(page_size)


def compose_layer(config: CacheConfig, layer: LayerContext) -> LayerStore:
    """The store of one layer, bound to it and attached to the pool. Sliding-window layers are bounded
    by their window: they are neither evicted nor read sparsely."""
    quantization = config.quantization
    codecs = None if quantization is None else quantization.codecs(layer.layer_idx, layer.num_layers,
                                                                   layer.first_use)
    unit = None if codecs is None else math.lcm(codecs[0].unit, codecs[1].unit)
    store = config.storage.cls(**storage_options(config, unit))
    if layer.tables is not None:
        store.share_blocks(layer.tables)
    if codecs is not None:
        residual = quantization.residual_for(quantization.codec_name(layer.layer_idx, layer.num_layers))
        store = QuantizedStore(store, *codecs, residual, layer.workspace, tables=layer.tables)
    if config.eviction is not None and layer.window is None:
        store = EvictionStore(store, config.eviction.build_policy(), config.eviction, layer.num_layers,
                              eviction_slack(config, quantized=codecs is not None))
    if layer.selector is not None and layer.window is None:
        store = SparseStore(store, layer.selector.build_selector(), layer.selector, layer.routing,
                            layer.routing_context, layer.num_layers)
    store.bind(layer.layer_idx)
    if layer.pool is not None:
        store.attach(layer.pool)
    return store
