"""Selectors: which stored pages a decode step reads (``sparse`` caches, ``kvfactory.selectors.sparse``).

One file per method; ``register_selector`` adds a user's own (a ``Selector`` dataclass).
"""

from __future__ import annotations

from kvfactory.options import check_registration
from kvfactory.selectors.base import Selector
from kvfactory.selectors.full import FullSelector
from kvfactory.selectors.oval import OvalSelector
from kvfactory.selectors.pages import PageSummaries
from kvfactory.selectors.quest import QuestSelector
from kvfactory.selectors.random_pages import RandomSelector
from kvfactory.selectors.recent import RecentSelector

SELECTORS: dict[str, type[Selector]] = {
    "full": FullSelector,
    "oval": OvalSelector,
    "quest": QuestSelector,
    "random": RandomSelector,
    "recent": RecentSelector,
}


def register_selector(name: str, cls: type[Selector]) -> type[Selector]:
    """Make ``cls`` usable as a composite strategy ``{"name": name, "read_budget": ...}``."""
    check_registration("selector", name, cls, Selector)
    SELECTORS[name] = cls
    return cls


__all__ = ["SELECTORS", "PageSummaries", "Selector", "register_selector"]
