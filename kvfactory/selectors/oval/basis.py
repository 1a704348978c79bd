"""Each layer's principal key directions: the training-free start of OVAL's learned projections.

Loki (Singhania et al., 2024, "Loki: Low-Rank Keys for Efficient Sparse Attention") finds that keys
live near a low-rank subspace, so scoring in the top eigenvectors of the key moment keeps most of
the query-key dot product. Both the query scorer and the block gate start from that basis.
"""

from __future__ import annotations

import torch


def principal_key_directions(keys: torch.Tensor, count: int) -> torch.Tensor:
    """``keys [layers, Hkv, T, D]`` -> ``[layers, Hkv, D, count]``: per layer and KV head, the ``count``
    eigenvectors of the key moment with the largest eigenvalues, largest first."""
    keys = keys.float()
    moment = keys.transpose(-1, -2) @ keys / keys.shape[2]
    return torch.linalg.eigh(moment).eigenvectors[..., -count:].flip(-1)
