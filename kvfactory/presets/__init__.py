"""Named cache configs shipped with the package: ``kvfactory/presets/NAME.yaml``, and ``POLICY@RATIO``
(e.g. ``snapkv@0.75``): 16-token pages with that eviction policy compressing prefills by ``RATIO``.
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


_POLICY_AT_RATIO = re.compile(r"(?P<policy>[a-z0-9_]+)@(?P<ratio>0?\.[0-9]+)")


def policy_preset(name: str) -> dict[str, Any] | None:
    """The config of a ``POLICY@RATIO`` name (a registered policy), else None."""
    from kvfactory.policies import POLICIES

    match = _POLICY_AT_RATIO.fullmatch(name)
    if match is None or match["policy"] not in POLICIES:
        return None
    return {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16},
        {"name": "selective", "policy": match["policy"], "compression_ratio": float(match["ratio"])}]}


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
                          f"one of {', '.join(preset_names())}, or POLICY@RATIO (snapkv@0.75)")
    config = yaml.safe_load(resources.files("kvfactory.presets").joinpath(f"{name}.yaml").read_text())
    parse_config(config)
    return config
