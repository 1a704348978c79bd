"""A sequence's KV as plain tensors: what pausing moves to the host tier and what a save writes.

``SequenceState.capture`` copies every layer's stored keys and values (``[batch, kv_heads, tokens,
head_dim]``) and the tokens each layer has seen; ``restore`` writes them back into an empty cache of
the same config, checking the pool first so that a restore is written whole or not at all. Only
storage whose reads are its exact contents (plain paged) is captured, so a round trip is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.cache import KVCache
from kvfactory.errors import SequenceStateError, ShapeError, UnsupportedError
from kvfactory.storage.paged import PagedStore


@dataclass
class SequenceState:
    """Per layer: stored keys and values (None for a layer that holds nothing) and tokens seen;
    ``front``: only the oldest stored tokens (a partial swap: the rest stayed in the pool)."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    seen: list[int]
    front: bool = False

    @classmethod
    def capture(cls, cache: KVCache, device: torch.device | str = "cpu", tokens: int | None = None
                ) -> SequenceState:
        """A copy of every layer's stored K/V (the first ``tokens`` of them only, if given)."""
        keys, values, seen = [], [], []
        for layer in cache.layers:
            if type(layer.store) is not PagedStore:
                raise UnsupportedError(f"layer {layer.store.layer_idx}: {type(layer.store).__name__} cannot "
                                       f"be paused or saved yet; use plain paged storage "
                                       f"({{'type': 'paged'}})")
            held = layer.store.size() > 0
            k, v = layer.store.gather() if held else (None, None)
            if k is not None and tokens is not None:
                k, v = k[:, :, :tokens], v[:, :, :tokens]
            keys.append(None if k is None else k.to(device, copy=True))
            values.append(None if v is None else v.to(device, copy=True))
            seen.append(layer.seen)
        return cls(keys, values, seen, front=tokens is not None)

    def joined(self, rest: SequenceState) -> SequenceState:
        """This front followed by ``rest`` (the tokens that stayed in the pool): the whole sequence."""
        def cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
            return b if a is None else a if b is None else torch.cat([a, b.to(a.device)], 2)

        return SequenceState([cat(a, b) for a, b in zip(self.keys, rest.keys, strict=True)],
                             [cat(a, b) for a, b in zip(self.values, rest.values, strict=True)], rest.seen)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys, *self.values) if t is not None)

    @property
    def length(self) -> int:
        """Tokens seen (the cache's ``get_seq_length``)."""
        return max(self.seen, default=0)

    def staged(self, device: torch.device | str) -> SequenceState:
        """This state with its tensors on ``device`` (what ``KVCacheManager.prefetch`` runs on a
        background thread, so that ``resume`` only writes blocks); pinned host memory on CUDA."""
        target = torch.device(device)

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device == target:
                return t
            return (t.pin_memory() if target.type == "cuda" else t).to(target, non_blocking=True)

        def moved() -> SequenceState:
            return SequenceState([move(k) for k in self.keys], [move(v) for v in self.values],
                                 list(self.seen), self.front)

        if target.type != "cuda":
            return moved()
        stream = torch.cuda.Stream(target)  # copies overlap the compute on the default stream
        with torch.cuda.stream(stream):
            staged = moved()
        stream.synchronize()
        return staged

    def restore(self, cache: KVCache, device: torch.device | str) -> None:
        """Write the state into ``cache`` (empty, same layers; for a ``front``, in front of what the cache
        kept); ``CacheFullError`` leaves the cache as it was."""
        if len(self.keys) != len(cache.layers):
            raise ShapeError(f"a state of {len(self.keys)} layers cannot fill a cache of {len(cache.layers)}")
        if cache.get_seq_length() and not self.front:
            raise SequenceStateError(f"restore into a cache holding {cache.get_seq_length()} tokens")
        moved = [(None, None) if k is None else (k.to(device), v.to(device))
                 for k, v in zip(self.keys, self.values, strict=True)]
        check = getattr(cache.shared, "check", None)
        if check is not None:
            check([request for layer, (k, v) in zip(cache.layers, moved, strict=True) if k is not None
                   for request in layer.store.block_requests(k.shape[2], k.shape[0], k, v)])
        for layer, (k, v), seen in zip(cache.layers, moved, self.seen, strict=True):
            if k is not None and self.front:
                layer.store.prepend(k, v)
            elif k is not None:
                layer.append(k, v)
            layer.seen = seen
