"""Eviction and compression policies: which stored tokens an evicting cache keeps (the ``eviction`` entry).

One file per method; ``register_policy`` adds a user's own (a ``Policy`` dataclass).
"""

from __future__ import annotations

from kvfactory.eviction.base import Observation, Policy
from kvfactory.eviction.h2o import H2OPolicy
from kvfactory.eviction.knorm import KnormPolicy
from kvfactory.eviction.pyramidkv import PyramidKVPolicy
from kvfactory.eviction.snapkv import SnapKVPolicy
from kvfactory.eviction.streaming import StreamingLLMPolicy
from kvfactory.eviction.tova import TOVAPolicy
from kvfactory.eviction.window import WindowPolicy
from kvfactory.options import check_registration

POLICIES: dict[str, type[Policy]] = {
    "window": WindowPolicy,
    "streaming_llm": StreamingLLMPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "pyramidkv": PyramidKVPolicy,
    "tova": TOVAPolicy,
    "knorm": KnormPolicy,
}


def register_policy(name: str, cls: type[Policy]) -> type[Policy]:
    """Make ``cls`` usable as ``{"name": "eviction", "policy": name, ...}``."""
    check_registration("policy", name, cls, Policy)
    POLICIES[name] = cls
    return cls


__all__ = ["POLICIES", "Observation", "Policy", "register_policy"]
