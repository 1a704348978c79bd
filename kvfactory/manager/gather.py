"""``batch_gather``: several sequences' caches as one padded batch of keys and values, for code that
attends over a batch itself (the design article's utility of that name)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfactory.cache import KVCache
from kvfactory.errors import ShapeError


def batch_gather(caches: Sequence[KVCache], layer_idx: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``layer_idx`` of every cache (one sequence each), right-aligned to the longest:
    keys and values ``[len(caches), kv_heads, longest, head_dim]`` (copies; zeros before a shorter
    sequence's first token, as left padding puts them) and a ``[len(caches), longest]`` bool mask
    of the stored tokens."""
    if not caches:
        raise ShapeError("batch_gather needs at least one cache")
    gathered = [cache.gather(layer_idx) for cache in caches]
    for i, (keys, _) in enumerate(gathered):
        if keys.shape[0] != 1:
            raise ShapeError(f"cache {i} holds {keys.shape[0]} rows; batch_gather takes a sequence per cache")
    first = gathered[0][0]
    longest = max(keys.shape[-2] for keys, _ in gathered)
    shape = (len(caches), first.shape[1], longest, first.shape[-1])
    keys_out, values_out = first.new_zeros(shape), gathered[0][1].new_zeros(shape)
    mask = torch.zeros(len(caches), longest, dtype=torch.bool)
    for i, (keys, values) in enumerate(gathered):
        if keys.shape[1] != shape[1] or keys.shape[-1] != shape[-1]:
            raise ShapeError(f"cache {i}: {keys.shape[1]} KV heads of {keys.shape[-1]} dims, cache 0: "
                             f"{shape[1]} of {shape[-1]}")
        start = longest - keys.shape[-2]
        keys_out[i, :, start:], values_out[i, :, start:] = keys[0], values[0]
        mask[i, start:] = True
    return keys_out, values_out, mask
