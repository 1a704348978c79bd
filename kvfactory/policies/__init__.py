"""Eviction and compression policies: which stored tokens a ``selective`` cache keeps.

One file per method; ``register_policy`` adds a user's own (a ``Policy`` dataclass).
"""

from __future__ import annotations

from kvfactory.options import check_registration
from kvfactory.policies.base import Observation, Policy
from kvfactory.policies.h2o import H2OPolicy
from kvfactory.policies.knorm import KnormPolicy
from kvfactory.policies.pyramidkv import PyramidKVPolicy
from kvfactory.policies.snapkv import SnapKVPolicy
from kvfactory.policies.streaming import StreamingLLMPolicy
from kvfactory.policies.tova import TOVAPolicy
from kvfactory.policies.window import WindowPolicy

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
    """Make ``cls`` usable as ``{"name": "selective", "policy": name, ...}``."""
    check_registration("policy", name, cls, Policy)
    POLICIES[name] = cls
    return cls


__all__ = ["POLICIES", "Observation", "Policy", "register_policy"]
