"""transformers' own cache options as named peers of kvfactory configs in an evaluation.

- ``transformers/quanto-int4``, ``-int2``, ``transformers/hqq-int4``, ``-int2``: ``QuantizedCache``
  (KIVI-style: a residual of up to 128 recent tokens in full precision, the rest quantized in
  groups of 64). The backends are the optional extra ``kvfactory[peers]`` (optimum-quanto, hqq).
- ``transformers/sliding-window-W``: every layer a ``DynamicSlidingWindowLayer`` keeping the last
  ``W`` tokens (transformers' sliding-window option, applied to a full-attention model).

``peer_maker(name, model)`` returns a ``make_cache`` callable as ``kvfactory.eval.tasks`` expects;
``peer_footprint(cache)`` measures a quantized cache, whose quantized tensors ``cache_footprint``
does not see.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from typing import Any

import torch

from kvfactory.eval.footprint import CacheFootprint, cache_footprint

PREFIX = "transformers/"
QUANTIZED = {"quanto-int4": ("quanto", 4), "quanto-int2": ("quanto", 2),
             "hqq-int4": ("hqq", 4), "hqq-int2": ("hqq", 2)}
_BACKEND_MODULES = {"quanto": ("optimum.quanto", "optimum-quanto==0.2.7"), "hqq": ("hqq", "hqq==0.2.8.post1")}
_SLIDING = re.compile(r"sliding-window-([1-9][0-9]*)")


class PeerError(ValueError):
    """An unknown peer name, or a peer whose backend is not installed."""


def peer_names() -> list[str]:
    """The peer names (the sliding window as ``sliding-window-W``)."""
    return [PREFIX + n for n in QUANTIZED] + [PREFIX + "sliding-window-W"]


def is_peer(name: str) -> bool:
    return name.startswith(PREFIX)


def check_peer(name: str) -> None:
    """Raise ``PeerError`` for an unknown peer or a missing backend (before any model loads)."""
    short = name[len(PREFIX):] if is_peer(name) else name
    if short in QUANTIZED:
        backend = QUANTIZED[short][0]
        module, requirement = _BACKEND_MODULES[backend]
        if _missing(module):
            raise PeerError(f"{name}: the {backend} backend is not installed; install the optional extra "
                            f"with `pip install 'kvfactory[peers]'` (or `pip install {requirement}`)")
        return
    if _SLIDING.fullmatch(short):
        return
    raise PeerError(f"unknown peer {name!r}: expected one of {', '.join(peer_names())} (W a positive "
                    f"number of tokens)")


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def peer_maker(name: str, model: Any) -> Callable[[], Any]:
    """A ``make_cache`` callable building fresh caches of peer ``name`` for ``model``."""
    from transformers import QuantizedCache
    from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

    check_peer(name)
    short = name[len(PREFIX):]
    if short in QUANTIZED:
        backend, nbits = QUANTIZED[short]
        return lambda: QuantizedCache(backend=backend, config=model.config, nbits=nbits)
    window = int(_SLIDING.fullmatch(short).group(1))
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return lambda: Cache(layers=[DynamicSlidingWindowLayer(sliding_window=window) for _ in range(layers)])


def _tensor_bytes(obj: Any, seen: set[int]) -> int:
    """Storage bytes of every tensor in ``obj`` (nested tuples, lists, dicts, tensor subclasses)."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), seen) for n in names)
        storage = obj.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def peer_footprint(cache: Any) -> CacheFootprint:
    """The footprint of any transformers cache, counting quantized tensors and their scales.

    A quantized cache stores every token it has seen (its compression is in the bits, not in
    dropped tokens), so its ``compression_ratio`` is 0 as kvpress defines it.
    """
    base = cache_footprint(cache)
    if not any(hasattr(layer, "_quantized_keys") for layer in cache.layers):
        return base
    seen: set[int] = set()
    held = sum(_tensor_bytes([layer.keys, layer.values, layer._quantized_keys, layer._quantized_values], seen)
               for layer in cache.layers)
    tokens = base.tokens_seen
    return CacheFootprint(held, tokens, float(tokens), held / tokens if tokens else 0.0, 0.0)
