"""The prefix cache beyond one process: prompt chunks in kvfactory's tiers (``kvfactory.tiers``).

A manager given ``PrefixTiers`` stores each whole chunk of a prompt (256 tokens by default, every
layer) when its blocks fill, and a new sequence whose prompt misses the manager's own prefix cache
loads the leading chunks the tiers hold instead of computing them. With a Redis tier, a second
engine process reuses the prefixes the first one computed, as vLLM does through kvfactory's
connector (``kvfactory.integrations.vllm``, the same chunks and keys). A chunk that is missing or
fails its checksum ends the loaded run (and a corrupted one is discarded): the rest is computed.
Chunks are read (``read``: the engine starts it when a request arrives and admits the request once
it is done) and encoded and written (``BackgroundWriter``; ``flush`` waits for them) on threads of
their own, so a slow tier never holds up the steps of other requests.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvfactory.errors import ConfigError
from kvfactory.tiers import (
    CHUNK_CODECS,
    BackgroundWriter,
    ChunkError,
    ChunkKey,
    ChunkLayout,
    Tier,
    chunk_keys,
    decode_chunk,
    encode_chunk,
    model_fingerprint,
)

READERS = 4  # prompts read at once: one stalled read does not hold up the others


@dataclass
class ChunkRun:
    """Chunks ``first``, ``first + 1``, ... of a prompt (K/V ``[layers, kv_heads, tokens,
    head_dim]``): the run the tiers held from chunk ``first`` on when they were read."""

    first: int
    chunks: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TierCounters:
    """Chunks moved, chunks dropped unstored (the writer's queue full), chunks that failed to load, and
    the seconds spent loading, and storing (on the writer's thread)."""

    chunks_loaded: int = 0
    chunks_stored: int = 0
    chunks_dropped: int = 0
    load_errors: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0


class PrefixTiers:
    """Prompt chunks of the model ``model_config`` (``dtype`` K/V on ``device``) in ``tiers`` through
    ``codec``, ``chunk_tokens`` tokens each (a multiple of the manager's page size)."""

    def __init__(self, tiers: Tier, model_config: Any, dtype: torch.dtype, codec: str = "identity",
                 chunk_tokens: int = 256, device: torch.device | str = "cpu") -> None:
        if codec not in CHUNK_CODECS:
            raise ConfigError("codec", codec, ", ".join(CHUNK_CODECS))
        text = model_config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        self.tiers, self.codec, self.device = tiers, codec, torch.device(device)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        self.layout = ChunkLayout(layers=text.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim,
                                  tokens=chunk_tokens, dtype=str(dtype).removeprefix("torch."))
        self.model = model_fingerprint(model=getattr(model_config, "_name_or_path", ""),
                                       architectures=getattr(model_config, "architectures", None),
                                       hidden_size=text.hidden_size,
                                       vocab_size=getattr(text, "vocab_size", None))
        self.counters = TierCounters()
        self.writer = BackgroundWriter(tiers)
        self._reader = ThreadPoolExecutor(READERS, thread_name_prefix="kvfactory-tier-read")
        self._lock = threading.Lock()  # the counters, written from the reader and writer threads

    @property
    def tokens(self) -> int:
        """Tokens per chunk."""
        return self.layout.tokens

    def keys(self, tokens: list[int]) -> list[ChunkKey]:
        return chunk_keys(tokens, self.model, self.layout, self.codec)

    def load(self, keys: list[ChunkKey]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V ``[layers, kv_heads, tokens, head_dim]`` of the leading run of ``keys`` the tiers hold."""
        began = time.perf_counter()
        found = self.tiers.get_many([str(key) for key in keys])
        chunks = []
        for key, data in zip(keys, found, strict=True):
            if data is None:
                break
            try:
                chunks.append(decode_chunk(data, key))
            except ChunkError:
                with self._lock:
                    self.counters.load_errors += 1
                self.tiers.discard_many([str(key)])  # computed and stored anew by this request
                break
        with self._lock:  # reader threads count at once
            self.counters.chunks_loaded += len(chunks)
            self.counters.load_seconds += time.perf_counter() - began
        return chunks

    def read(self, tokens: list[int], first: int = 0) -> Future[ChunkRun]:
        """Start reading, on one of the tiers' reader threads, the run of a prompt's chunks from
        chunk ``first`` on that the tiers hold (leaving the prompt's last token to compute)."""
        keys = self.keys(tokens[:-1])[first:]
        return self._reader.submit(lambda: ChunkRun(first, self.load(keys)))

    def store(self, items: list[tuple[ChunkKey, torch.Tensor, torch.Tensor]]) -> None:
        """Queue chunks (key, keys, values; tensors the caller no longer writes) to be encoded and
        written in one batch off this thread (``BackgroundWriter``)."""
        def encoded() -> list[tuple[str, bytes]]:
            began = time.perf_counter()
            batch = [(str(key), encode_chunk(key, k, v)) for key, k, v in items]
            with self._lock:
                self.counters.store_seconds += time.perf_counter() - began
            return batch

        if not items:
            return
        nbytes = sum(k.nbytes + v.nbytes for _, k, v in items)
        if self.writer.submit(len(items), nbytes, encoded):
            self.counters.chunks_stored += len(items)
        else:
            self.counters.chunks_dropped += len(items)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every chunk queued so far is written (False if ``timeout`` seconds passed)."""
        return self.writer.flush(timeout)
