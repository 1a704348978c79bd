"""A reusable read buffer: reads that must materialise K/V (multi-row paged reads, decoded codecs)
write into one buffer per slot, shared by every layer and cache of its owner, instead of fresh memory."""

from __future__ import annotations

import math

import torch


class ReadWorkspace:
    """Buffers by slot name, grown by 1.25x when a read needs more.

    Writing fresh memory costs more than the copy itself (page faults), so reads reuse one buffer
    per slot; a read stays valid until the next read of the same slot, which within a forward pass
    is the next layer's, after this layer's attention is done. Not for concurrent forward passes.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A ``shape`` view of slot ``slot``'s buffer, with ``like``'s dtype and device."""
        need = math.prod(shape)
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < need or buf.dtype != like.dtype or buf.device != like.device:
            with torch.inference_mode(False):  # the buffer outlives any one inference_mode block
                buf = like.new_empty(need + need // 4)
            self._buffers[slot] = buf
        return buf[:need].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._buffers.values())
