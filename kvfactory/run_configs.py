"""The named cache configs ``kvfactory run`` compares (``PRESETS``, ``DEFAULT_CONFIGS``) and how its
``--configs`` values are read: light to import, so that ``kvfactory --help`` starts at once."""

from __future__ import annotations

import json
from typing import Any

from kvfactory.errors import ConfigError

# the configs ``--all`` runs, by the preset names ``eval`` and ``serve`` take (``kvfactory.presets``)
PRESETS = ("dense", "paged16", "paged256", "int8", "int4", "snapkv@0.75", "streaming_llm@1024", "quest@0.125",
           "oval@0.125")
# lossless, memory, eviction, sparse reads: the run a new user meets first (about 3 minutes on 1 thread)
DEFAULT_CONFIGS = ("paged16", "int4", "snapkv@0.75", "quest@0.125", "oval@0.125")
SEGMENTS = 3  # decode segments per config, each right after a baseline segment
MIN_NEW_TOKENS = 1 + 2 * SEGMENTS  # the prefill's token, then segments with a timed step after the first


class RunError(ValueError):
    """Settings the run cannot honour: an unknown config, or a context the text or model cannot hold."""


def parse_configs(values: list[str] | None, every: bool = False) -> dict[str, dict[str, Any]]:
    """Named cache configs to compare: presets (the names ``eval`` and ``serve`` take, POLICY@RATIO
    and SELECTOR@BUDGET included) or inline JSON configs, ``DEFAULT_CONFIGS`` when none are given,
    ``PRESETS`` with ``every``.

    Each config is validated now, so a typo fails before the model loads.
    """
    from kvfactory.config import parse_config  # torch: only once configs are parsed
    from kvfactory.presets import is_preset, load_preset

    if every and values:
        raise RunError("--all runs every preset: leave out --configs, or name the configs without --all")
    configs = {}
    for value in values or (PRESETS if every else DEFAULT_CONFIGS):
        try:
            if is_preset(value):
                configs[value] = load_preset(value)
                continue
            try:
                config = json.loads(value)
            except json.JSONDecodeError:
                raise RunError(f"config {value!r}: expected a preset ({', '.join(PRESETS)}, POLICY@RATIO, "
                               f"SELECTOR@BUDGET, POLICY@RATIO+SELECTOR@BUDGET) or a JSON cache config "
                               f"such as '{{\"type\": \"paged\", \"page_size\": 64}}'") from None
            parse_config(config)
        except ConfigError as exc:
            raise RunError(f"config {value!r}: {exc}") from exc
        configs[json.dumps(config, separators=(",", ":"))] = config
    return configs
