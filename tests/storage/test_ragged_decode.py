"""``paged_decode`` (``kvfactory.storage.ragged``) equals SDPA over each sequence's gathered tokens, in
both its paths: the C kernel (``ragged.c``, in each of its instruction-set bodies; its torch path is
patched to fail, so the kernel really answers) and the torch path (``kernel=False``). Layouts mix
lengths (1 token, exactly a page, many pages and tiles, 0), shuffled block ids, starts past a dropped
front, GQA and plain multi-head attention, fp32/fp16/bf16 pools; each row's log-sum-exp on request;
wrong shapes and tables raise ``ShapeError`` with their numbers."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfactory import kernels
from kvfactory.errors import ShapeError
from kvfactory.storage import ragged
from kvfactory.storage.ragged import paged_decode

# the kernel as built for this CPU, and on x86 also its AVX2 and portable bodies (built without AVX-512,
# and without AVX2 and FMA too)
BODIES = {"c": (), "c-avx2": ("-mno-avx512f",), "c-portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}
NO_COMPILER = pytest.mark.skipif(kernels.load("ragged") is None, reason="no C compiler")
NOT_X86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
PATHS = [pytest.param("c", marks=NO_COMPILER), pytest.param("c-avx2", marks=[NO_COMPILER, NOT_X86]),
         pytest.param("c-portable", marks=[NO_COMPILER, NOT_X86]), "torch"]
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(params=PATHS)
def decode(request, monkeypatch):
    """``paged_decode`` through one path."""
    if request.param == "torch":
        return lambda *args, **kwargs: paged_decode(*args, kernel=False, **kwargs)

    def no_torch_path(*args):
        raise AssertionError("the C kernel should have answered")

    monkeypatch.setattr(ragged, "_gathered", no_torch_path)
    bodies = {name: kernels.load(name, BODIES[request.param]) for name in ("ragged", "chunk")}
    assert all(bodies.values())  # each builds for each instruction set
    monkeypatch.setattr(kernels, "load", bodies.get)  # without AVX-512, chunk.c declines: read per sequence
    return paged_decode


def layout(starts: list[int], lengths: list[int], page: int, spare: int = 3, seed: int = 0):
    """Block tables for sequences of these starts and lengths, their ids shuffled through a pool with
    ``spare`` blocks no one holds; a row's unused entries are -1 (never read). Returns
    ``(tables, starts, lengths, num_blocks)``."""
    counts = [-(-(s + n) // page) if n else 0 for s, n in zip(starts, lengths, strict=True)]
    num_blocks = sum(counts) + spare
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.full((len(counts), max(counts, default=0) + 1), -1, dtype=torch.long)
    for row, count in enumerate(counts):
        tables[row, :count] = torch.tensor(ids[:count], dtype=torch.long)
        del ids[:count]
    return tables, torch.tensor(starts), torch.tensor(lengths), num_blocks


def pools(kv_heads: int, num_blocks: int, page: int, dim: int, dtype: torch.dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(kv_heads, num_blocks, page, dim, generator=gen).to(dtype) for _ in range(2))


def reference(query, k_pool, v_pool, tables, starts, lengths, scale) -> torch.Tensor:
    """Each sequence's tokens gathered from its blocks, then SDPA in float64, in ``query``'s dtype."""
    kv_heads, _, page, dim = k_pool.shape
    rows = []
    for s, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        if length == 0:
            rows.append(torch.zeros(query.shape[1:], dtype=torch.float64))
            continue
        ids = tables[s, :-(-(start + length) // page)]
        k, v = (pool[:, ids].reshape(1, kv_heads, -1, dim)[:, :, start:start + length].double()
                for pool in (k_pool, v_pool))
        q = query[s].double()[None, :, None]
        rows.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(rows).to(query.dtype)


def check(decode, query, k_pool, v_pool, tables, starts, lengths, scale, atol: float) -> None:
    got = decode(query, k_pool, v_pool, tables, starts, lengths, scale)
    assert got.shape == query.shape and got.dtype == query.dtype
    expected = reference(query, k_pool, v_pool, tables, starts, lengths, scale)
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)


# 1 token, exactly a page, a page from a start, many pages, a dropped front, nothing, a page's end,
# several of the kernel's 1,024-token softmax tiles, their ends inside blocks
STARTS = [0, 0, 5, 0, 3, 7, 15, 9]
LENGTHS = [1, 16, 11, 200, 130, 0, 1, 2300]


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(("query_heads", "kv_heads", "dim"),
                         [(9, 3, 64), (4, 4, 64), (6, 2, 128), (2, 2, 32), (3, 1, 24), (34, 2, 16)])
def test_matches_sdpa_per_sequence(decode, dtype, query_heads, kv_heads, dim) -> None:
    """SmolLM2's GQA shape and plain multi-head attention; head sizes the kernel unrolls (64, 128),
    others a multiple of 16 and not (24); groups larger than the kernel takes at once (17 heads)."""
    tables, starts, lengths, num_blocks = layout(STARTS, LENGTHS, page=16)
    k_pool, v_pool = pools(kv_heads, num_blocks, 16, dim, dtype)
    query = torch.randn(len(STARTS), query_heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    check(decode, query, k_pool, v_pool, tables, starts, lengths, dim ** -0.5, TOLERANCES[dtype])


def test_float32_query_over_half_pools_and_large_scores(decode) -> None:
    """A float32 query over a bfloat16 pool answers in float32; scores in the hundreds, whose
    exponentials overflow float32, stay finite and close (the online softmax subtracts the running
    maximum; float32 scores of that size carry errors of ~1e-5 into the weights)."""
    tables, starts, lengths, num_blocks = layout(STARTS, LENGTHS, page=16)
    k_pool, v_pool = pools(3, num_blocks, 16, 64, torch.bfloat16)
    query = 20 * torch.randn(len(STARTS), 9, 64, generator=torch.Generator().manual_seed(2))
    check(decode, query, k_pool, v_pool, tables, starts, lengths, 1.0, 1e-4)


def test_log_sum_exp_of_each_row(decode) -> None:
    """``return_lse``: each row's log-sum-exp of its scaled scores (what merging two parts of one
    row's attention takes), ``-inf`` for an empty sequence."""
    tables, starts, lengths, num_blocks = layout(STARTS, LENGTHS, page=16)
    k_pool, _ = pools(3, num_blocks, 16, 64, torch.float32)
    query = torch.randn(len(STARTS), 9, 64, generator=torch.Generator().manual_seed(3))
    _, lse = decode(query, k_pool, k_pool, tables, starts, lengths, 0.125, return_lse=True)
    for s, (start, length) in enumerate(zip(STARTS, LENGTHS, strict=True)):
        ids = tables[s, :-(-(start + length) // 16)] if length else tables[s, :0]
        k = k_pool[:, ids].reshape(3, -1, 64)[:, start:start + length].double()
        scores = query[s].double().view(3, 3, 64) @ k.transpose(-1, -2) * 0.125
        torch.testing.assert_close(lse[s], scores.logsumexp(-1).flatten().float(), atol=1e-5, rtol=1e-5)


def test_length_zero_gives_zeros(decode) -> None:
    tables, starts, lengths, num_blocks = layout([0, 4], [0, 0], page=8)
    k_pool, v_pool = pools(2, num_blocks, 8, 16, torch.float32)
    query = torch.randn(2, 4, 16)
    assert torch.equal(decode(query, k_pool, v_pool, tables, starts, lengths, 0.25), torch.zeros(2, 4, 16))
    empty = torch.empty(0, 4, 16)
    got = decode(empty, k_pool, v_pool, tables[:0], starts[:0], lengths[:0], 0.25)
    assert got.shape == (0, 4, 16)


def test_non_contiguous_pools_take_the_torch_path() -> None:
    tables, starts, lengths, num_blocks = layout(STARTS, LENGTHS, page=16)
    k_pool, v_pool = (p.transpose(0, 1).contiguous().transpose(0, 1)
                      for p in pools(3, num_blocks, 16, 64, torch.float32))
    assert not k_pool.is_contiguous()
    query = torch.randn(len(STARTS), 9, 64)
    check(paged_decode, query, k_pool, v_pool, tables, starts, lengths, 0.125, 1e-5)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       dim=st.sampled_from([8, 16, 20, 32]), page=st.sampled_from([1, 3, 4, 16]), sequences=st.integers(1, 4))
def test_any_small_layout_matches_sdpa(data, kv_heads, group, dim, page, sequences) -> None:
    starts = data.draw(st.lists(st.integers(0, page - 1), min_size=sequences, max_size=sequences))
    lengths = data.draw(st.lists(st.integers(0, 40), min_size=sequences, max_size=sequences))
    seed = data.draw(st.integers(0, 2**16))
    tables, starts, lengths, num_blocks = layout(starts, lengths, page, seed=seed)
    k_pool, v_pool = pools(kv_heads, num_blocks, page, dim, torch.float32, seed=seed)
    query = torch.randn(sequences, kv_heads * group, dim, generator=torch.Generator().manual_seed(seed))
    for kernel in (True, False):
        got = paged_decode(query, k_pool, v_pool, tables, starts, lengths, dim ** -0.5, kernel=kernel)
        expected = reference(query, k_pool, v_pool, tables, starts, lengths, dim ** -0.5)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _valid():
    tables, starts, lengths, num_blocks = layout([0, 3], [20, 5], page=8)
    k_pool, v_pool = pools(2, num_blocks, 8, 16, torch.float32)
    return torch.randn(2, 4, 16), k_pool, v_pool, tables, starts, lengths


@pytest.mark.parametrize(("change", "message"), [
    ("dim", "query head_dim 12 differs from the pool's 16"),
    ("heads", "5 query heads are not a multiple of the pool's 2 KV heads"),
    ("short_table", r"sequence 0 \(start 0, length 20\) needs 3 blocks of 8 tokens; its table holds 2"),
    ("block_id", r"sequence 1's block 0 is block id 99, outside the pool's \d+ blocks"),
    ("negative_id", r"sequence 0's block 2 is block id -1, outside"),
    ("start", r"sequence 1 starts at 8 with length 5; a start lies in \[0, 8\)"),
    ("rows", r"paged decode of 2 sequences takes tables \[2, max_blocks\]"),
    ("pools", r"v_pool \(2, \d+, 8, 8\)"),
])
def test_shapes_that_do_not_fit_raise(change, message) -> None:
    query, k_pool, v_pool, tables, starts, lengths = _valid()
    if change == "dim":
        query = query[..., :12]
    elif change == "heads":
        query = query[:, :1].expand(2, 5, 16)
    elif change == "short_table":
        tables = tables[:, :2]
    elif change == "block_id":
        tables[1, 0] = 99
    elif change == "negative_id":
        tables[0, 2] = -1
    elif change == "start":
        starts[1] = 8
    elif change == "rows":
        tables = tables[:1]
    else:
        v_pool = v_pool[..., :8]
    for kernel in (True, False):
        with pytest.raises(ShapeError, match=message):
            paged_decode(query, k_pool, v_pool, tables, starts, lengths, 0.25, kernel=kernel)


def shared_layout(own: list[int], shared_blocks: int, page: int = 16, spare: int = 2):
    """Sequences that all start with the same ``shared_blocks`` blocks, then ``own[s]`` tokens in blocks
    of their own; ids shuffled through the pool."""
    counts = [-(-n // page) for n in own]
    num_blocks = shared_blocks + sum(counts) + spare
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(5)).tolist()
    common, ids = ids[:shared_blocks], ids[shared_blocks:]
    tables = torch.full((len(own), shared_blocks + max(counts) + 1), -1, dtype=torch.long)
    for row, count in enumerate(counts):
        tables[row, :shared_blocks] = torch.tensor(common)
        tables[row, shared_blocks:shared_blocks + count] = torch.tensor(ids[:count], dtype=torch.long)
        del ids[:count]
    lengths = torch.tensor([shared_blocks * page + n for n in own])
    return tables, torch.zeros(len(own), dtype=torch.long), lengths, num_blocks


@pytest.mark.parametrize(("query_heads", "kv_heads", "dim", "dtype"), [
    (9, 3, 64, torch.float32), (4, 1, 256, torch.float32), (6, 2, 128, torch.float32),
    (4, 2, 32, torch.float32), (9, 3, 64, torch.bfloat16)])
def test_a_shared_prefix_read_once_equals_sdpa(decode, request, query_heads, kv_heads, dim, dtype) -> None:
    """Five sequences behind the same 12 blocks (one with nothing of its own, one 300 tokens past
    them): the common blocks read once for all (float32, head sizes the chunk kernel takes, AVX-512),
    or per sequence where it does not take them, equal SDPA over each sequence, log-sum-exps included."""
    tables, starts, lengths, num_blocks = shared_layout([0, 1, 17, 300, 40], 12)
    assert ragged.shared_prefix(tables, starts, lengths, 16) == 12
    k_pool, v_pool = pools(kv_heads, num_blocks, 16, dim, dtype)
    query = torch.randn(5, query_heads, dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    once = ragged._shared_decode(query, k_pool, v_pool, tables, starts, lengths, 0.1, 12) is not None
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    takes = request.node.callspec.params["decode"] in ("c", "torch")  # the others patch in other builds
    assert once == (takes and avx512 and dtype == torch.float32 and dim % 64 == 0)
    got, lse = decode(query, k_pool, v_pool, tables, starts, lengths, dim ** -0.5, return_lse=True, shared=12)
    expected = reference(query, k_pool, v_pool, tables, starts, lengths, dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    _, alone = decode(query, k_pool, v_pool, tables, starts, lengths, dim ** -0.5, return_lse=True)
    torch.testing.assert_close(lse, alone, atol=1e-5, rtol=1e-5)


def test_shared_prefix_counts_the_blocks_every_sequence_reads_whole() -> None:
    tables, starts, lengths, _ = shared_layout([5, 9, 30, 2], 10)
    assert ragged.shared_prefix(tables, starts, lengths, 16) == 10
    assert ragged.shared_prefix(tables[:3], starts[:3], lengths[:3], 16) == 0  # too few sequences
    assert ragged.shared_prefix(tables, starts, lengths - 50, 16) == 0  # one reads too little: < 128 tokens
    moved = starts.clone()
    moved[2] = 3
    assert ragged.shared_prefix(tables, moved, lengths, 16) == 0  # one starts inside the first block
    tables[1, 9] = tables[1, 10]
    assert ragged.shared_prefix(tables, starts, lengths, 16) == 9  # one reads another block at 9
    assert ragged.shared_prefix(*shared_layout([5, 9, 30, 2], 7)[:3], 16) == 0  # 112 tokens < 128
