"""Sub-byte packing: 4-bit codes two per byte, 2-bit codes four per byte, along the last dim.

The layout is planar: ``D`` codes are padded with zero codes to ``n * P`` (``n`` codes per byte,
``P = ceil(D * bits / 8)`` bytes) and byte ``j`` holds codes ``j, j + P, ..., j + (n - 1) * P``,
code ``q`` in bits ``[q * bits, (q + 1) * bits)``. Unpacking then yields whole contiguous planes
with one shift and one mask each, done on 32-bit words (four bytes at once) when the bytes allow it,
and copied straight into the decoder's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packed_size(dim: int, bits: int) -> int:
    """Bytes that ``dim`` codes of ``bits`` bits take."""
    return -(-dim * bits // 8)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """``[n, 1]`` shift of each plane, to broadcast over ``[..., n, P]``."""
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device).unsqueeze(-1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` ``[..., D]`` (each < 2**bits) into ``[..., ceil(D * bits / 8)]`` bytes."""
    dim, size = codes.shape[-1], packed_size(codes.shape[-1], bits)
    n = 8 // bits
    if n * size > dim:
        codes = F.pad(codes, (0, n * size - dim))
    planes = codes.unflatten(-1, (n, size))
    return (planes << _shifts(bits, codes.device)).sum(-2, dtype=torch.uint8)


def _as_words(packed: torch.Tensor) -> bool:
    """Whether ``packed`` can be viewed as int32 words (last dim of whole, aligned words)."""
    return (packed.stride(-1) == 1 and packed.storage_offset() % 4 == 0
            and all(s % 4 == 0 for s in (*packed.stride()[:-1], packed.shape[-1])))


def unpack(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Write the codes ``pack`` stored in ``packed`` into ``out`` ``[..., D]`` (any dtype) and return it.

    One shift, one mask and one copy per plane (at most four), on int32 words when possible; no
    temporary as large as ``out``.
    """
    size, dim, mask = packed.shape[-1], out.shape[-1], 2 ** bits - 1
    words = _as_words(packed)
    source = packed.view(torch.int32) if words else packed
    plane_mask = int.from_bytes(bytes([mask] * 4), "little") if words else mask
    for q, start in enumerate(range(0, dim, size)):
        plane = (source >> (bits * q)) & plane_mask
        out[..., start:start + size].copy_(plane.view(torch.uint8)[..., :dim - start])
    return out
