"""Named cache configs shipped with the package: ``kvfactory/presets/NAME.yaml``, ``POLICY@RATIO``
(e.g. ``snapkv@0.75``): 16-token pages with that eviction policy compressing prefills by ``RATIO``,
``POLICY@TOKENS`` (a whole number, e.g. ``streaming_llm@1024``): the policy keeping that many tokens
per layer, ``SELECTOR@BUDGET`` (e.g. ``quest@0.125``): 16-token pages that decode reads sparsely, that
fraction of the pages per step, and ``POLICY@RATIO+SELECTOR@BUDGET`` both stages in one config.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

from kvfactory.config import parse_config
from kvfactory.errors import ConfigError


def preset_names() -> list[str]:
    """Names of the shipped presets (file names without ``.yaml``), sorted."""
    files = resources.files("kvfactory.presets").iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".yaml"))


# any number after the @, so that a ratio out of range is refused by the config check, naming it
_NAME_AT_FRACTION = re.compile(r"(?P<name>[a-z0-9_]+)(?P<dynamic>-dynamic)?@(?P<fraction>-?[0-9]*\.?[0-9]+)")


def policy_preset(name: str) -> dict[str, Any] | None:
    """The config of a ``POLICY@RATIO`` or ``SELECTOR@BUDGET`` name (registered ones), or of both
    joined by ``+`` (``snapkv@0.5+quest@0.125``: eviction compresses the prompt, decode reads a
    fraction of what it kept), else None."""
    entries = [_entry(part, name) for part in name.split("+")]
    if not 0 < len(entries) <= 2 or any(entry is None for entry in entries):
        return None
    return {"type": "composite", "strategies": [{"name": "paged", "page_size": 16}, *entries]}


def _entry(part: str, name: str) -> dict[str, Any] | None:
    from kvfactory.eviction import POLICIES
    from kvfactory.selectors import SELECTORS

    match = _NAME_AT_FRACTION.fullmatch(part)
    if match is None:
        return None
    if match["name"] in POLICIES and not match["dynamic"]:
        entry: dict[str, Any] = {"name": "eviction", "policy": match["name"]}
        if match["fraction"].isdigit() and int(match["fraction"]) >= 1:  # a whole number: tokens kept
            entry["budget"] = int(match["fraction"])
        else:
            entry["compression_ratio"] = float(match["fraction"])
        return entry
    if match["name"] in SELECTORS:
        if match["dynamic"]:
            raise ConfigError("preset", name, f"{match['name']}@{match['fraction']}: dynamic pages were "
                              "removed (they read less attention mass than fixed pages; "
                              "docs/sparse-reads.md)")
        return {"name": match["name"], "read_budget": float(match["fraction"])}
    return None


def is_preset(name: str) -> bool:
    return name in preset_names() or policy_preset(name) is not None


def load_preset(name: str) -> dict[str, Any]:
    """The validated config dict of preset ``name``; ``ConfigError`` for an unknown name."""
    import yaml

    config = policy_preset(name)
    if config is not None:
        parse_config(config)
        return config
    if name not in preset_names():
        raise ConfigError("preset", name,
                          f"one of {', '.join(preset_names())}, POLICY@RATIO (snapkv@0.75), "
                          f"SELECTOR@BUDGET (quest@0.125) or both (snapkv@0.5+quest@0.125)")
    config = yaml.safe_load(resources.files("kvfactory.presets").joinpath(f"{name}.yaml").read_text())
    parse_config(config)
    return config
