"""The factory: dict / YAML / composite configs, user strategies, the low-level cache API, shared pools."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from configs import FirstAndLast
from helpers import assert_same_generation, generate, layer_sizes
from tiny_models import random_prompt, tiny_config, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import Cache

import kvfactory
from kvfactory import (
    DenseStore,
    KVCache,
    KVCacheFactory,
    LayerIndexError,
    PagedPool,
    PagedStore,
    ShapeError,
    TensorTypeError,
)

MODEL_CONFIG = tiny_config("llama")  # 2 layers, 2 KV heads, head_dim 16
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def kv(tokens: int, batch: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=gen),
            torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=gen))


def stores(cache) -> list:
    return [layer.store for layer in cache.layers]


def used_blocks(pool: PagedPool) -> dict[int, int]:
    """Blocks in use per block pool, by its group's first layer (the layers of a group share blocks)."""
    return {p.layer_idx: p.num_blocks - len(p.free) for p in pool.block_pools()}


# -- configs in, caches out -----------------------------------------------------------------

@pytest.mark.parametrize(("cache_config", "store_type", "page_size"), [
    (None, DenseStore, None),
    ({"type": "dense"}, DenseStore, None),
    ({"type": "paged"}, PagedStore, 16),
    ({"type": "paged", "page_size": 4}, PagedStore, 4),
    ({"type": "composite", "strategies": [{"name": "paged", "page_size": 8}]}, PagedStore, 8),
    ({"type": "composite", "strategies": [{"name": "dense", "growth": 2.0}]}, DenseStore, None),
    ({"kv_cache_config": {"type": "paged", "page_size": 32}}, PagedStore, 32),
])
def test_dict_configs(cache_config, store_type, page_size) -> None:
    factory = KVCacheFactory(MODEL_CONFIG, cache_config)
    cache = factory.create_cache()
    assert isinstance(cache, Cache) and isinstance(cache, KVCache)
    assert len(cache.layers) == LAYERS
    assert all(type(s) is store_type for s in stores(cache))
    if page_size is not None:
        assert all(s.page_size == page_size for s in stores(cache))
        assert factory.pool.page_size == page_size
    else:
        assert factory.pool is None
    assert cache.get_seq_length() == 0


def test_composite_options_reach_the_store() -> None:
    cache = KVCacheFactory(MODEL_CONFIG, {"type": "composite", "strategies": [
        {"name": "dense", "growth": 2.0, "reserve_tokens": 0}]}).create_cache()
    assert all((s.growth, s.reserve_tokens) == (2.0, 0) for s in stores(cache))


@pytest.mark.parametrize(("text", "page_size"), [
    ("type: paged\npage_size: 16\n", 16),
    # the seed's wrapped form
    ("kv_cache_config:\n  type: composite\n  strategies:\n    - name: paged\n      page_size: 256\n", 256),
])
def test_from_yaml(tmp_path, text: str, page_size: int) -> None:
    path = tmp_path / "cache.yaml"
    path.write_text(text)
    model = tiny_model("llama")
    factory = KVCacheFactory.from_yaml(path, model.config)
    cache = factory.create_cache()
    assert all(isinstance(s, PagedStore) and s.page_size == page_size for s in stores(cache))
    factory_str = KVCacheFactory.from_yaml(str(path), model.config)  # str paths work too
    assert factory_str.config.storage.options == factory.config.storage.options
    inputs = {"input_ids": random_prompt(20), "attention_mask": torch.ones(1, 20, dtype=torch.long)}
    assert_same_generation(generate(model, inputs, DynamicCache(config=model.config)),
                           generate(model, inputs, cache))


def test_from_yaml_with_a_shared_pool(tmp_path) -> None:
    path = tmp_path / "cache.yaml"
    path.write_text("type: paged\npage_size: 8\n")
    first = KVCacheFactory.from_yaml(path, MODEL_CONFIG)
    second = KVCacheFactory.from_yaml(path, MODEL_CONFIG, pool=first.pool)
    assert second.pool is first.pool
    cache = second.create_cache()
    cache.append(0, *kv(9))
    assert used_blocks(first.pool) == {0: 2}  # allocated once for both layers of the group


# -- a user strategy registered by name: docs/storage.md's FirstAndLast (registered by configs.py) -----

def kept_positions(seen: int, first: int, last: int) -> torch.Tensor:
    return torch.cat([torch.arange(first), torch.arange(seen - last, seen)])


@pytest.mark.parametrize("cache_config", [
    {"type": "first_and_last", "last": 8},
    {"type": "composite", "strategies": [{"name": "first_and_last", "first": 4, "last": 8}]},
])
def test_user_strategy_prefill_keeps_exact_keys(cache_config) -> None:
    """After a 30-token prefill every layer holds the DynamicCache keys/values at the kept positions."""
    assert "first_and_last" in kvfactory.registered_strategies()
    model = tiny_model("llama")
    prompt = random_prompt(30, seed=5)
    cache = KVCacheFactory(model.config, cache_config).create_cache()
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(prompt, past_key_values=cache)
        ref_out = model(prompt, past_key_values=ref)
    torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=0)  # prefill saw everything
    assert cache.get_seq_length() == 30
    keep = kept_positions(30, 4, 8)
    for i in range(LAYERS):
        keys, values = cache.gather(i)
        assert keys.shape[2] == 12
        assert torch.equal(keys, ref.layers[i].keys[:, :, keep])
        assert torch.equal(values, ref.layers[i].values[:, :, keep])
        assert cache.layers[i].get_mask_sizes(1) == (13, 30 - 12)


def test_user_strategy_in_generate_never_shifts_positions() -> None:
    model = tiny_model("llama")
    factory = KVCacheFactory(model.config, {"type": "first_and_last", "first": 4, "last": 8})
    assert all(isinstance(s, FirstAndLast) and (s.first, s.last) == (4, 8)
               for s in stores(factory.create_cache()))
    cache = factory.create_cache()
    prompt = random_prompt(30, seed=6)
    new = 10
    out = generate(model, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, cache,
                   max_new_tokens=new)
    assert out.sequences.shape == (1, 30 + new)
    seen = 30 + new - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == seen
    assert layer_sizes(cache) == [12] * LAYERS
    # Layer 0's keys depend only on the token and its position: recompute them with a full cache
    # over the same tokens and compare at the kept positions (RoPE positions must not have shifted).
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(out.sequences[:, :seen], past_key_values=ref)
    keep = kept_positions(seen, 4, 8)
    keys, values = cache.gather(0)
    torch.testing.assert_close(keys, ref.layers[0].keys[:, :, keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, ref.layers[0].values[:, :, keep], atol=1e-5, rtol=1e-5)
    # and the eviction did matter: the same keys at shifted positions would not match
    shifted = torch.arange(seen - 12, seen)
    assert not torch.allclose(keys, ref.layers[0].keys[:, :, shifted], atol=1e-3)


# -- the low-level API (code outside transformers) ---------------------------------------------

LOW_LEVEL = [{"type": "dense"}, {"type": "paged", "page_size": 4}, {"type": "paged", "page_size": 1}]


@pytest.mark.parametrize("cache_config", LOW_LEVEL, ids=["dense", "paged4", "paged1"])
def test_low_level_append_gather_size_clear(cache_config) -> None:
    factory = KVCacheFactory(MODEL_CONFIG, cache_config)
    cache = factory.create_cache()
    written = {0: [], 1: []}
    for step, tokens in enumerate([7, 1, 1, 5]):
        for layer in range(LAYERS):
            k, v = kv(tokens, batch=2, seed=10 * step + layer)
            cache.append(layer, k, v)
            written[layer].append((k, v))
    for layer in range(LAYERS):
        keys, values = cache.gather(layer)
        assert torch.equal(keys, torch.cat([k for k, _ in written[layer]], 2))
        assert torch.equal(values, torch.cat([v for _, v in written[layer]], 2))
        assert cache.size(layer) == 14
    assert cache.size() == 14 and cache.get_seq_length() == 14
    assert cache.memory_report()["tokens_stored"] == 2 * 14 * LAYERS
    cache.clear()
    assert layer_sizes(cache) == [0, 0] and cache.get_seq_length() == 0
    assert cache.memory_report()["allocated"] == 0
    if factory.pool is not None:
        assert used_blocks(factory.pool) == {0: 0}
    cache.append(0, *kv(3, batch=1, seed=99))  # usable again, with another batch size
    assert cache.size(0) == 3 and cache.size(1) == 0


@pytest.mark.parametrize("cache_config", LOW_LEVEL, ids=["dense", "paged4", "paged1"])
def test_low_level_shape_errors(cache_config) -> None:
    cache = KVCacheFactory(MODEL_CONFIG, cache_config).create_cache()
    cache.append(0, *kv(3, batch=2))
    with pytest.raises(ShapeError) as exc:
        cache.append(0, *kv(1, batch=3))
    assert "3" in str(exc.value) and "2" in str(exc.value)
    with pytest.raises(ShapeError):
        cache.append(1, torch.randn(KV_HEADS, 3, HEAD_DIM), torch.randn(KV_HEADS, 3, HEAD_DIM))
    assert layer_sizes(cache) == [3, 0]


@pytest.mark.parametrize("cache_config", LOW_LEVEL, ids=["dense", "paged4", "paged1"])
def test_low_level_layer_and_type_errors_name_what_was_given(cache_config) -> None:
    cache = KVCacheFactory(MODEL_CONFIG, cache_config).create_cache()
    cache.append(0, *kv(3))
    out_of_range = "layer 7 is out of range: this cache has 2 layers (0..1)"
    for call in (lambda: cache.gather(7), lambda: cache.size(7), lambda: cache.append(7, *kv(1))):
        with pytest.raises(LayerIndexError) as exc:
            call()
        assert str(exc.value) == out_of_range
        assert isinstance(exc.value, IndexError) and isinstance(exc.value, ShapeError)
    with pytest.raises(IndexError, match=r"layer -1 is out of range"):
        cache.gather(-1)
    keys, values = kv(2)
    with pytest.raises(TensorTypeError, match=r"key is a list: expected torch tensors of shape \[batch, "
                                              r"kv_heads, tokens, head_dim\]") as exc:
        cache.append(1, keys.tolist(), values.tolist())
    assert isinstance(exc.value, TypeError)
    assert layer_sizes(cache) == [3, 0]


# -- many caches, one pool ------------------------------------------------------------------------

def test_caches_of_one_factory_share_its_pool() -> None:
    factory = KVCacheFactory(MODEL_CONFIG, {"type": "paged", "page_size": 4})
    a, b = factory.create_cache("a"), factory.create_cache("b")
    assert a.seq_id == "a" and b.seq_id == "b"
    assert all(s.pool is factory.pool for s in stores(a) + stores(b))
    for layer in range(LAYERS):
        a.append(layer, *kv(10, seed=1))  # 3 blocks per layer
        b.append(layer, *kv(5, batch=2, seed=2))  # 2 blocks per row per layer
    assert used_blocks(factory.pool) == {0: 7}
    held = a.memory_report()["allocated"] + b.memory_report()["allocated"]
    assert factory.pool.memory_report().used == held
    b_keys = b.gather(1)[0].clone()
    a.free()
    assert used_blocks(factory.pool) == {0: 4}
    assert torch.equal(b.gather(1)[0], b_keys)  # freeing one cache leaves the other intact
    del b
    gc.collect()
    assert used_blocks(factory.pool) == {0: 0}  # a dropped cache gives its blocks back


def test_factories_have_separate_pools_unless_shared() -> None:
    one = KVCacheFactory(MODEL_CONFIG, {"type": "paged", "page_size": 4})
    two = KVCacheFactory(MODEL_CONFIG, {"type": "paged", "page_size": 4})
    assert one.pool is not two.pool
    shared = KVCacheFactory(MODEL_CONFIG, {"type": "paged", "page_size": 4}, pool=one.pool)
    cache = shared.create_cache()
    cache.append(0, *kv(4))
    assert used_blocks(one.pool) == {0: 1}
    assert sum(used_blocks(two.pool).values()) == 0


def test_reports_print_for_a_reader() -> None:
    """``memory_report()`` and ``routing_metrics()`` stay dicts of numbers, and print as sentences:
    MiB and bytes per token, the full-precision window apart, and no NaN before any decode step."""
    model = tiny_model("llama")
    quest = {"type": "composite", "strategies": [{"name": "paged", "page_size": 16},
                                                 {"name": "quest", "read_budget": 0.25}]}
    int4 = KVCacheFactory(model.config, {"type": "paged", "page_size": 16,
                                         "quantization": "int4"}).create_cache()
    routed = KVCacheFactory(model.config, quest).create_cache()
    assert str(routed.routing_metrics()) == "routing: no decode step routed yet"
    assert math.isnan(routed.routing_metrics()["hit_rate"])
    for cache in (int4, routed):
        model.generate(random_prompt(200), cache=cache, max_new_tokens=4, do_sample=False)
    report = int4.memory_report()
    assert report["bytes_per_token"] > 0 and "nan" not in str(report)
    assert str(report).startswith("KV cache: ") and "bytes per token" in str(report)
    assert "full-precision window" in str(report)
    assert str(routed.routing_metrics()).startswith("routing: 3 decode steps")
