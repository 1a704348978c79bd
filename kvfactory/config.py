"""Cache configs: parse dicts, YAML files and composite configs into a validated ``CacheConfig``.

A strategy is a registered dataclass; its fields are the options a config may set. Every unknown
key, wrong type or impossible value raises ``ConfigError`` naming the key, the value and what
is allowed. The design article's spellings (its YAML keys, its typed configs) are rewritten into
kvfactory's first (``kvfactory.spellings``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvfactory.codecs.spec import QuantizationSpec
from kvfactory.errors import ConfigError
from kvfactory.eviction.spec import EVICTION, EvictionSpec
from kvfactory.options import describe, options_of, type_ok
from kvfactory.selectors import SELECTORS
from kvfactory.selectors.spec import SelectorSpec
from kvfactory.spellings import PagedKVCacheConfig, translate
from kvfactory.storage.base import LayerStore
from kvfactory.storage.dense import DenseStore
from kvfactory.storage.paged import PagedStore

_REGISTRY: dict[str, type] = {}
QUANTIZED = "quantized"  # the composite entry that sets quantization (kvfactory.codecs.spec)
SHARE_PREFIX = "share_prefix"  # whether a manager over the config shares cached prompt prefixes


def register_cache_strategy(name: str, cls: type) -> type:
    """Make ``cls`` usable as ``{"type": name, ...}`` or as a composite strategy ``{"name": name}``.

    ``cls`` must be a dataclass subclass of ``LayerStore``; its fields are its config options.
    """
    if not (isinstance(cls, type) and issubclass(cls, LayerStore) and "__dataclass_fields__" in cls.__dict__):
        raise ConfigError("strategy class", cls, "a subclass of kvfactory.LayerStore decorated with "
                          "@dataclass itself (its fields are its config options)")
    if not isinstance(name, str) or not name or name == "composite":
        raise ConfigError("strategy name", name, "a non-empty string other than 'composite'")
    _REGISTRY[name] = cls
    return cls


def registered_strategies() -> list[str]:
    return sorted(_REGISTRY)


register_cache_strategy("dense", DenseStore)
register_cache_strategy("paged", PagedStore)


@dataclass(frozen=True)
class StrategySpec:
    """One validated strategy: its registered name, class and options."""

    name: str
    cls: type
    options: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Any:
        return self.cls(**self.options)


@dataclass(frozen=True)
class CacheConfig:
    """A validated cache config; ``raw`` is what the user gave."""

    storage: StrategySpec
    raw: dict[str, Any]
    quantization: QuantizationSpec | None = None
    eviction: EvictionSpec | None = None
    selector: SelectorSpec | None = None
    share_prefix: bool | None = None  # None: wherever the storage can share prefixes


def parse_strategy(name: Any, options: dict[str, Any], where: str) -> StrategySpec:
    """Validate one strategy's name and options; ``where`` prefixes key names in errors."""
    if name not in _REGISTRY:
        raise ConfigError(f"{where}type" if where == "" else f"{where}name", name,
                          f"one of {registered_strategies()} (or 'composite')")
    cls = _REGISTRY[name]
    allowed = options_of(cls)
    for key, value in options.items():
        if key not in allowed:
            raise ConfigError(f"{where}{key}", value, f"options of '{name}': {sorted(allowed)}")
        if not type_ok(value, allowed[key]):
            raise ConfigError(f"{where}{key}", value, describe(allowed[key]))
    spec = StrategySpec(name, cls, dict(options))
    try:
        spec.build()  # runs the strategy's own value checks (__post_init__)
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc.key}", exc.value, exc.allowed) from None
    return spec


def parse_config(config: dict[str, Any] | CacheConfig | PagedKVCacheConfig | None) -> CacheConfig:
    """Validate a config dict (plain or composite; kvfactory's keys or the design article's) or
    typed config into a ``CacheConfig``."""
    if isinstance(config, CacheConfig):
        return config
    if isinstance(config, PagedKVCacheConfig):
        config = config.to_config()
    if config is None:
        config = {"type": "dense"}
    if not isinstance(config, dict):
        raise ConfigError("cache_config", config, "a dict, a CacheConfig or a YAML path via from_yaml")
    if set(config) == {"kv_cache_config"}:
        config = config["kv_cache_config"]
        if not isinstance(config, dict):
            raise ConfigError("kv_cache_config", config, "a mapping")
    raw, config = dict(config), translate(config)
    share = config.pop(SHARE_PREFIX, None)
    if share is not None and not isinstance(share, bool):
        raise ConfigError(SHARE_PREFIX, share, "true or false")
    kind = config.get("type")
    if not isinstance(kind, str):
        raise ConfigError("type", kind, f"one of {registered_strategies()} or 'composite'")
    if kind != "composite":
        options = {k: v for k, v in config.items() if k not in ("type", "quantization")}
        return CacheConfig(parse_strategy(kind, options, ""), raw,
                           QuantizationSpec.parse(config.get("quantization")), share_prefix=share)
    extra = set(config) - {"type", "strategies"}
    if extra:
        key = sorted(extra)[0]
        raise ConfigError(key, config[key], f"a composite config has only 'type', 'strategies' and "
                          f"'{SHARE_PREFIX}'")
    strategies = config.get("strategies")
    if not isinstance(strategies, list) or not strategies:
        raise ConfigError("strategies", strategies, "a non-empty list of {name: ..., options...}")
    storage, quantization, eviction, selector = None, None, None, None
    for i, entry in enumerate(strategies):
        where = f"strategies[{i}]."
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ConfigError(f"strategies[{i}]", entry, "a mapping with a 'name' key naming a strategy")
        options = {k: v for k, v in entry.items() if k != "name"}
        if entry["name"] == QUANTIZED:
            if quantization is not None:
                raise ConfigError(f"{where}name", QUANTIZED, "one quantized strategy per config")
            quantization = QuantizationSpec.parse(options, where)
            continue
        if entry["name"] == EVICTION:
            if eviction is not None:
                raise ConfigError(f"{where}name", EVICTION, "one eviction entry per config")
            eviction = EvictionSpec.parse(options, where)
            continue
        if entry["name"] in SELECTORS:
            if selector is not None:
                raise ConfigError(f"{where}name", entry["name"],
                                  f"one selector per config; '{selector.selector}' is already given")
            selector = SelectorSpec.parse(entry["name"], options, where)
            continue
        spec = parse_strategy(entry["name"], options, where)
        if storage is not None:
            raise ConfigError(f"{where}name", entry["name"],
                              f"one storage strategy per config; '{storage.name}' is already given")
        storage = spec
    if storage is None:
        raise ConfigError("strategies", [e["name"] for e in strategies],
                          f"a storage strategy ({registered_strategies()}) besides "
                          f"'{QUANTIZED}', '{EVICTION}' and selectors {sorted(SELECTORS)}")
    if selector is not None:
        check_selector_composition(storage, eviction, selector)
    return CacheConfig(storage, raw, quantization, eviction, selector, share)


def check_selector_composition(storage: StrategySpec, eviction: EvictionSpec | None,
                               selector: SelectorSpec) -> None:
    """A selector reads pages: it needs paged storage (plain or quantized). Under it, eviction compresses
    prefills (``compression_ratio``) and decode reads a fraction of what was kept (RocketKV's two
    stages); a token ``budget`` would evict during decode too, under the selector's reads."""
    if not issubclass(storage.cls, PagedStore):
        raise ConfigError("strategies", storage.name, f"a paged storage strategy under selector "
                          f"'{selector.selector}' (it reads pages): {{'name': 'paged', 'page_size': 16}}")
    if eviction is not None and eviction.budget is not None:
        raise ConfigError(f"{EVICTION}.budget", eviction.budget, f"compression_ratio instead with selector "
                          f"'{selector.selector}': eviction compresses the prompt, the selector reads a "
                          f"fraction of what it kept at each decode step; a budget would evict under "
                          f"its reads")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict (errors name the file)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("yaml file", str(path), f"a readable YAML file ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError("yaml file", str(path), "a YAML mapping at the top level")
    return data
