"""Tiers: where chunks of K/V live outside the pool, so a prefix computed once is reused later, by
another process or on another machine.

One interface (``Tier``: batched ``get_many`` / ``put_many`` / ``contains_many`` of bytes by key)
over host memory (``HostTier``, LRU in a byte budget), local disk (``DiskTier``, safetensors files
written atomically) and a Redis or Valkey server (``RedisTier``, shared), chained nearest first
with promotion on a hit (``TierChain``). Values are chunks (``chunk``): 256 tokens of every layer's
K/V by default, through an identity, int8, fp8 or int4 codec, under keys that carry the model
fingerprint, the layout, the codec and the chunk's prefix hash. A tier never fails a request: what
it cannot find or read is a miss, what it cannot hold is dropped, and its caller recomputes.
``BackgroundWriter`` writes to a tier off the caller's thread; ``LayerwiseLoad`` reads chunks stored
as layer parts off it, each part usable as soon as it arrives.

This package needs torch, safetensors and the ``redis`` client only (not transformers), so it runs
inside vLLM's virtualenv as well as under kvfactory's own engine.
"""

from kvfactory.tiers.base import Tier, TierStats
from kvfactory.tiers.chain import TierChain
from kvfactory.tiers.chunk import (
    CHUNK_CODECS,
    ChunkError,
    ChunkKey,
    ChunkLayout,
    chunk_keys,
    decode_chunk,
    encode_chunk,
    layer_parts,
    model_fingerprint,
)
from kvfactory.tiers.disk import DiskTier
from kvfactory.tiers.host import HostTier
from kvfactory.tiers.loader import LayerwiseLoad
from kvfactory.tiers.redis_tier import RedisTier
from kvfactory.tiers.writer import BackgroundWriter

__all__ = ["CHUNK_CODECS", "BackgroundWriter", "ChunkError", "ChunkKey", "ChunkLayout", "DiskTier",
           "HostTier", "LayerwiseLoad", "RedisTier", "Tier", "TierChain", "TierStats", "chunk_keys",
           "decode_chunk", "encode_chunk", "layer_parts", "model_fingerprint"]
