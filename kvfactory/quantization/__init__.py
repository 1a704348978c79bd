"""Quantized storage: codec-packed K/V runs over dense or paged storage (``store.py``)."""

from kvfactory.quantization.store import QuantizedRead, QuantizedStore

__all__ = ["QuantizedRead", "QuantizedStore"]
