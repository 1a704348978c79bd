"""kvfactory: composable KV-cache management for Hugging Face transformers.

The names below load on first use (PEP 562), so the parts that do not touch transformers (the
codecs, ``kvfactory.tiers``) import in an environment that pins another transformers, such as
vLLM's virtualenv.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "KVCache": "kvfactory.cache", "watch_hidden_states": "kvfactory.cache",
    "CacheConfig": "kvfactory.config", "register_cache_strategy": "kvfactory.config",
    "registered_strategies": "kvfactory.config",
    **{name: "kvfactory.errors" for name in (
        "AllocationError", "CacheFullError", "ConfigError", "KVFactoryError", "LayerIndexError",
        "SequenceFileError", "SequenceStateError", "ShapeError", "TensorTypeError", "UnknownSequenceError",
        "UnsupportedError")},
    **{name: "kvfactory.eviction" for name in ("Observation", "Policy", "register_policy")},
    "KVCacheFactory": "kvfactory.factory",
    "KVCacheManager": "kvfactory.manager", "batch_gather": "kvfactory.manager.gather",
    "PagedKVCacheConfig": "kvfactory.spellings", "PagedQuantizedCacheConfig": "kvfactory.spellings",
    **{name: "kvfactory.storage" for name in ("DenseStore", "LayerStore", "MemoryReport", "PagedPool",
                                              "PagedStore")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvfactory' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
