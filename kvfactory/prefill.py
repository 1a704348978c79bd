"""Prefill a long prompt in chunks, so an evicting cache compresses as the prompt arrives.

With a token ``budget`` each chunk is compressed right after its attention, so the KV memory of a
6k-token prompt peaks at about budget + chunk tokens per layer instead of the prompt's length
(``EvictionStore.peak_bytes`` records it); any other cache simply fills chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from kvfactory.errors import ConfigError


@torch.no_grad()
def prefill_in_chunks(model: Any, input_ids: torch.Tensor, cache: Any, chunk_size: int = 512) -> torch.Tensor:
    """Feed ``input_ids`` ``[B, T]`` (no padding) through ``model`` into ``cache``, ``chunk_size`` tokens
    at a time; returns the logits of the last position ``[B, vocab]``.

    To continue with ``generate``, prefill all but the last prompt token, then call
    ``model.generate(input_ids, past_key_values=cache)``: it feeds only what the cache has not seen.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError("chunk_size", chunk_size, "an integer >= 1")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ConfigError("input_ids", tuple(input_ids.shape), "a [batch, tokens] tensor with tokens >= 1")
    logits = None
    for start in range(0, input_ids.shape[1], chunk_size):
        logits = model(input_ids[:, start:start + chunk_size], past_key_values=cache, use_cache=True).logits
    return logits[:, -1]
