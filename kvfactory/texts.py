"""Text shipped with the package: a WikiText-2 excerpt for the main job and offline evaluation."""

from __future__ import annotations

from importlib import resources


def shipped_text() -> str:
    """The WikiText-2 excerpt shipped in ``kvfactory/data`` (see its README for source and licence)."""
    return resources.files("kvfactory").joinpath("data/wikitext2_excerpt.txt").read_text(encoding="utf-8")
