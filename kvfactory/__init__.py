"""kvfactory: composable KV-cache management for Hugging Face transformers."""

from kvfactory.cache import KVCache, watch_hidden_states
from kvfactory.config import CacheConfig, register_cache_strategy, registered_strategies
from kvfactory.errors import (
    CacheFullError,
    ConfigError,
    KVFactoryError,
    SequenceFileError,
    SequenceStateError,
    ShapeError,
    UnknownSequenceError,
    UnsupportedError,
)
from kvfactory.eviction import Observation, Policy, register_policy
from kvfactory.factory import KVCacheFactory
from kvfactory.manager import KVCacheManager
from kvfactory.storage import DenseStore, LayerStore, MemoryReport, PagedPool, PagedStore

__version__ = "0.1.0"

__all__ = [
    "CacheConfig", "CacheFullError", "ConfigError", "DenseStore", "KVCache", "KVCacheFactory",
    "KVCacheManager", "KVFactoryError", "LayerStore", "MemoryReport", "Observation", "PagedPool",
    "PagedStore", "Policy", "SequenceFileError", "SequenceStateError", "ShapeError", "UnknownSequenceError",
    "UnsupportedError", "register_cache_strategy", "register_policy", "registered_strategies",
    "watch_hidden_states",
]
