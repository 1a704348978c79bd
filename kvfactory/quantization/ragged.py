"""Decode attention of a ragged batch over KIVI pages, read in place.

A serving engine decodes many int4 / int2 sequences in one forward. Each sequence's layer keeps whole
key groups in the pool's ``packed`` blocks and its newest tokens in full-precision ``window`` blocks
(``QuantizedStore`` over ``PagedStore``). ``quantized_decode`` attends every sequence over both
without gathering or decoding either: the packed blocks in one call of ``kivi_paged_decode``
(``kvfactory/kernels/kivi.c``: per block, KIVI's key scores from the codes as
``q . (code * scale + zero) = (q * scale) . code + q . zero``, an online softmax, value sums from the
codes; Liu et al. 2024), the windows in one call of the plain paged kernel
(``kvfactory.storage.ragged.paged_decode``), and the two parts merged by their log-sum-exps, as
FlashAttention merges the blocks of a row (Dao et al. 2022). Where every sequence starts with the
same whole packed blocks (a shared prompt), those are decoded once per step (``kivi_paged_dequantize``)
and read once for every query row of the batch (``shared_attention``; Hydragen, Juravsky et al. 2024),
as plain pages read theirs.
"""

from __future__ import annotations

import torch

from kvfactory import kernels
from kvfactory.attention import merge_parts
from kvfactory.codecs import Encoded, native
from kvfactory.quantization.store import PagedRuns, QuantizedStore, append_runs
from kvfactory.storage.paged import front_tokens
from kvfactory.storage.ragged import block_tables, paged_decode, shared_attention, shared_fits, shared_prefix


def in_place(store: object, query_heads: int) -> bool:
    """Whether ``quantized_decode`` reads ``store``: a ``QuantizedStore`` whose packed tokens the C
    kernels read in place (``kernel_pages``), its query heads grouped over its KV heads as they take
    them."""
    if not isinstance(store, QuantizedStore) or not store.kernel_pages:
        return False
    kv_heads = store.like[0].shape[1]
    return query_heads % kv_heads == 0 and query_heads // kv_heads <= native.MAX_ROWS


def flush_windows(stores: list[QuantizedStore], tokens: int) -> None:
    """Encode the oldest ``tokens`` of each store's window (one-row stores of one layer and pool, built
    from one config, each ``batch_flush``-ing that many) with one codec call per side, write the codes
    into their quantized pages with one copy per stream and give the windows' pages back: what each
    store's ``append`` does before its next token joins the window, batched over the sequences."""
    first = stores[0]
    keys, values = front_tokens([store.inner for store in stores], tokens)
    codecs = first.key_codec, first.value_codec
    with torch.no_grad():
        ek, ev = codecs[0].encode(keys), codecs[1].encode(values)
    append_runs([store.packed for store in stores], ek, ev, first.like)
    for i, store in enumerate(stores):
        row = [Encoded({name: t[i:i + 1] for name, t in enc.tensors.items()}, tokens) for enc in (ek, ev)]
        store.took_front(keys[i:i + 1], values[i:i + 1], *row, codecs)


def quantized_decode(query: torch.Tensor, stores: list[QuantizedStore], scale: float,
                     windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
                     ) -> torch.Tensor:
    """Each sequence's query ``[S, Hq, D]`` over store ``stores[s]`` (each ``in_place``, of one layer
    and pool, its new token written): ``[S, Hq, D]`` in ``query``'s dtype. ``windows``: the windows'
    block tables, starts, lengths and shared blocks as ``paged_decode`` takes them (a prompt's window
    pages that the sequences adopted together), where the caller planned them (the layers of a group
    share them), else read from each store."""
    packed = [store.runs if store.quantized_tokens else None for store in stores]
    if windows is None:
        views = [store.inner.pages_in_place() for store in stores]
        if all(view is None for view in views):  # no residual window (``residual: 0``) held a token
            return merge_parts(*_packed_decode(query, stores, packed, scale))[0].to(query.dtype)
        empty = torch.zeros(0, dtype=torch.long)
        windows = (block_tables([empty if v is None else v[1] for v in views]),
                   torch.tensor([0 if v is None else v[2] for v in views]),
                   torch.tensor([0 if v is None else v[3] for v in views]), 0)
    window_pool = next(store.inner.blocks for store in stores if store.inner.blocks is not None)
    tables, starts, lengths, shared = windows
    out, lse = paged_decode(query, window_pool.k, window_pool.v, tables, starts, lengths, scale,
                            check=False, return_lse=True, shared=shared)
    if all(runs is None for runs in packed):
        return out
    return merge_parts((out, lse), *_packed_decode(query, stores, packed, scale))[0].to(query.dtype)


def _packed_decode(query: torch.Tensor, stores: list[QuantizedStore], packed: list[PagedRuns | None],
                   scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The packed part as outputs ``[S, Hq, D]`` with their log-sum-exps ``[S, Hq]`` (float32; ``-inf``
    where a sequence has no packed tokens there) for ``merge_parts``: the blocks every sequence reads
    whole (a shared prompt's, ``shared_prefix``) decoded once and read once for all query rows
    (``shared_attention``), where the kernels take them, and each sequence's other blocks in place."""
    first = next(runs for runs in packed if runs is not None)
    pool, block_tokens = first.table.blocks.tensors, first.block_tokens
    empty = torch.zeros(0, dtype=torch.long)
    tables = block_tables([empty if runs is None else runs.table.ids[0] for runs in packed])
    tokens = torch.tensor([0 if runs is None else runs.tokens for runs in packed])
    shared = shared_prefix(tables, torch.zeros_like(tokens), tokens, block_tokens)
    head = _shared_packed(query, stores[0], pool, tables[0, :shared], scale) if shared else None
    if head is None:
        return [_paged_packed(query, stores[0], pool, tables, tokens, scale)]
    return [head, _paged_packed(query, stores[0], pool, tables[:, shared:], tokens - shared * block_tokens,
                                scale)]


def _paged_packed(query: torch.Tensor, store: QuantizedStore, pool: dict[str, torch.Tensor],
                  tables: torch.Tensor, tokens: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence over its ``tokens`` packed tokens in blocks ``tables`` (one call of
    ``kivi_paged_decode``): output and log-sum-exp."""
    s, hq, d = query.shape
    hkv, num_blocks, key_groups, group_tokens, code_bytes = pool["k.codes"].shape
    q = query.float().contiguous()
    tables = tables.contiguous()
    out = torch.empty(s, hq, d, dtype=torch.float32)
    lse = torch.empty(s, hq, dtype=torch.float32)
    kernels.load("kivi").kivi_paged_decode(
        s, hq, hkv, d, store.key_codec.bits, store.value_codec.group_size, q.data_ptr(), scale,
        *native.pool_pointers(pool), num_blocks, key_groups, group_tokens, code_bytes, tables.data_ptr(),
        tables.shape[1], tokens.data_ptr(), out.data_ptr(), lse.data_ptr())
    return out, lse


def _shared_packed(query: torch.Tensor, store: QuantizedStore, pool: dict[str, torch.Tensor],
                   ids: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every query row over the packed blocks ``ids``: decoded once (``kivi_paged_dequantize``, a few
    hundred KiB per KV head for a 1,024-token prompt, into the store's reused workspace) and read by
    ``shared_attention``; None where that does not take them."""
    hkv, _, key_groups, group_tokens, _ = pool["k.codes"].shape
    d, tokens = query.shape[2], ids.numel() * key_groups * group_tokens
    if not shared_fits(query):
        return None
    keys, values = (store.workspace.buffer(f"shared_{side}", (hkv, 1, tokens, d), query) for side in "kv")
    native.paged_dequantize(pool, ids, store.key_codec.bits, store.value_codec.group_size, keys[:, 0],
                            values[:, 0])
    return shared_attention(query, keys, values, torch.zeros(1, dtype=torch.long), scale)
