"""The named cache configs ``kvfactory run`` compares (``PRESETS``, ``DEFAULT_CONFIGS``) and how its
``--configs`` values are read: light to import, so that ``kvfactory --help`` starts at once."""

from __future__ import annotations

import json
from typing import Any

from kvfactory.errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    "dense": {"type": "dense"},
    "paged/16": {"type": "paged", "page_size": 16},
    "paged/256": {"type": "paged", "page_size": 256},
    "int8": {"type": "dense", "quantization": "int8"},
    "paged/16+int4": {"type": "paged", "page_size": 16, "quantization": "int4"},
    "paged/16+snapkv/0.75": {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16},
        {"name": "eviction", "policy": "snapkv", "compression_ratio": 0.75}]},
    "paged/16+streaming/1024": {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16},
        {"name": "eviction", "policy": "streaming_llm", "budget": 1024}]},
    "paged/16+quest/0.125": {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16}, {"name": "quest", "read_budget": 0.125}]},
    "paged/16+oval/0.125": {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16}, {"name": "oval", "read_budget": 0.125}]},
}
# lossless, memory, eviction, sparse reads: the run a new user meets first (about 3 minutes on 1 thread)
DEFAULT_CONFIGS = ("paged/16", "paged/16+int4", "paged/16+snapkv/0.75", "paged/16+quest/0.125",
                   "paged/16+oval/0.125")
SEGMENTS = 3  # decode segments per config, each right after a baseline segment
MIN_NEW_TOKENS = 1 + 2 * SEGMENTS  # the prefill's token, then segments with a timed step after the first


class RunError(ValueError):
    """Settings the run cannot honour: an unknown config, or a context the text or model cannot hold."""


def parse_configs(values: list[str] | None, every: bool = False) -> dict[str, dict[str, Any]]:
    """Named cache configs to compare: preset names or inline JSON configs, ``DEFAULT_CONFIGS`` when
    none are given, every preset with ``every``.

    Each config is validated now, so a typo fails before the model loads.
    """
    from kvfactory.config import parse_config  # torch: only once configs are parsed

    if every:
        if values:
            raise RunError("--all runs every preset: leave out --configs, or name the configs without --all")
        return dict(PRESETS)
    if not values:
        return {name: PRESETS[name] for name in DEFAULT_CONFIGS}
    configs = {}
    for value in values:
        if value in PRESETS:
            configs[value] = PRESETS[value]
            continue
        try:
            config = json.loads(value)
        except json.JSONDecodeError:
            raise RunError(f"config {value!r}: expected one of {', '.join(PRESETS)} or a JSON cache "
                           f"config such as '{{\"type\": \"paged\", \"page_size\": 64}}'") from None
        try:
            parse_config(config)
        except ConfigError as exc:
            raise RunError(f"config {value!r}: {exc}") from exc
        configs[json.dumps(config, separators=(",", ":"))] = config
    return configs
