"""Chained hashes of token blocks: a block's name stands for its whole prefix.

As in vLLM's automatic prefix caching, block ``i`` of a prompt is named by a hash of block
``i - 1``'s name and its own tokens, so equal names mean equal prefixes (and equal K/V). The
prefix cache names its pages this way (``kvfactory.manager.prefix``) and the tiers their chunks
(``kvfactory.tiers.chunk``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def block_hashes(tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """The chained names of the full blocks of ``block_tokens`` tokens in ``tokens``."""
    names, parent = [], b""
    array = np.asarray(tokens, dtype=np.int64)
    for i in range(len(array) // block_tokens):
        parent = hashlib.blake2b(parent + array[i * block_tokens:(i + 1) * block_tokens].tobytes(),
                                 digest_size=16).digest()
        names.append(parent)
    return names
