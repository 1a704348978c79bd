"""Bad configs raise ``ConfigError`` naming the key, the value and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from tiny_models import tiny_config

from kvfactory import ConfigError, DenseStore, KVCacheFactory, LayerStore, register_cache_strategy
from kvfactory.storage.blocks import memory_bytes

MODEL_CONFIG = tiny_config("llama")


def config_error(cache_config) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        KVCacheFactory(MODEL_CONFIG, cache_config)
    return exc.value


# (cache_config, key named, value named (as repr), a word of what is allowed)
BAD_CONFIGS = {
    "unknown-type": ({"type": "pagde"}, "type", "'pagde'", "paged"),
    "type-not-a-string": ({"type": 3}, "type", "3", "dense"),
    "missing-type": ({"page_size": 16}, "type", "None", "paged"),
    "unknown-key": ({"type": "paged", "page_sise": 16}, "page_sise", "16", "page_size"),
    "unknown-dense-key": ({"type": "dense", "page_size": 16}, "page_size", "16", "growth"),
    "page-size-string": ({"type": "paged", "page_size": "16"}, "page_size", "'16'", "int"),
    "page-size-bool": ({"type": "paged", "page_size": True}, "page_size", "True", "int"),
    "page-size-float": ({"type": "paged", "page_size": 16.0}, "page_size", "16.0", "int"),
    "pool-tokens-string": ({"type": "paged", "pool_tokens": "4k"}, "pool_tokens", "'4k'", "int"),
    "growth-string": ({"type": "dense", "growth": "2"}, "growth", "'2'", "float"),
    "page-size-zero": ({"type": "paged", "page_size": 0}, "page_size", "0", "positive"),
    "page-size-negative": ({"type": "paged", "page_size": -16}, "page_size", "-16", "positive"),
    "pool-tokens-zero": ({"type": "paged", "pool_tokens": 0}, "pool_tokens", "0", "positive"),
    "growth-below-one": ({"type": "dense", "growth": 0.5}, "growth", "0.5", "1.0"),
    "reserve-negative": ({"type": "dense", "reserve_tokens": -1}, "reserve_tokens", "-1", "0"),
    "two-pool-sizes": ({"type": "paged", "pool_tokens": 1024, "pool_blocks": 8},
                       "pool_tokens", "1024", "at most one"),
    "three-pool-sizes": ({"type": "paged", "pool_tokens": 1024, "pool_blocks": 8, "pool_bytes": 4096},
                         "pool_bytes", "4096", "at most one"),
    "composite-no-strategies": ({"type": "composite"}, "strategies", "None", "list"),
    "composite-empty-strategies": ({"type": "composite", "strategies": []}, "strategies", "[]", "list"),
    "composite-strategies-mapping": ({"type": "composite", "strategies": {"name": "paged"}},
                                     "strategies", "'paged'", "list"),
    "composite-entry-without-name": ({"type": "composite", "strategies": [{"page_size": 16}]},
                                     "strategies[0]", "16", "name"),
    "composite-entry-not-mapping": ({"type": "composite", "strategies": ["paged"]},
                                    "strategies[0]", "'paged'", "name"),
    "composite-unknown-name": ({"type": "composite", "strategies": [{"name": "pagd"}]},
                               "strategies[0].name", "'pagd'", "paged"),
    "composite-unknown-key": ({"type": "composite", "strategies": [{"name": "paged", "size": 16}]},
                              "strategies[0].size", "16", "page_size"),
    "composite-bad-value": ({"type": "composite", "strategies": [{"name": "paged", "page_size": 0}]},
                            "page_size", "0", "positive"),
    "composite-two-storages": ({"type": "composite", "strategies": [{"name": "paged"}, {"name": "dense"}]},
                               "strategies[1].name", "'dense'", "paged"),
    "composite-extra-key": ({"type": "composite", "strategies": [{"name": "paged"}], "page_size": 16},
                            "page_size", "16", "strategies"),
    "not-a-mapping": ("paged", "cache_config", "'paged'", "dict"),
    "wrapped-not-a-mapping": ({"kv_cache_config": ["paged"]}, "kv_cache_config", "['paged']", "mapping"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_names_key_value_and_allowed(case: str) -> None:
    cache_config, key, value, allowed = BAD_CONFIGS[case]
    err = config_error(cache_config)
    message = str(err)
    assert key in message, message
    assert value in message, message
    assert allowed in message, message
    assert err.allowed  # the attribute callers can read as well


def test_config_error_is_a_value_error() -> None:
    assert isinstance(config_error({"type": "nope"}), ValueError)


def test_dense_headroom_beyond_this_machines_memory_is_refused() -> None:
    err = config_error({"type": "dense", "reserve_tokens": 10**12})
    needed = 10**12 * 2 * 128  # tokens x 2 layers x (K and V of 2 KV heads x 16 dims at 2 bytes)
    assert (err.key, err.value) == ("reserve_tokens", 10**12)
    message = str(err)
    assert f"{needed:,} bytes" in message and f"this machine's {memory_bytes():,} bytes" in message, message
    KVCacheFactory(MODEL_CONFIG, {"type": "dense", "reserve_tokens": 10**6})  # 256 MB: accepted


def test_good_configs_are_accepted() -> None:
    for cache_config in ({"type": "dense"}, {"type": "dense", "growth": 2}, {"type": "paged", "page_size": 1},
                         {"type": "paged", "pool_bytes": 1 << 20}, None,
                         {"type": "composite", "strategies": [{"name": "paged", "page_size": 256}]}):
        KVCacheFactory(MODEL_CONFIG, cache_config)


# -- YAML -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "named"), [
    ("type: paged\npage_size: [16\n", "yaml"),  # syntax error
    ("- type: paged\n", "mapping"),  # a list at the top level
    ("just a string\n", "mapping"),
    ("", "mapping"),  # empty file
])
def test_bad_yaml_file(tmp_path, text: str, named: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        KVCacheFactory.from_yaml(path, MODEL_CONFIG)
    assert str(path) in str(exc.value)
    assert named in str(exc.value).lower()


def test_missing_yaml_file(tmp_path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as exc:
        KVCacheFactory.from_yaml(path, MODEL_CONFIG)
    assert str(path) in str(exc.value)


def test_yaml_with_bad_key(tmp_path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("kv_cache_config:\n  type: composite\n  strategies:\n"
                    "    - name: paged\n      page_size: '16'\n")
    with pytest.raises(ConfigError) as exc:
        KVCacheFactory.from_yaml(path, MODEL_CONFIG)
    assert "strategies[0].page_size" in str(exc.value) and "'16'" in str(exc.value)


# -- registering strategies --------------------------------------------------------------------

class NotADataclass(LayerStore):  # implements nothing, and is not a dataclass
    pass


@dataclass
class NotALayerStore:
    first: int = 4


@pytest.mark.parametrize("cls", [NotADataclass, NotALayerStore, dict, len, "DenseStore"],
                         ids=["not-dataclass", "not-layer-store", "builtin-class", "function", "string"])
def test_register_rejects_bad_classes(cls) -> None:
    with pytest.raises(ConfigError) as exc:
        register_cache_strategy("test_bad_strategy", cls)
    assert "LayerStore" in str(exc.value) and "dataclass" in str(exc.value)
    assert "test_bad_strategy" not in __import__("kvfactory").registered_strategies()


@pytest.mark.parametrize("name", ["", "composite", 3, None])
def test_register_rejects_bad_names(name) -> None:
    with pytest.raises(ConfigError) as exc:
        register_cache_strategy(name, DenseStore)
    assert repr(name) in str(exc.value)
