"""A sequence's KV as named tensors: what pausing moves to the host tier and what a save writes.

``SequenceState.capture`` copies what every layer's store holds, as the store exports it
(``LayerStore.export_state``: plain pages as their keys and values, quantized pages as their packed
codes, scales and zero points plus the full-precision window, never decoded), and the tokens each
layer has seen; ``restore`` hands them back to the stores of an empty cache of the same config
(``import_state``), so a round trip is bit-exact. A ``front`` state holds only the oldest pages of
plain paged layers (a partial swap) and goes back in front of what stayed in the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.cache import KVCache
from kvfactory.errors import SequenceStateError, ShapeError

Tensors = dict[str, torch.Tensor]


@dataclass
class SequenceState:
    """Per layer: the store's exported tensors (empty for a layer that holds nothing) and tokens seen;
    ``front``: only the oldest stored tokens (plain pages; the rest stayed in the pool)."""

    layers: list[Tensors]
    seen: list[int]
    front: bool = False
    token_ids: list[int] | None = None  # the cache's token record (``KVCache.token_ids``), if known

    @classmethod
    def capture(cls, cache: KVCache, device: torch.device | str = "cpu", tokens: int | None = None
                ) -> SequenceState:
        """A copy of what every layer stores (its first ``tokens`` only, if given)."""
        layers = [{name: t.to(device, copy=True) for name, t in layer.store.export_state(tokens).items()}
                  for layer in cache.layers]
        token_ids = None if cache.token_ids is None else list(cache.token_ids)
        return cls(layers, [layer.seen for layer in cache.layers], tokens is not None, token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer.values())

    def joined(self, rest: SequenceState) -> SequenceState:
        """This front followed by ``rest`` (the tokens that stayed in the pool): the whole sequence."""
        layers = []
        for front, back in zip(self.layers, rest.layers, strict=True):
            joined = {name: torch.cat([t, back[name].to(t.device)], 2) if name in back else t
                      for name, t in front.items()}
            layers.append(joined if front else back)
        return SequenceState(layers, rest.seen, token_ids=rest.token_ids)

    def staged(self, device: torch.device | str) -> SequenceState:
        """This state with its tensors on ``device`` (what ``KVCacheManager.prefetch`` runs on a
        background thread, so that ``resume`` only writes blocks); pinned host memory on CUDA."""
        target = torch.device(device)

        def moved() -> SequenceState:
            return SequenceState([{name: move(t) for name, t in layer.items()} for layer in self.layers],
                                 list(self.seen), self.front, self.token_ids)

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device == target:
                return t
            return (t.pin_memory() if target.type == "cuda" else t).to(target, non_blocking=True)

        if target.type != "cuda":
            return moved()
        stream = torch.cuda.Stream(target)  # copies overlap the compute on the default stream
        with torch.cuda.stream(stream):
            staged = moved()
        stream.synchronize()
        return staged

    def restore(self, cache: KVCache, device: torch.device | str) -> None:
        """Write the state into ``cache`` (empty, same layers; for a ``front``, in front of what the cache
        kept). Plain pages are checked against the pool first, so ``CacheFullError`` writes nothing."""
        if len(self.layers) != len(cache.layers):
            raise ShapeError(f"a state of {len(self.layers)} layers cannot fill a cache of "
                             f"{len(cache.layers)}")
        if cache.get_seq_length() and not self.front:
            raise SequenceStateError(f"restore into a cache holding {cache.get_seq_length()} tokens")
        moved = [{name: t.to(device) for name, t in layer.items()} for layer in self.layers]
        if cache.shared is not None:
            requests = []
            for layer, tensors in zip(cache.layers, moved, strict=True):
                if "keys" in tensors:  # plain pages (quantized ones are written layer by layer)
                    keys, values = tensors["keys"], tensors["values"]
                    requests += layer.store.block_requests(keys.shape[2], keys.shape[0], keys, values)
            cache.shared.check(requests)
        for layer, tensors, seen in zip(cache.layers, moved, self.seen, strict=True):
            if tensors and self.front:
                layer.store.prepend(tensors["keys"], tensors["values"])
            elif tensors:
                layer.store.import_state(tensors)
                layer.is_initialized, layer.device = True, torch.device(device)
            layer.seen = seen
        if not self.front:
            cache.token_ids = None if self.token_ids is None else list(self.token_ids)
