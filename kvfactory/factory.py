"""``KVCacheFactory``: one validated config in, transformers-compatible caches out."""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from kvfactory.cache import (
    KVCache,
    KVLayer,
    attention_layout,
    await_first_forward,
    use_kvfactory_attention,
)
from kvfactory.codecs.calibration import FirstUseScales
from kvfactory.compose import LayerContext, compose_layer
from kvfactory.config import CacheConfig, load_yaml, parse_config
from kvfactory.errors import ConfigError, UnknownSequenceError
from kvfactory.selectors.base import RoutingContext
from kvfactory.selectors.metrics import RoutingMetrics
from kvfactory.sizing import KVShape, bytes_per_token_per_layer
from kvfactory.spellings import PagedKVCacheConfig
from kvfactory.storage.base import LayerStore, PrefixLayout
from kvfactory.storage.blocks import GroupTables, PagedPool
from kvfactory.storage.forward_lock import ForwardLock
from kvfactory.storage.paged import PagedStore
from kvfactory.storage.workspace import ReadWorkspace

AnyConfig = dict[str, Any] | CacheConfig | PagedKVCacheConfig | None


class KVCacheFactory:
    """Builds caches for one model from one config.

    Caches created by one factory share its storage pool (for paged storage), so many sequences
    can live in one preallocated pool; pass ``pool=`` to share a pool across factories.
    ``default_config`` is the design article's name for ``cache_config``; ``free_cache(seq_id)``
    gives back the memory of the cache ``create_cache(seq_id)`` made.
    """

    def __init__(self, model_config: Any, cache_config: AnyConfig = None, pool: PagedPool | None = None, *,
                 default_config: AnyConfig = None):
        if default_config is not None:  # the design article's name for the config
            if cache_config is not None:
                raise ConfigError("default_config", "given", "cache_config or default_config, not both")
            cache_config = default_config
        self.model_config = model_config
        self.config = parse_config(cache_config)
        self._caches: weakref.WeakValueDictionary[str, KVCache] = weakref.WeakValueDictionary()
        self.windows = attention_layout(model_config)
        storage = self.config.storage
        if pool is None:
            pool = storage.cls.make_shared(storage.options, len(self.windows))
        elif not isinstance(pool, PagedPool) or not issubclass(storage.cls, PagedStore):
            raise ConfigError("pool", type(pool).__name__, "a PagedPool (another factory's .pool) shared by "
                              "paged storage")
        self.pool: PagedPool | None = pool
        shape = KVShape.from_config(model_config)
        if pool is not None:  # every write of every layer is checked against the model's shape
            pool.expect_layout(shape.kv_heads, shape.head_dim)
        # sizes are checked at half precision, the least a model's K/V take unquantized
        token_bytes = int(bytes_per_token_per_layer(shape, "fp16"))
        storage.cls.check_size(storage.options, token_bytes, len(self.windows))
        if self.config.quantization is not None:
            self.config.quantization.check_layers(len(self.windows))
        self.workspace = ReadWorkspace() if self.config.quantization is not None else None
        # calibrate: true: every cache of the factory encodes with the scales its first prefill fixes
        calibrate = self.config.quantization is not None and self.config.quantization.calibrate
        self.first_use = FirstUseScales(shape.kv_heads) if calibrate else None
        # caches of a factory (or of one pool) share memory: their forwards take turns
        self.forward_lock = pool.forward_lock if pool is not None else ForwardLock()
        # layers that hold the same tokens share blocks and one block table per sequence and block kind
        # (``groups``: the layers of one window size and codec); under eviction each layer keeps its own
        groupable = pool is not None and not storage.cls.evicts and self.config.eviction is None
        quantization = self.config.quantization
        codecs = [None if quantization is None else quantization.codec_name(i, len(self.windows))
                  for i in range(len(self.windows))]
        self.groups = layer_groups(list(zip(self.windows, codecs, strict=True))) if groupable \
            else [(i,) for i in range(len(self.windows))]
        selector = self.config.selector
        self.layer_selectors = {} if selector is None else selector.per_layer(model_config, [
            i for i, window in enumerate(self.windows) if window is None and i >= selector.dense_layers])

    @classmethod
    def from_yaml(cls, path: str | Path, model_config: Any, pool: PagedPool | None = None) -> KVCacheFactory:
        return cls(model_config, load_yaml(path), pool=pool)

    def create_cache(self, seq_id: str | None = None) -> KVCache:
        """A new, empty cache (a ``transformers.Cache``) for one sequence or batch; its layers' stores
        are composed by ``kvfactory.compose.compose_layer``."""
        config = self.config
        use_kvfactory_attention(self.model_config, config)
        context = RoutingContext() if config.selector is not None else None
        routing = RoutingMetrics() if config.selector is not None else None
        layers = [KVLayer(store, sliding_window=window)
                  for store, window in zip(self._stores(routing, context), self.windows, strict=True)]
        cache = KVCache(layers, shared=self.pool, seq_id=seq_id, config=config, workspace=self.workspace,
                        model_config=self.model_config, routing=routing, routing_context=context,
                        forward_lock=self.forward_lock, groups=self.groups)
        await_first_forward(cache)  # hooks the model it runs with (tokens written, OVAL's hidden state)
        if seq_id is not None:
            self._caches[seq_id] = cache
        return cache

    def free_cache(self, seq_id: str) -> None:
        """Give back the memory of the cache created for ``seq_id`` (``cache.free()``);
        ``UnknownSequenceError`` for an id with no live cache of this factory."""
        cache = self._caches.pop(seq_id, None)
        if cache is None:
            raise UnknownSequenceError(seq_id, list(self._caches))
        cache.free()

    def prefix_layout(self) -> PrefixLayout | None:
        """How a prefix cache shares this config's blocks between sequences (``LayerStore.prefix_layout``),
        None where it cannot (dense storage, eviction, layers whose blocks differ)."""
        stores = self._stores(RoutingMetrics(), RoutingContext()) if self.pool is not None else []
        return PrefixLayout.common([store.prefix_layout() for store in stores])

    def _stores(self, routing: RoutingMetrics | None, context: RoutingContext | None) -> list[LayerStore]:
        """A new store per layer (``kvfactory.compose.compose_layer``); a group's share one block table."""
        shared = {}
        for group in self.groups:
            tables = GroupTables(group) if len(group) > 1 else None
            shared.update({layer_idx: tables for layer_idx in group})
        return [compose_layer(self.config, LayerContext(
            layer_idx, len(self.windows), window, self.pool, self.workspace,
            self.layer_selectors.get(layer_idx, self.config.selector), routing, context, shared[layer_idx],
            self.first_use))
            for layer_idx, window in enumerate(self.windows)]


def layer_groups(kinds: list[Hashable]) -> list[tuple[int, ...]]:
    """Layers that hold the same tokens, by their first layer: those of one kind together (a layer's
    sliding window, ``None`` for full attention, as vLLM's KV-cache groups; with its codec, for the
    full-precision windows of quantized pages)."""
    groups: dict[Hashable, list[int]] = {}
    for layer_idx, kind in enumerate(kinds):
        groups.setdefault(kind, []).append(layer_idx)
    return sorted(tuple(layers) for layers in groups.values())
