"""Decode attention over a ragged batch, read from a paged pool's blocks in place.

A serving engine batches the decode steps of many sequences (one query token each) into one forward;
per layer, each sequence attends over its own blocks of the layer's ``BlockPool``. Copying every
sequence into one padded tensor first reads and writes the batch's whole K/V once more; vLLM's
PagedAttention (Kwon et al. 2023) reads the blocks through each sequence's block table instead.
``paged_decode`` does that on the CPU in C (``kvfactory/kernels/ragged.c``: an online softmax over
the blocks, the query heads of a KV head together). Elsewhere (other devices, FP8 or non-contiguous
pools, no C compiler, or ``kernel=False``) it gathers the blocks into a padded tensor, masks the
tokens outside each sequence and runs one batched softmax attention in torch.

Where every sequence of the batch starts with the same blocks (a shared system prompt), those are
read once for all of them (Hydragen, Juravsky et al. 2024): the query rows of every sequence go
through one matrix-product kernel over the shared blocks (``kvfactory/kernels/chunk.c``), each
sequence's own blocks through the per-sequence kernel, and the two parts are merged by their
log-sum-exps. ``shared_prefix`` finds those blocks.
"""

from __future__ import annotations

import torch

from kvfactory import kernels
from kvfactory.attention import merge_parts
from kvfactory.errors import ShapeError

MAX_DIM = 512  # channels per head ragged.c takes, as there
MIN_SHARED_TOKENS = 128  # a shorter common prefix, or one of fewer sequences, is read per sequence
MIN_SHARED_SEQUENCES = 4
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # pool dtypes ragged.c reads


def paged_decode(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 starts: torch.Tensor, lengths: torch.Tensor, scale: float, *,
                 kernel: bool = True, check: bool = True, return_lse: bool = False, shared: int = 0
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's query over its own tokens of a layer's pool: ``[S, Hq, D]`` in ``query``'s dtype
    (with ``return_lse``, also each row's log-sum-exp of its scores, ``[S, Hq]`` float32, ``-inf`` at
    length 0: what merging with attention over other tokens needs).

    ``query [S, Hq, D]``: one decode token per sequence, any float dtype. ``k_pool`` / ``v_pool``
    ``[Hkv, num_blocks, page_size, D]`` (a ``BlockPool``'s ``k`` and ``v``). Sequence ``s`` holds
    tokens ``[starts[s], starts[s] + lengths[s])`` counted from the start of its first block
    (``0 <= starts[s] < page_size``), in blocks ``tables[s, :ceil((starts[s] + lengths[s]) / page_size)]``
    (``tables [S, max_blocks]`` int64; the entries past them, and a length-0 row's, are not read).
    Query head ``h`` attends over KV head ``h // (Hq // Hkv)``, scores ``scale * q . k``; a sequence of
    length 0 gets zeros. CPU tensors with contiguous float32 / float16 / bfloat16 pools and ``D <= 512``
    go to the C kernel (built on first use); the rest, and every call with ``kernel=False``, to the
    torch path. Raises ``ShapeError`` when the shapes do not fit, or a table is too short or names a
    block outside the pool; ``check=False`` skips that validation, for a caller that built the tables
    from the stores themselves (the engine's decode step). ``shared``: the leading blocks that every
    sequence reads whole (``shared_prefix``), read once for all where the kernels take them.
    """
    if check:
        _check(query, k_pool, v_pool, tables, starts, lengths)
    if shared and kernel:
        split = _shared_decode(query, k_pool, v_pool, tables, starts, lengths, scale, shared)
        if split is not None:
            return split if return_lse else split[0]
    starts, lengths = starts.to(tables.device, torch.int64), lengths.to(tables.device, torch.int64)
    tables = tables.long()
    if kernel and _kernel_fits(query, k_pool, v_pool) and (lib := kernels.load("ragged")) is not None:
        s, hq, d = query.shape
        q = query.float().contiguous()
        tables, starts, lengths = (t.cpu().contiguous() for t in (tables, starts, lengths))
        out = torch.empty(s, hq, d, dtype=torch.float32)
        lse = torch.empty(s, hq, dtype=torch.float32) if return_lse else None
        lib.paged_decode(s, hq, k_pool.shape[0], d, q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                         kernels.KINDS[k_pool.dtype], k_pool.shape[1], k_pool.shape[2], tables.data_ptr(),
                         tables.shape[1], starts.data_ptr(), lengths.data_ptr(), scale, out.data_ptr(),
                         None if lse is None else lse.data_ptr())
        return (out.to(query.dtype), lse) if return_lse else out.to(query.dtype)
    out, lse = _gathered(query, k_pool, v_pool, tables, starts, lengths, scale)
    return (out, lse) if return_lse else out


def shared_prefix(tables: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, page_size: int) -> int:
    """How many leading blocks every sequence of ``paged_decode``'s batch reads whole: the same ids in
    each row, each row's tokens starting at the first one and filling them. 0 for fewer than
    ``MIN_SHARED_SEQUENCES`` sequences or ``MIN_SHARED_TOKENS`` shared tokens, which cost no more
    read per sequence."""
    if tables.shape[0] < MIN_SHARED_SEQUENCES or bool(starts.any()):
        return 0
    full = int(lengths.min()) // page_size
    if full * page_size < MIN_SHARED_TOKENS:
        return 0
    same = (tables[:, :full] == tables[:1, :full]).all(0)
    blocks = int(same.cumprod(0).sum())
    return blocks if blocks * page_size >= MIN_SHARED_TOKENS else 0


def _shared_decode(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                   starts: torch.Tensor, lengths: torch.Tensor, scale: float, shared: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``paged_decode`` of a batch whose sequences all read ``tables[:, :shared]`` whole: every query
    row over those blocks at once (``shared_attention``), each sequence over the rest, merged by the
    parts' log-sum-exps; None where the chunk kernel does not take the pool."""
    head = shared_attention(query, k_pool, v_pool, tables[0, :shared], scale)
    if head is None:
        return None
    page = k_pool.shape[2]
    tail = paged_decode(query, k_pool, v_pool, tables[:, shared:], starts, lengths - shared * page, scale,
                        check=False, return_lse=True)
    return merge_parts(head, tail)


def shared_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, ids: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every query row ``[S, Hq, D]`` over the whole blocks ``ids`` of a pool ``[Hkv, num_blocks,
    page_size, D]`` (the blocks a batch's sequences all read), in one call of the chunk kernel, so each
    block is read once for all rows: output ``[S, Hq, D]`` and log-sum-exp ``[S, Hq]``, float32; None
    where the kernel does not take them (not float32 on the CPU, a head size not a multiple of 64, no
    AVX-512 build)."""
    (s, hq, d), (hkv, _, page, _) = query.shape, k_pool.shape
    if k_pool.dtype != torch.float32 or not shared_fits(query) or not _kernel_fits(query, k_pool, v_pool):
        return None
    lib = kernels.load("chunk")
    q = query.contiguous()
    ids = ids.to("cpu", torch.int64).contiguous()
    out, lse = torch.empty(s, hq, d), torch.empty(s, hq)
    if not lib.chunk_attention(hq, hkv, s, ids.numel() * page, d, q.data_ptr(), d, hq * d,
                               k_pool.data_ptr(), k_pool.stride(0), d, v_pool.data_ptr(), v_pool.stride(0), d,
                               ids.data_ptr(), page, 0, scale, out.data_ptr(), lse.data_ptr()):
        return None
    return out, lse


def paged_prefill(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, bounds: torch.Tensor,
                  tables: torch.Tensor, totals: torch.Tensor, scale: float, return_lse: bool = False,
                  skip: frozenset[int] = frozenset()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Prefill chunks and decode tokens of several sequences, packed, each attending causally over its
    blocks in place: chunk ``j < len(bounds) - 1`` is positions ``[bounds[j], bounds[j + 1])`` of
    ``query [Hq, T, D]`` (float32, any strides but the channels'), the last ``bounds[j + 1] - bounds[j]``
    of the ``totals[j]`` tokens its sequence holds from the start of blocks ``tables[j]`` of a float32
    pool ``[Hkv, num_blocks, page_size, D]`` (its own K/V written there first). Returns ``[T, Hq, D]``.
    Chunks of one token (decode tokens of a mixed step) go to ``paged_decode`` together, the others to
    the chunk kernel (``kvfactory/kernels/chunk.c``) one call each; a caller checks ``shared_fits``
    first. ``return_lse``: also each row's log-sum-exp ``[T, Hq]`` (for ``merge_parts``). ``skip``: chunks
    of more than one token left to another read (their rows zero, log-sum-exps ``-inf``). ``RuntimeError``
    where the chunk kernel cannot run (no memory for its tiles)."""
    hq, t, d = query.shape
    hkv, page = k_pool.shape[0], k_pool.shape[2]
    lib = kernels.load("chunk")
    tables = tables.to("cpu", torch.int64).contiguous()
    out = torch.empty(t, hq, d)
    lse = torch.empty(t, hq) if return_lse else None
    ends, totals = bounds.tolist(), totals.tolist()
    single = [j for j in range(len(ends) - 1) if ends[j + 1] - ends[j] == 1]
    if single:
        at, rows = torch.tensor([ends[j] for j in single]), torch.tensor(single)
        lengths = torch.tensor([totals[j] for j in single])
        read = paged_decode(query[:, at].transpose(0, 1), k_pool, v_pool, tables[rows],
                            torch.zeros_like(lengths), lengths, scale, check=False, return_lse=return_lse)
        if return_lse:
            out[at], lse[at] = read
        else:
            out[at] = read
    for j in skip:
        out[ends[j]:ends[j + 1]] = 0
        if lse is not None:
            lse[ends[j]:ends[j + 1]] = float("-inf")
    for j in range(len(ends) - 1):
        q, total = query[:, ends[j]:ends[j + 1]], totals[j]
        if q.shape[1] > 1 and j not in skip and not lib.chunk_attention(
                hq, hkv, q.shape[1], total, d, q.data_ptr(), q.stride(0), q.stride(1), k_pool.data_ptr(),
                k_pool.stride(0), d, v_pool.data_ptr(), v_pool.stride(0), d, tables[j].data_ptr(), page, 1,
                scale, out[ends[j]].data_ptr(), None if lse is None else lse[ends[j]].data_ptr()):
            raise RuntimeError(f"the chunk kernel could not attend {q.shape[1]} queries over {total} tokens")
    return out if lse is None else (out, lse)


def shared_fits(query: torch.Tensor) -> bool:
    """Whether ``shared_attention`` can take float32 pools for ``query``: a float32 CPU query whose
    head size is a multiple of 64 and a chunk kernel built with its AVX-512 body. Asked before
    preparing pools for it (decoding packed pages, say), which would be wasted where it says no."""
    d = query.shape[-1]
    return (query.device.type == "cpu" and query.dtype == torch.float32 and d % 64 == 0 and d <= MAX_DIM
            and (lib := kernels.load("chunk")) is not None and bool(lib.chunk_has_body()))


def block_tables(rows: list[torch.Tensor]) -> torch.Tensor:
    """Each sequence's block ids (``[blocks]`` int64 each) as the ``tables [S, longest]`` the kernels
    take; the entries past a row's own blocks are never read."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _kernel_fits(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    return (query.device.type == k_pool.device.type == "cpu" and k_pool.dtype in KERNEL_DTYPES
            and k_pool.is_contiguous() and v_pool.is_contiguous() and query.shape[2] <= MAX_DIM)


def _check(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
           starts: torch.Tensor, lengths: torch.Tensor) -> None:
    if query.dim() != 3 or k_pool.dim() != 4 or v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ShapeError(f"paged decode takes query [S, Hq, D] and pools [Hkv, num_blocks, page_size, D] "
                         f"of one dtype; got query {tuple(query.shape)}, k_pool {tuple(k_pool.shape)} "
                         f"({k_pool.dtype}), v_pool {tuple(v_pool.shape)} ({v_pool.dtype})")
    (s, hq, d), (hkv, num_blocks, page, pool_d) = query.shape, k_pool.shape
    if d != pool_d:
        raise ShapeError(f"paged decode: query head_dim {d} differs from the pool's {pool_d}")
    if hkv == 0 or hq % hkv:
        raise ShapeError(f"paged decode: {hq} query heads are not a multiple of the pool's {hkv} KV heads")
    if tables.dim() != 2 or tables.shape[0] != s or starts.shape != (s,) or lengths.shape != (s,):
        raise ShapeError(f"paged decode of {s} sequences takes tables [{s}, max_blocks], starts [{s}] and "
                         f"lengths [{s}]; got {tuple(tables.shape)}, {tuple(starts.shape)}, "
                         f"{tuple(lengths.shape)}")
    starts, lengths = starts.to(tables.device), lengths.to(tables.device)
    wrong = (starts < 0) | (starts >= page) | (lengths < 0)
    if wrong.any():
        row = int(wrong.nonzero()[0, 0])
        raise ShapeError(f"paged decode: sequence {row} starts at {int(starts[row])} with length "
                         f"{int(lengths[row])}; a start lies in [0, {page}) and a length is >= 0")
    needed = torch.where(lengths > 0, (starts + lengths + page - 1) // page, 0)
    short = needed > tables.shape[1]
    if short.any():
        row = int(short.nonzero()[0, 0])
        raise ShapeError(f"paged decode: sequence {row} (start {int(starts[row])}, length "
                         f"{int(lengths[row])}) needs {int(needed[row])} blocks of {page} tokens; its table "
                         f"holds {tables.shape[1]}")
    used = torch.arange(tables.shape[1], device=tables.device) < needed[:, None]
    outside = used & ((tables < 0) | (tables >= num_blocks))
    if outside.any():
        row, col = (int(i) for i in outside.nonzero()[0])
        raise ShapeError(f"paged decode: sequence {row}'s block {col} is block id {int(tables[row, col])}, "
                         f"outside the pool's {num_blocks} blocks")


def _gathered(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
              starts: torch.Tensor, lengths: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path (output and log-sum-exp): every sequence's blocks gathered into one padded
    ``[Hkv, S, tokens, D]`` (the KV head first, so the grouped products need no further copy), the
    positions outside each sequence masked, one softmax attention for the whole batch in float32 (or
    the query's wider dtype)."""
    (s, hq, d), (hkv, num_blocks, page, _) = query.shape, k_pool.shape
    device, dtype = k_pool.device, torch.promote_types(query.dtype, torch.float32)
    starts, lengths = starts.to(device), lengths.to(device)
    blocks = int(torch.where(lengths > 0, (starts + lengths + page - 1) // page, 0).max()) if s else 0
    if blocks == 0:
        return query.new_zeros(s, hq, d), torch.full((s, hq), float("-inf"), device=device)
    # a row's entries past its own blocks may hold anything: read a valid block there, masked below
    ids = tables[:, :blocks].to(device).clamp(0, num_blocks - 1).flatten()
    k, v = (pool.index_select(1, ids).view(hkv, s, blocks * page, d).to(dtype) for pool in (k_pool, v_pool))
    q = query.to(device, dtype).view(s, hkv, hq // hkv, d).transpose(0, 1)  # [Hkv, S, group, D]
    positions = torch.arange(blocks * page, device=device)
    outside = (positions < starts[:, None]) | (positions >= (starts + lengths)[:, None])  # [S, tokens]
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill_(outside[None, :, None], float("-inf"))
    out = (scores.softmax(-1) @ v).masked_fill_((lengths == 0)[None, :, None, None], 0.0)  # 0/0 rows: zeros
    lse = scores.logsumexp(-1).transpose(0, 1).reshape(s, hq).float()
    return out.transpose(0, 1).reshape(s, hq, d).to(query.dtype), lse
