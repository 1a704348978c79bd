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
same whole packed blocks (a shared prompt), those are decoded (``decode_blocks``: once per step, or
once while the compiled step's plan stands) and read once for every query row of the batch
(``shared_attention``; Hydragen, Juravsky et al. 2024), as plain pages read theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory import kernels
from kvfactory.attention import merge_parts
from kvfactory.codecs import Encoded, native
from kvfactory.codecs.kivi import KiviKeyCodec, KiviValueCodec
from kvfactory.quantization.store import QuantizedStore, append_runs, error_sums
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
    due = [i for i, store in enumerate(stores) if store.samples_next_flush]
    errors = {}
    if due:  # the sampled flushes' errors, decoded together
        rows = torch.tensor(due)
        picked = [Encoded({name: t[rows] for name, t in enc.tensors.items()}, tokens) for enc in (ek, ev)]
        errors = dict(zip(due, error_sums(keys[rows], values[rows], *picked, codecs), strict=True))
    for i, store in enumerate(stores):
        store.took_front(tokens, errors.get(i))


def flush_full_windows(stores: list[QuantizedStore], tokens: int | list[int]) -> None:
    """The windows of ``stores`` (one-row stores of one layer) that ``tokens`` more (each store's, where a
    list) would push past their residual encode their oldest groups first, in one batch per flush size
    (``flush_windows``), where ``batch_flush`` takes them (else the store's ``append`` encodes as it
    writes)."""
    counts = [tokens] * len(stores) if isinstance(tokens, int) else tokens
    pending: dict[int, list[QuantizedStore]] = {}
    for store, count in zip(stores, counts, strict=True):
        flush = store.batch_flush(count)
        if flush:
            pending.setdefault(flush, []).append(store)
    for flush, flushed in pending.items():
        flush_windows(flushed, flush)


@dataclass
class PackedPlan:
    """What a decode step's sequences read of one layer's quantized pages: their block tables, packed
    tokens and the leading blocks all of them read whole (``shared_prefix``). A layer's packed tables
    change only when a window flushes a group into them, so most steps reuse the last step's plan
    (``packed_plan``)."""

    held: list[tuple[torch.Tensor, int] | None]  # each sequence's block ids (never changed in place), tokens
    first: int  # the first sequence holding packed tokens
    tables: torch.Tensor
    tokens: torch.Tensor
    shared: int


def packed_plan(stores: list[QuantizedStore], last: PackedPlan | None = None) -> PackedPlan | None:
    """The ``PackedPlan`` of ``stores`` (one layer's, ``in_place``): ``last`` where every store still
    holds the same blocks and tokens, else a new one; None where none holds a packed token. A block
    table's ids are replaced, never written in place, when its blocks change, so the same ids object
    means the same blocks."""
    held = [(runs.table.ids, runs.tokens) if store.quantized_tokens and (runs := store.runs).table.ids
            is not None else None for store in stores]
    if all(h is None for h in held):
        return None
    if last is not None and len(last.held) == len(held) and all(
            a is b is None or (a is not None and b is not None and a[0] is b[0] and a[1] == b[1])
            for a, b in zip(held, last.held, strict=True)):
        return last
    empty = torch.zeros(0, dtype=torch.long)
    tables = block_tables([empty if h is None else h[0][0] for h in held])
    tokens = torch.tensor([0 if h is None else h[1] for h in held])
    first = next(i for i, h in enumerate(held) if h is not None)
    shared = shared_prefix(tables, torch.zeros_like(tokens), tokens, stores[first].runs.block_tokens)
    return PackedPlan(held, first, tables, tokens, shared)


def quantized_decode(query: torch.Tensor, stores: list[QuantizedStore], scale: float,
                     windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
                     plan: PackedPlan | None = None) -> torch.Tensor:
    """Each sequence's query ``[S, Hq, D]`` over store ``stores[s]`` (each ``in_place``, of one layer
    and pool, its new token written): ``[S, Hq, D]`` in ``query``'s dtype. ``windows``: the windows'
    block tables, starts, lengths and shared blocks as ``paged_decode`` takes them (a prompt's window
    pages that the sequences adopted together), where the caller planned them (the layers of a group
    share them), else read from each store. ``plan``: the stores' ``packed_plan``, where the caller
    keeps it between steps, else made here."""
    packed = plan or packed_plan(stores)
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
    if packed is None:
        return out
    return merge_parts((out, lse), *_packed_decode(query, stores, packed, scale))[0].to(query.dtype)


def _packed_decode(query: torch.Tensor, stores: list[QuantizedStore], plan: PackedPlan, scale: float
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``packed_parts`` of ``stores`` (as ``quantized_decode`` takes them) read by ``plan``, a shared
    prompt's blocks decoded into the store's reused workspace."""
    store = stores[plan.first]
    pool, bits, group = store.runs.table.blocks.tensors, store.key_codec.bits, store.value_codec.group_size
    shared = plan.shared if shared_fits(query) else 0
    head = None
    if shared:
        hkv, _, key_groups, group_tokens, _ = pool["k.codes"].shape
        shape = (2, hkv, shared * key_groups * group_tokens, query.shape[2])
        head = decode_blocks(pool, bits, group, plan.tables[0, :shared],
                             store.workspace.buffer("shared_packed", shape, query))
    return packed_parts(query, pool, bits, group, plan.tables, plan.tokens, shared, scale, head)


def decode_blocks(pool: dict[str, torch.Tensor], bits: int, group: int, ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole packed blocks ``ids`` of one layer's pool of KIVI pages (see ``native.pool_pointers``;
    ``bits`` per code, values grouped by ``group`` channels) decoded once (``kivi_paged_dequantize``) into
    float32 ``[2, Hkv, tokens, D]``, keys then values: ``out`` where given (a reused buffer of that
    shape), else a new tensor. What ``packed_parts`` reads a shared prompt's blocks from, a few hundred
    KiB per KV head for a 1,024-token prompt."""
    hkv, _, key_groups, group_tokens, code_bytes = pool["k.codes"].shape
    head_dim = code_bytes * 8 // bits
    if out is None:
        out = torch.empty(2, hkv, ids.numel() * key_groups * group_tokens, head_dim)
    native.paged_dequantize(pool, ids, bits, group, out[0], out[1])
    return out


def packed_parts(query: torch.Tensor, pool: dict[str, torch.Tensor], bits: int, group: int,
                 tables: torch.Tensor, tokens: torch.Tensor, shared: int, scale: float,
                 head: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's query ``[S, Hq, D]`` over its ``tokens [S]`` packed tokens in blocks ``tables``
    of one layer's pool of KIVI pages (see ``native.pool_pointers``; ``bits`` per code, values grouped
    by ``group`` channels), as outputs ``[S, Hq, D]`` with their log-sum-exps ``[S, Hq]`` (float32;
    ``-inf`` where a sequence has no packed tokens there) for ``merge_parts``. The ``shared`` leading
    blocks, which every sequence reads whole (a shared prompt's), are read once for all query rows
    (``shared_attention``) from ``head``, those blocks decoded (``decode_blocks``; a caller checks
    ``shared_fits`` first); each sequence's other blocks in place."""
    if not shared:
        return [_paged_packed(query, pool, bits, group, tables, tokens, scale)]
    rest = tokens - shared * pool["k.codes"].shape[2] * pool["k.codes"].shape[3]
    own = _paged_packed(query, pool, bits, group, tables[:, shared:], rest, scale)
    return [_shared_read(query, head, scale), own]


def packed_prefill_parts(query: torch.Tensor, pool: dict[str, torch.Tensor], bits: int, group: int,
                         bounds: torch.Tensor, tables: torch.Tensor, tokens: torch.Tensor, shared: int,
                         scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill chunks and decode tokens (chunks of one) of several sequences packed as ``query [T, Hq,
    D]`` (float32; chunk ``j`` its rows ``[bounds[j], bounds[j + 1])``), each over its sequence's
    ``tokens[j]`` packed tokens in blocks ``tables[j]``, all of them before the chunk (no mask), as
    ``packed_parts`` returns them. The ``shared`` leading blocks are decoded once and read once for
    every row; a chunk's other blocks are decoded once for its rows and read by the chunk kernel
    (``kvfactory/kernels/chunk.c``), a decode token's read in place (``kivi_paged_decode``). A caller
    checks ``shared_fits`` first."""
    t, hq, d = query.shape
    hkv, _, key_groups, group_tokens, _ = pool["k.codes"].shape
    block_tokens = key_groups * group_tokens
    query = query.contiguous()
    parts = []
    if shared:
        parts.append(_shared_read(query, decode_blocks(pool, bits, group, tables[0, :shared]), scale))
        tables, tokens = tables[:, shared:], tokens - shared * block_tokens
    out, lse = torch.zeros(t, hq, d), torch.full((t, hq), float("-inf"))
    ends, counts = bounds.tolist(), tokens.tolist()  # tables and tokens may have padding rows after the last
    single = [j for j in range(len(ends) - 1) if ends[j + 1] - ends[j] == 1 and counts[j] > 0]
    if single:
        at, rows = torch.tensor([ends[j] for j in single]), torch.tensor(single)
        out[at], lse[at] = _paged_packed(query[at], pool, bits, group, tables[rows], tokens[rows], scale)
    lib = kernels.load("chunk")
    for j in range(len(ends) - 1):
        rows, n = ends[j + 1] - ends[j], counts[j]
        if rows == 1 or n == 0:
            continue
        keys, values = torch.empty(hkv, n, d), torch.empty(hkv, n, d)
        native.paged_dequantize(pool, tables[j, :-(-n // block_tokens)], bits, group, keys, values)
        if not lib.chunk_attention(hq, hkv, rows, n, d, query[ends[j]].data_ptr(), d, hq * d, keys.data_ptr(),
                                   n * d, d, values.data_ptr(), n * d, d, None, n, 0, scale,
                                   out[ends[j]].data_ptr(), lse[ends[j]].data_ptr()):
            raise RuntimeError(f"the chunk kernel could not attend {rows} queries over {n} packed tokens")
    return [*parts, (out, lse)]


def own_flush_chunk(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    total: int, pool: dict[str, torch.Tensor], bits: int, group: int, flush: int, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk ``query [C, Hq, D]`` (float32) whose write encodes some of its own tokens
    (``QuantizedStore.own_flush``), attending causally over its window as ``append`` leaves it: the
    ``total`` tokens held from the start of blocks ``table`` of the window's float32 pools (the chunk's
    own last), their first ``flush`` encoded and decoded as the flush after the step encodes them by
    the KIVI codecs that fill ``pool`` (``bits`` per code, values grouped by ``group`` channels). Output
    ``[C, Hq, D]`` and log-sum-exp ``[C, Hq]``, to merge with the packed tokens' part."""
    c, hq, d = query.shape
    hkv, _, page, _ = k_pool.shape
    window = [x[:, table[:-(-total // page)]].flatten(1, 2)[:, :total] for x in (k_pool, v_pool)]
    encoded = _round_trip(window[0][:, :flush], window[1][:, :flush], pool, bits, group)
    keys, values = (torch.cat([x, held[:, flush:]], 1) for x, held in zip(encoded, window, strict=True))
    query, out, lse = query.contiguous(), torch.empty(c, hq, d), torch.empty(c, hq)
    lib = kernels.load("chunk")
    if not lib.chunk_attention(hq, hkv, c, total, d, query.data_ptr(), d, hq * d, keys.data_ptr(), total * d,
                               d, values.data_ptr(), total * d, d, None, total, 1, scale, out.data_ptr(),
                               lse.data_ptr()):
        raise RuntimeError(f"the chunk kernel could not attend {c} queries over {total} tokens")
    return out, lse


def _round_trip(keys: torch.Tensor, values: torch.Tensor, pool: dict[str, torch.Tensor], bits: int,
                group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` / ``values [Hkv, n, D]`` (whole key groups) encoded by the KIVI codecs that fill ``pool``
    (its key groups' tokens, its scales' and zero points' dtypes) and decoded."""
    key_codec = KiviKeyCodec(bits=bits, group_size=pool["k.codes"].shape[3],
                             scale_dtype=pool["k.scale"].dtype, zero_dtype=pool["k.zero"].dtype)
    value_codec = KiviValueCodec(bits=bits, group_size=group, scale_dtype=pool["v.scale"].dtype,
                                 zero_dtype=pool["v.zero"].dtype, head_dim=values.shape[-1])
    with torch.no_grad():
        return (key_codec.decode(key_codec.encode(keys[None]))[0],
                value_codec.decode(value_codec.encode(values[None]))[0])


def _paged_packed(query: torch.Tensor, pool: dict[str, torch.Tensor], bits: int, group: int,
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
        s, hq, hkv, d, bits, group, q.data_ptr(), scale, *native.pool_pointers(pool), num_blocks, key_groups,
        group_tokens, code_bytes, tables.data_ptr(), tables.shape[1], tokens.data_ptr(), out.data_ptr(),
        lse.data_ptr())
    return out, lse


def _shared_read(query: torch.Tensor, head: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row over the decoded blocks ``head`` (``decode_blocks``) at once."""
    first = torch.zeros(1, dtype=torch.long)
    read = shared_attention(query, head[0, :, None], head[1, :, None], first, scale)
    if read is None:
        raise RuntimeError("the chunk kernel does not take the query of shared blocks (check shared_fits)")
    return read
