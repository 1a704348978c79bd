"""Named cache configs shipped with the package: ``kvfactory/presets/NAME.yaml``."""

from __future__ import annotations

from importlib import resources
from typing import Any

from kvfactory.config import parse_config
from kvfactory.errors import ConfigError


def preset_names() -> list[str]:
    """Names of the shipped presets (file names without ``.yaml``), sorted."""
    files = resources.files("kvfactory.presets").iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".yaml"))


def load_preset(name: str) -> dict[str, Any]:
    """The validated config dict of preset ``name``; ``ConfigError`` for an unknown name."""
    import yaml

    if name not in preset_names():
        raise ConfigError("preset", name, f"one of {', '.join(preset_names())}")
    config = yaml.safe_load(resources.files("kvfactory.presets").joinpath(f"{name}.yaml").read_text())
    parse_config(config)
    return config
