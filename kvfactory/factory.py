"""``KVCacheFactory``: one validated config in, transformers-compatible caches out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfactory.cache import (
    KVCache,
    KVLayer,
    attention_layout,
    await_first_forward,
    use_kvfactory_attention,
)
from kvfactory.config import CacheConfig, load_yaml, parse_config
from kvfactory.eviction.store import EvictionStore
from kvfactory.quantization.store import QuantizedStore
from kvfactory.selectors.base import RoutingContext
from kvfactory.selectors.metrics import RoutingMetrics
from kvfactory.selectors.sparse import SparseStore
from kvfactory.sizing import KVShape
from kvfactory.storage.forward_lock import ForwardLock
from kvfactory.storage.workspace import ReadWorkspace


class KVCacheFactory:
    """Builds caches for one model from one config.

    Caches created by one factory share its storage pool (for paged storage), so many sequences
    can live in one preallocated pool; pass ``pool=`` to share a pool across factories.
    """

    def __init__(self, model_config: Any, cache_config: dict[str, Any] | CacheConfig | None = None,
                 pool: Any = None):
        self.model_config = model_config
        self.config = parse_config(cache_config)
        self.windows = attention_layout(model_config)
        storage = self.config.storage
        make_shared = getattr(storage.cls, "make_shared", None)
        if pool is None and make_shared is not None:
            pool = make_shared(storage.options, len(self.windows))
        self.pool = pool
        expect_layout = getattr(pool, "expect_layout", None)
        if expect_layout is not None:  # every write of every layer is checked against the model's shape
            shape = KVShape.from_config(model_config)
            expect_layout(shape.kv_heads, shape.head_dim)
        if self.config.quantization is not None:  # a per-layer codec list names every layer
            self.config.quantization.codec_name(0, len(self.windows))
        self.workspace = ReadWorkspace() if self.config.quantization is not None else None
        # caches of a factory (or of one pool) share memory: their forwards take turns
        self.forward_lock = getattr(pool, "forward_lock", None) or ForwardLock()
        selector = self.config.selector
        self.layer_selectors = {} if selector is None else selector.per_layer(model_config, [
            i for i, window in enumerate(self.windows) if window is None and i >= selector.dense_layers])

    @classmethod
    def from_yaml(cls, path: str | Path, model_config: Any, pool: Any = None) -> KVCacheFactory:
        return cls(model_config, load_yaml(path), pool=pool)

    def create_cache(self, seq_id: str | None = None) -> KVCache:
        """A new, empty cache (a ``transformers.Cache``) for one sequence or batch."""
        layers = []
        config = self.config
        quantization, eviction, selector = config.quantization, config.eviction, config.selector
        use_kvfactory_attention(self.model_config, config)
        context = RoutingContext() if selector is not None else None
        routing = RoutingMetrics(context) if selector is not None else None
        for layer_idx, window in enumerate(self.windows):
            store = self.config.storage.build()
            codecs = quantization.codecs(layer_idx, len(self.windows)) if quantization else None
            if codecs is not None:
                residual = quantization.residual_for(quantization.codec_name(layer_idx, len(self.windows)))
                store = QuantizedStore(store, *codecs, residual, self.workspace)
            if eviction is not None and window is None:  # sliding layers are bounded by their window
                store = EvictionStore(store, eviction.build_policy(), eviction, len(self.windows))
            if selector is not None and window is None:  # sliding layers read their window whole
                spec = self.layer_selectors.get(layer_idx, selector)
                store = SparseStore(store, spec.build_selector(), spec, routing, context, len(self.windows))
            store.bind(layer_idx)
            if self.pool is not None:
                store.attach(self.pool)
            layers.append(KVLayer(store, sliding_window=window))
        cache = KVCache(layers, shared=self.pool, seq_id=seq_id, config=self.config, workspace=self.workspace,
                        model_config=self.model_config, routing=routing, routing_context=context,
                        forward_lock=self.forward_lock)
        await_first_forward(cache)  # hooks the model it runs with (tokens written, OVAL's hidden state)
        return cache
