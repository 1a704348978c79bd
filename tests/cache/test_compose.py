"""``kvfactory.compose``: the one place a layer's store is built, in the order storage -> quantization ->
eviction -> sparse read, with the storage options the layers above need set when storage is built;
and the capabilities stores declare instead of being probed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from tiny_models import tiny_config

from kvfactory import ConfigError, DenseStore, KVCacheFactory, LayerStore, PagedStore
from kvfactory.compose import LayerContext, compose_layer, eviction_slack, storage_options
from kvfactory.config import parse_config
from kvfactory.eviction.store import EvictionStore
from kvfactory.quantization.store import QuantizedStore
from kvfactory.selectors.sparse import SparseStore
from kvfactory.storage.workspace import ReadWorkspace

PAGED = {"name": "paged", "page_size": 8}
INT4 = {"name": "quantized", "codec": "int4", "group_size": 8}
SNAPKV = {"name": "eviction", "policy": "snapkv", "compression_ratio": 0.5}
H2O = {"name": "eviction", "policy": "h2o", "budget": 32}
QUEST = {"name": "quest", "read_budget": 0.25}


def composite(*entries: dict) -> dict:
    return {"type": "composite", "strategies": list(entries)}


def stack(store: LayerStore) -> list[type]:
    """The store's classes from the top wrapper down to storage."""
    classes = [type(store)]
    while hasattr(store, "inner"):
        store = store.inner
        classes.append(type(store))
    return classes


@pytest.mark.parametrize(("config", "expected"), [
    ({"type": "dense"}, [DenseStore]),
    (composite(PAGED, INT4), [QuantizedStore, PagedStore]),
    (composite(PAGED, INT4, H2O), [EvictionStore, QuantizedStore, PagedStore]),
    (composite(INT4, {"name": "dense"}, SNAPKV), [EvictionStore, QuantizedStore, DenseStore]),
    (composite(QUEST, INT4, PAGED), [SparseStore, QuantizedStore, PagedStore]),
])
def test_layers_stack_in_one_order_whatever_the_entry_order(config: dict, expected: list[type]) -> None:
    factory = KVCacheFactory(tiny_config("llama"), config)
    for layer in factory.create_cache().layers:
        assert stack(layer.store) == expected


def test_sliding_layers_are_neither_evicted_nor_read_sparsely() -> None:
    config = parse_config(composite(PAGED, H2O))
    full = compose_layer(config, LayerContext(0, 2, window=None))
    sliding = compose_layer(config, LayerContext(1, 2, window=8))
    assert stack(full) == [EvictionStore, PagedStore] and stack(sliding) == [PagedStore]
    assert (full.layer_idx, sliding.layer_idx) == (0, 1)


def test_storage_is_built_for_the_layers_above_and_never_rewritten() -> None:
    """Quantized paged storage takes ``window`` blocks; quantized dense storage keeps at most one codec
    unit of headroom; evicting dense storage none beyond its slack: all set when storage is built."""
    quantized = parse_config(composite(PAGED, INT4))
    assert storage_options(quantized, unit=8) == {"page_size": 8, "kind": "window"}
    assert storage_options(quantized, unit=None) == {"page_size": 8}  # a full-precision layer
    dense = parse_config({"type": "dense", "reserve_tokens": 100, "quantization": "int4"})
    assert storage_options(dense, unit=32) == {"reserve_tokens": 32}
    bounded = parse_config(composite({"name": "dense"}, H2O))
    assert storage_options(bounded, unit=None) == {"growth": 1.0, "reserve_tokens": 16}
    store = compose_layer(quantized, LayerContext(0, 1, None, workspace=ReadWorkspace()))
    assert store.inner.kind == "window" and store.inner.page_size == 8
    plain = compose_layer(parse_config(composite(PAGED)), LayerContext(0, 1, None))
    assert plain.kind == "kv"


def test_eviction_slack_is_a_page_of_plain_paged_storage_unless_set() -> None:
    assert eviction_slack(parse_config(composite(PAGED, H2O)), quantized=False) == 8
    assert eviction_slack(parse_config(composite(PAGED, H2O)), quantized=True) == 16
    assert eviction_slack(parse_config(composite({"name": "dense"}, H2O)), quantized=False) == 16
    assert eviction_slack(parse_config(composite(PAGED, H2O | {"slack": 3})), quantized=False) == 3


def test_compose_only_options_are_not_config_options() -> None:
    with pytest.raises(ConfigError, match="kind"):
        parse_config({"type": "paged", "kind": "window"})


@dataclass(eq=False)
class KeepFirst(DenseStore):
    """A user strategy that evicts in ``retain``: declared ``evicts`` by overriding it."""

    first: int = 4

    def retain(self) -> None:
        if self.size() > self.first:
            self.keep(torch.arange(self.first))


def test_capabilities_are_declared_on_the_classes() -> None:
    assert not DenseStore.evicts and not PagedStore.evicts and not QuantizedStore.evicts
    assert KeepFirst.evicts and EvictionStore.evicts  # overriding retain declares it
    assert EvictionStore.observes_attention and SparseStore.observes_attention
    assert not DenseStore.observes_attention and not QuantizedStore.observes_attention
    plain = DenseStore()
    assert plain.peak_bytes() is None and plain.residual_report() is None
    assert plain.quantization_error() is None
    quantized = compose_layer(parse_config(composite(PAGED, INT4)), LayerContext(0, 1, None,
                                                                                 workspace=ReadWorkspace()))
    assert quantized.residual_report() is not None and set(quantized.quantization_error()) == {"key", "value"}


def test_wrappers_expose_only_declared_members_of_what_they_wrap() -> None:
    """No attribute forwarding: a wrapper answers its declared interface, the rest is ``inner``'s."""
    store = compose_layer(parse_config(composite(PAGED, H2O)), LayerContext(0, 1, None))
    with pytest.raises(AttributeError):
        store.block_ids  # noqa: B018 - PagedStore's, reached as store.inner.block_ids
    assert store.inner.block_ids() is None
    assert store.peak_bytes() == 0 and store.residual_report() is None


def test_a_pool_is_shared_only_by_paged_storage() -> None:
    paged = KVCacheFactory(tiny_config("llama"), {"type": "paged"})
    assert KVCacheFactory(tiny_config("llama"), {"type": "paged"}, pool=paged.pool).pool is paged.pool
    with pytest.raises(ConfigError, match="pool"):
        KVCacheFactory(tiny_config("llama"), {"type": "dense"}, pool=paged.pool)
    with pytest.raises(ConfigError, match="pool"):
        KVCacheFactory(tiny_config("llama"), {"type": "paged"}, pool=object())
