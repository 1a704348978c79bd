"""Decode attention of a ragged batch over KIVI pages, read in place.

A serving engine decodes many int4 / int2 sequences in one forward. Each sequence's layer keeps whole
key groups in the pool's ``packed`` blocks and its newest tokens in full-precision ``window`` blocks
(``QuantizedStore`` over ``PagedStore``). ``quantized_decode`` attends every sequence over both
without gathering or decoding either: the packed blocks in one call of ``kivi_paged_decode``
(``kvfactory/kernels/kivi.c``: per block, KIVI's key scores from the codes as
``q . (code * scale + zero) = (q * scale) . code + q . zero``, an online softmax, value sums from the
codes; Liu et al. 2024), the windows in one call of the plain paged kernel
(``kvfactory.storage.ragged.paged_decode``), and the two parts merged by their log-sum-exps, as
FlashAttention merges the blocks of a row (Dao et al. 2022).
"""

from __future__ import annotations

import torch

from kvfactory import kernels
from kvfactory.codecs import Encoded, native
from kvfactory.quantization.store import PagedRuns, QuantizedStore, append_runs
from kvfactory.storage.paged import front_tokens
from kvfactory.storage.ragged import block_tables, paged_decode

MAX_DIM, MAX_ROWS, MAX_BLOCK = 512, 64, 256  # as in kivi.c


def in_place(store: object, query_heads: int) -> bool:
    """Whether ``quantized_decode`` reads ``store``: a one-row ``QuantizedStore`` over paged storage
    with KIVI keys and values of one bit width, its packed tokens from the start of their first block,
    sizes the kernel takes, on the CPU with the C kernels built."""
    if not isinstance(store, QuantizedStore) or not store.inner.plain_pages:
        return False
    keys, values, like = store.key_codec, store.value_codec, store.like
    if (keys.kernel_layout, values.kernel_layout) != ("kivi-keys", "kivi-values") or keys.bits != values.bits:
        return False
    if like is None or like[0].shape[0] != 1 or like[0].device.type != "cpu" or not native.available():
        return False
    head_dim, kv_heads = like[0].shape[3], like[0].shape[1]
    packed = store.runs
    return (like[1].shape[3] == head_dim <= MAX_DIM and query_heads % kv_heads == 0
            and query_heads // kv_heads <= MAX_ROWS
            and (packed is None or (isinstance(packed, PagedRuns) and packed.table.start == 0
                                    and packed.block_tokens <= MAX_BLOCK)))


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
                     windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each sequence's query ``[S, Hq, D]`` over store ``stores[s]`` (each ``in_place``, of one layer
    and pool, its new token written): ``[S, Hq, D]`` in ``query``'s dtype. ``windows``: the windows'
    block tables, starts and lengths as ``paged_decode`` takes them, where the caller planned them
    (the layers of a group share them), else read from each store."""
    packed = [store.runs if store.quantized_tokens else None for store in stores]
    if windows is None:
        views = [store.inner.pages_in_place() for store in stores]
        if all(view is None for view in views):  # no residual window (``residual: 0``) held a token
            return _packed_decode(query, stores, packed, scale)[0].to(query.dtype)
        empty = torch.zeros(0, dtype=torch.long)
        windows = (block_tables([empty if v is None else v[1] for v in views]),
                   torch.tensor([0 if v is None else v[2] for v in views]),
                   torch.tensor([0 if v is None else v[3] for v in views]))
    window_pool = next(store.inner.blocks for store in stores if store.inner.blocks is not None)
    tables, starts, lengths = windows
    out, lse = paged_decode(query, window_pool.k, window_pool.v, tables, starts, lengths, scale,
                            check=False, return_lse=True)
    if all(runs is None for runs in packed):
        return out
    quantized, quantized_lse = _packed_decode(query, stores, packed, scale)
    merged = torch.logaddexp(lse, quantized_lse)
    weights = (lse - merged).exp()[..., None], (quantized_lse - merged).exp()[..., None]
    out = out.float() * weights[0] + quantized * weights[1]
    return out.to(query.dtype)


def _packed_decode(query: torch.Tensor, stores: list[QuantizedStore], packed: list[PagedRuns | None],
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed part: output ``[S, Hq, D]`` and log-sum-exp ``[S, Hq]`` (float32; ``-inf`` where a
    sequence has no packed tokens yet)."""
    first = next(runs for runs in packed if runs is not None)
    pool = first.table.blocks.tensors
    keys, values = stores[0].key_codec, stores[0].value_codec
    empty = torch.zeros(0, dtype=torch.long)
    tables = block_tables([empty if runs is None else runs.table.ids[0] for runs in packed])
    tokens = torch.tensor([0 if runs is None else runs.tokens for runs in packed])
    s, hq, d = query.shape
    hkv, num_blocks, key_groups, group_tokens, code_bytes = pool["k.codes"].shape
    q = query.float().contiguous()
    out = torch.empty(s, hq, d, dtype=torch.float32)
    lse = torch.empty(s, hq, dtype=torch.float32)
    kernels.load("kivi").kivi_paged_decode(
        s, hq, hkv, d, keys.bits, values.group_size, q.data_ptr(), scale, pool["k.codes"].data_ptr(),
        *_param(pool["k.scale"]), *_param(pool["k.zero"]), pool["v.codes"].data_ptr(),
        *_param(pool["v.scale"]), *_param(pool["v.zero"]), num_blocks, key_groups, group_tokens,
        code_bytes, tables.data_ptr(), tables.shape[1], tokens.data_ptr(), out.data_ptr(), lse.data_ptr())
    return out, lse


def _param(t: torch.Tensor) -> tuple[int, int, int | None]:
    """A pool's scale or zero-point tensor as the kernel reads it: pointer, dtype kind, FP8 table."""
    return t.data_ptr(), kernels.KINDS[t.dtype], native.lut_pointer(t.dtype)
