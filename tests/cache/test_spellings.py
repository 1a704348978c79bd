"""The design article's own config and calls, pasted as they are: its YAML (``share_system_prompt``,
``quant_bits``, ``calibrate``, ``selective``), its flat keys (``type: native``, ``quant_bits``), its
typed configs, ``KVCacheFactory(model_config=..., default_config=...)``, ``create_cache(seq_id=...)``,
``free_cache(seq_id)`` and the manager's ``allocate``, ``extend``, ``free`` and ``batch_gather``;
each is checked for what it does."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import generate
from tiny_models import random_prompt, tiny_config, tiny_model

from kvfactory import (
    CacheFullError,
    ConfigError,
    KVCacheFactory,
    KVCacheManager,
    PagedKVCacheConfig,
    PagedQuantizedCacheConfig,
    UnknownSequenceError,
    batch_gather,
)
from kvfactory.config import load_yaml, parse_config

ARTICLE_YAML = """\
kv_cache_config:
  type: composite
  strategies:
    - name: paged
      page_size: 256
    - name: quantized
      quant_bits: 8
      calibrate: true
    - name: selective
      strategy: sliding_window
      window_size: 1024
  share_system_prompt: true
"""


def test_the_articles_yaml_builds_what_it_says(tmp_path) -> None:
    path = tmp_path / "kv_cache.yaml"
    path.write_text(ARTICLE_YAML)
    config = parse_config(load_yaml(path))
    assert (config.storage.name, config.storage.options) == ("paged", {"page_size": 256})
    assert (config.quantization.codec, config.quantization.calibrate) == ("int8", True)
    assert (config.eviction.policy, config.eviction.budget) == ("window", 1024)
    assert config.share_prefix is True
    model = tiny_model("llama")
    cache = KVCacheFactory.from_yaml(path, model.config).create_cache()
    inputs = {"input_ids": random_prompt(12), "attention_mask": torch.ones(1, 12, dtype=torch.long)}
    out = generate(model, inputs, cache)
    assert out.sequences.shape[1] == 12 + 8 and cache.get_seq_length() == 12 + 7
    assert cache.layers[0].store.inner.key_codec.first_use is not None  # calibrates on its first 512 tokens
    with pytest.warns(UserWarning, match="share_system_prompt"):  # eviction: nothing to share
        manager = KVCacheManager(model.config, load_yaml(path))
    assert manager.prefix_caching is False


def test_share_system_prompt_turns_prefix_sharing_on_and_off() -> None:
    config = tiny_config("llama")
    paged = {"type": "paged", "page_size": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert KVCacheManager(config, paged | {"share_system_prompt": True}).prefix_caching is True
    assert KVCacheManager(config, paged | {"share_system_prompt": False}).prefix_caching is False
    with pytest.raises(ConfigError, match="share_prefix"):
        parse_config(paged | {"share_system_prompt": "yes"})


def test_the_articles_flat_keys() -> None:
    assert parse_config({"type": "native"}).storage.name == "dense"
    config = parse_config({"type": "paged", "page_size": 256, "quant_bits": 8})
    assert (config.storage.options, config.quantization.codec) == ({"page_size": 256}, "int8")
    assert parse_config({"type": "paged", "quant_bits": 4}).quantization.codec == "int4"
    with pytest.raises(ConfigError, match="quant_bits"):
        parse_config({"type": "paged", "quant_bits": 3})


def test_selective_entries_are_eviction_entries() -> None:
    def entry(**options) -> dict:
        return {"type": "composite", "strategies": [{"name": "paged", "page_size": 16},
                                                    {"name": "selective", **options}]}

    h2o = parse_config(entry(strategy="h2o", budget=64)).eviction
    assert (h2o.policy, h2o.budget) == ("h2o", 64)
    snapkv = parse_config(entry(strategy="snapkv", compression_ratio=0.5, window_size=8)).eviction
    assert (snapkv.policy, snapkv.options["window_size"]) == ("snapkv", 8)  # the policy's own window
    with pytest.raises(ConfigError, match="policy"):
        parse_config(entry(strategy="lru", budget=64))
    with pytest.raises(ConfigError, match="calibrate"):
        parse_config({"type": "composite", "strategies": [{"name": "paged"},
                                                          {"name": "quantized", "calibrate": "auto"}]})
    kivi = parse_config({"type": "composite", "strategies": [
        {"name": "paged"}, {"name": "quantized", "quant_bits": 4, "calibrate": True}]}).quantization
    assert (kivi.codec, kivi.calibrate) == ("int4", False)  # KIVI scales each group as it writes


def test_the_articles_typed_config_and_factory_calls() -> None:
    model_config = tiny_config("llama")
    cache_config = PagedQuantizedCacheConfig(page_size=256, num_blocks=1024, quant_bits=8,
                                             dtype=torch.float16)
    factory = KVCacheFactory(model_config=model_config, default_config=cache_config)
    assert factory.config.quantization.codec == "int8"
    assert factory.config.storage.options == {"page_size": 256, "pool_blocks": 1024}
    plain = KVCacheFactory(model_config, PagedKVCacheConfig(page_size=16, num_blocks=64))
    assert plain.config.quantization is None and plain.pool.page_size == 16
    cache = plain.create_cache(seq_id="test_seq")
    key = torch.randn(1, 2, 40, 16)
    cache.update(key, key, 0)
    assert set(plain.pool.free_blocks().values()) == {64 - 3}  # 40 tokens in 16-token pages
    plain.free_cache("test_seq")
    assert set(plain.pool.free_blocks().values()) == {64} and cache.get_seq_length() == 0
    with pytest.raises(UnknownSequenceError):
        plain.free_cache("test_seq")
    with pytest.raises(ConfigError, match="default_config"):
        KVCacheFactory(model_config, {"type": "paged"}, default_config={"type": "paged"})
    with pytest.raises(ConfigError, match="quant_bits"):
        PagedQuantizedCacheConfig(quant_bits=3)
    with pytest.raises(ConfigError, match="dtype"):
        PagedKVCacheConfig(dtype=torch.int8)


def test_the_articles_manager_verbs() -> None:
    """``allocate(seq_id, initial_length)`` and ``extend(seq_id, new_tokens)`` check the pool's room
    (``CacheFullError`` with nothing held), ``free(seq_id)`` gives the blocks back, and
    ``batch_gather(caches)`` aligns sequences of different lengths into one padded batch."""
    manager = KVCacheManager(tiny_config("llama"), {"type": "paged", "page_size": 16, "pool_blocks": 8})
    short = manager.allocate("short", initial_length=40)
    with pytest.raises(CacheFullError):
        manager.allocate("huge", initial_length=16 * 9)
    assert manager.sequences() == ["short"]
    keys = torch.randn(1, 2, 40, 16)
    short.update(keys, keys + 1, 0)
    assert manager.extend("short", 16 * 5) is short  # 3 blocks held, 5 more free
    with pytest.raises(CacheFullError):
        manager.extend("short", 16 * 6)
    long = manager.allocate("long")
    longer = torch.randn(1, 2, 50, 16)
    with pytest.raises(CacheFullError):  # "short" holds 3 of the 8 blocks: 6 more do not fit
        manager.extend("long", 16 * 6)
    long.update(longer, longer, 0)
    gathered, values, mask = batch_gather([short, long])
    assert gathered.shape == values.shape == (2, 2, 50, 16) and mask.sum(1).tolist() == [40, 50]
    assert torch.equal(gathered[0, :, 10:], keys[0]) and torch.equal(values[0, :, 10:], keys[0] + 1)
    assert not gathered[0, :, :10].any() and torch.equal(gathered[1], longer[0])
    manager.free("short")
    manager.free("long")
    assert manager.stats()["pool_blocks_held"] == 0
    with pytest.raises(ConfigError, match="new_tokens"):
        manager.extend("x", -1)
