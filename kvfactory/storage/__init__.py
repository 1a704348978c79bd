"""Where KV bytes live: dense per-cache tensors or a shared paged block pool."""

from kvfactory.storage.base import LayerStore, MemoryReport
from kvfactory.storage.blocks import BlockPool, PagedPool
from kvfactory.storage.dense import DenseStore
from kvfactory.storage.paged import PagedStore

__all__ = ["BlockPool", "DenseStore", "LayerStore", "MemoryReport", "PagedPool", "PagedStore"]
