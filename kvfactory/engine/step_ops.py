"""The compiled steps' attention as torch custom ops, so that ``torch.compile`` traces a whole step
(``kvfactory.engine.compiled``) with no graph break at attention: each op stores a layer's new K/V
and reads its sequences' pages, opaque to the compiler, over tensors the step planned before the
forward. ``paged_decode_step`` reads plain pages (vLLM's PagedAttention, Kwon et al. 2023);
``quantized_decode_step`` KIVI pages (Liu et al. 2024) and their full-precision windows, merged by
their log-sum-exps; ``paged_prefill_step`` reads plain pages for prefill steps, causally, and
``quantized_prefill_step`` KIVI pages' windows so and their packed tokens whole (a chunk that encodes
some of its own tokens: those encoded and decoded too)."""

from __future__ import annotations

import torch

from kvfactory.attention import merge_parts
from kvfactory.quantization.ragged import own_flush_chunk, packed_parts, packed_prefill_parts
from kvfactory.storage.paged import write_tokens
from kvfactory.storage.ragged import paged_decode, paged_prefill

PACKED = ("k.codes", "k.scale", "k.zero", "v.codes", "v.scale", "v.zero")  # a pool of KIVI pages' tensors


@torch.library.custom_op("kvfactory::paged_decode_step", mutates_args=("k_pool", "v_pool"))
def paged_decode_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
                      lengths: torch.Tensor, shared: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token per sequence: write ``key`` / ``value [1, Hkv, S, D]`` into ``slots [S]`` of the
    layer's pools ``[Hkv, blocks, page_size, D]``, then attend with ``query [1, Hq, S, D]`` over each
    sequence's blocks (``paged_decode``'s ``tables``, ``starts``, ``lengths`` and ``shared`` blocks, a
    0-d tensor so that no count recompiles): ``[1, S, Hq, Dv]``."""
    write_tokens(k_pool, slots, key[0])
    write_tokens(v_pool, slots, value[0])
    out = paged_decode(query[0].transpose(0, 1), k_pool, v_pool, tables, starts, lengths, scale, check=False,
                       shared=int(shared))
    return out[None]


@paged_decode_step.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
      slots: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
      shared: torch.Tensor, scale: float) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], v_pool.shape[-1])


@torch.library.custom_op("kvfactory::quantized_decode_step", mutates_args=("k_pool", "v_pool"))
def quantized_decode_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                          v_pool: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                          starts: torch.Tensor, lengths: torch.Tensor, shared: torch.Tensor,
                          packed: list[torch.Tensor], packed_tables: torch.Tensor,
                          packed_tokens: torch.Tensor, packed_shared: torch.Tensor, decoded: torch.Tensor,
                          scale: float, bits: int, group: int) -> torch.Tensor:
    """One decode token per sequence over KIVI pages: write ``key`` / ``value`` into the full-precision
    windows and read them as ``paged_decode_step`` does, read the packed tokens of the layer's pool
    ``packed`` (its ``PACKED`` tensors) by ``packed_parts`` (``packed_tables``, ``packed_tokens`` and
    ``packed_shared`` blocks, those decoded in ``decoded [2, Hkv, tokens, D]``, unread where there are
    none; ``bits`` per code, values grouped by ``group`` channels), and merge the two: ``[1, S, Hq, Dv]``."""
    write_tokens(k_pool, slots, key[0])
    write_tokens(v_pool, slots, value[0])
    query = query[0].transpose(0, 1)
    window = paged_decode(query, k_pool, v_pool, tables, starts, lengths, scale, check=False,
                          return_lse=True, shared=int(shared))
    codes = packed_parts(query, dict(zip(PACKED, packed, strict=True)), bits, group, packed_tables,
                         packed_tokens, int(packed_shared), scale, decoded)
    return merge_parts(window, *codes)[0].to(query.dtype)[None]


@quantized_decode_step.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
      slots: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
      shared: torch.Tensor, packed: list[torch.Tensor], packed_tables: torch.Tensor,
      packed_tokens: torch.Tensor, packed_shared: torch.Tensor, decoded: torch.Tensor, scale: float,
      bits: int, group: int) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], v_pool.shape[-1])


@torch.library.custom_op("kvfactory::paged_prefill_step", mutates_args=("k_pool", "v_pool"))
def paged_prefill_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor, tables: torch.Tensor,
                       totals: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill chunks (and decode tokens, chunks of one) of several sequences, packed: write ``key`` /
    ``value [1, Hkv, T, D]`` into ``slots [T]`` of the layer's pools ``[Hkv, blocks, page_size, D]``,
    then each chunk attends causally over its sequence's blocks (``paged_prefill``'s ``bounds``,
    ``tables`` and ``totals``): ``[1, T, Hq, Dv]``."""
    write_tokens(k_pool, slots, key[0])
    write_tokens(v_pool, slots, value[0])
    query = query[0] if query.stride(-1) == 1 else query[0].contiguous()
    return paged_prefill(query, k_pool, v_pool, bounds, tables, totals, scale)[None]


@paged_prefill_step.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
      slots: torch.Tensor, bounds: torch.Tensor, tables: torch.Tensor, totals: torch.Tensor, scale: float
      ) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], v_pool.shape[-1])


@torch.library.custom_op("kvfactory::quantized_prefill_step", mutates_args=("k_pool", "v_pool"))
def quantized_prefill_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor,
                           tables: torch.Tensor, totals: torch.Tensor, packed: list[torch.Tensor],
                           packed_tables: torch.Tensor, packed_tokens: torch.Tensor,
                           packed_shared: torch.Tensor, own_flush: torch.Tensor, scale: float, bits: int,
                           group: int) -> torch.Tensor:
    """Prefill chunks (and decode tokens) over KIVI pages whose full-precision windows take the step's
    tokens: write ``key`` / ``value`` into the windows and attend over them as ``paged_prefill_step``
    does, attend over every packed token of the layer's pool ``packed`` (its ``PACKED`` tensors) by
    ``packed_prefill_parts`` (``packed_tables``, ``packed_tokens`` and ``packed_shared`` blocks; ``bits``
    per code, values grouped by ``group`` channels), and merge the two: ``[1, T, Hq, Dv]``. Chunk ``j``
    with ``own_flush[j]`` tokens to encode after the step (some of its own) reads those of its window
    encoded and decoded (``own_flush_chunk``)."""
    write_tokens(k_pool, slots, key[0])
    write_tokens(v_pool, slots, value[0])
    query = query[0] if query.stride(-1) == 1 else query[0].contiguous()
    ends, flushes = bounds.tolist(), own_flush.tolist()
    own = {j: flush for j, flush in enumerate(flushes[:len(ends) - 1]) if flush}
    out, lse = paged_prefill(query, k_pool, v_pool, bounds, tables, totals, scale, return_lse=True,
                             skip=frozenset(own))
    pool = dict(zip(PACKED, packed, strict=True))
    rows = query.transpose(0, 1)
    for j, flush in own.items():
        chunk = slice(ends[j], ends[j + 1])
        out[chunk], lse[chunk] = own_flush_chunk(rows[chunk], k_pool, v_pool, tables[j], int(totals[j]), pool,
                                                 bits, group, flush, scale)
    codes = packed_prefill_parts(rows, pool, bits, group, bounds, packed_tables, packed_tokens,
                                 int(packed_shared), scale)
    return merge_parts((out, lse), *codes)[0].to(query.dtype)[None]


@quantized_prefill_step.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
      slots: torch.Tensor, bounds: torch.Tensor, tables: torch.Tensor, totals: torch.Tensor,
      packed: list[torch.Tensor], packed_tables: torch.Tensor, packed_tokens: torch.Tensor,
      packed_shared: torch.Tensor, own_flush: torch.Tensor, scale: float, bits: int, group: int
      ) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], v_pool.shape[-1])
