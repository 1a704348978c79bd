"""Storage unit tests on random tensors (no model): dense and paged stores, the block pool."""

from __future__ import annotations

import pytest
import torch
from helpers import apply_edit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfactory import (
    AllocationError,
    CacheFullError,
    ConfigError,
    DenseStore,
    PagedPool,
    PagedStore,
    ShapeError,
    TensorTypeError,
)
from kvfactory.storage.blocks import PoolSpec, append_each, memory_bytes
from kvfactory.storage.paged import front_tokens

B, H, D = 2, 3, 8  # batch rows, kv heads, head dim
SLOT = 2 * H * D * 4  # bytes of one token's K and V in one layer (fp32)

STORES = {
    "dense": lambda: DenseStore(),
    "dense-tight": lambda: DenseStore(growth=1.0, reserve_tokens=0),
    "paged1": lambda: PagedStore(page_size=1),
    "paged3": lambda: PagedStore(page_size=3),
    "paged16": lambda: PagedStore(page_size=16),
}
store_kinds = pytest.mark.parametrize("kind", list(STORES))


def kv(tokens: int, batch: int = B, heads: int = H, dim: int = D, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, tokens, dim, generator=gen).to(dtype),
            torch.randn(batch, heads, tokens, dim, generator=gen).to(dtype))


def filled(kind: str, chunks=(5, 1, 7, 16, 2)):
    """A store of ``kind`` after appending ``chunks`` tokens, and the concatenated reference K/V."""
    store = STORES[kind]()
    keys, values = [], []
    for i, n in enumerate(chunks):
        k, v = kv(n, seed=i + 1)
        store.append(k, v)
        keys.append(k)
        values.append(v)
    return store, torch.cat(keys, 2), torch.cat(values, 2)


def assert_holds(store, keys: torch.Tensor, values: torch.Tensor) -> None:
    assert store.size() == keys.shape[2]
    assert store.batch_size == keys.shape[0]
    got_k, got_v = store.gather()
    assert got_k.shape == keys.shape and got_v.shape == values.shape
    assert torch.equal(got_k, keys)
    assert torch.equal(got_v, values)


def block_pool(store: PagedStore):
    return store.pool.layers[store.layer_idx]


# -- round trips and edits ----------------------------------------------------------------------

@store_kinds
def test_append_gather_round_trip(kind: str) -> None:
    store, keys, values = filled(kind)
    assert_holds(store, keys, values)


@store_kinds
def test_value_head_dim_may_differ_from_key_head_dim(kind: str) -> None:
    store = STORES[kind]()
    k, v = torch.randn(B, H, 5, D), torch.randn(B, H, 5, D + 4)
    store.append(k, v)
    store.append(k[:, :, :2], v[:, :, :2])
    assert_holds(store, torch.cat([k, k[:, :, :2]], 2), torch.cat([v, v[:, :, :2]], 2))


@store_kinds
@pytest.mark.parametrize("batch", [1, B])
def test_gathered_tensors_survive_edits(kind: str, batch: int) -> None:
    """What ``gather`` returned is not overwritten by later edits of the store (short of an append)."""
    store, keys, values = filled(kind)
    if batch == 1:  # a single row may be gathered as a view of the storage
        store.select_rows(torch.tensor([1]))
        keys, values = keys[1:], values[1:]
    got_k, got_v = store.gather()
    store.drop_front(4)
    store.truncate(10)
    store.select_rows(torch.tensor([0] * batch))
    store.keep(torch.tensor([0, 3, 5]))
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)


@store_kinds
@pytest.mark.parametrize("n", [0, 1, 4, 16, 20])
def test_drop_front(kind: str, n: int) -> None:
    store, keys, values = filled(kind)
    store.drop_front(n)
    assert_holds(store, keys[:, :, n:], values[:, :, n:])
    k, v = kv(6, seed=99)
    store.append(k, v)
    assert_holds(store, torch.cat([keys[:, :, n:], k], 2), torch.cat([values[:, :, n:], v], 2))


def test_a_dense_window_after_a_long_prompt_moves_to_a_buffer_its_size() -> None:
    """A sliding layer's dense buffer, grown for a 600-token prompt, shrinks to the 7 tokens it keeps
    plus its headroom when the window drops the rest (not at the next growth, hundreds of steps on)."""
    store = DenseStore(reserve_tokens=16)
    store.bind(0)
    k, v = kv(600, seed=5)
    store.append(k, v)
    store.drop_front(593)
    assert_holds(store, k[:, :, 593:], v[:, :, 593:])
    assert store.memory_report().allocated == 2 * k[:, :, :7 + 16].nbytes


@store_kinds
@pytest.mark.parametrize("n", [1, 6, 16, 30])
def test_truncate(kind: str, n: int) -> None:
    store, keys, values = filled(kind)
    store.truncate(n)
    assert_holds(store, keys[:, :, :n], values[:, :, :n])
    k, v = kv(5, seed=98)
    store.append(k, v)
    assert_holds(store, torch.cat([keys[:, :, :n], k], 2), torch.cat([values[:, :, :n], v], 2))


@store_kinds
@pytest.mark.parametrize("index", [[0], [0, 1, 2, 3], [2, 7, 8, 19, 30], list(range(31))])
def test_keep(kind: str, index: list[int]) -> None:
    store, keys, values = filled(kind)
    idx = torch.tensor(index)
    store.keep(idx)
    assert_holds(store, keys.index_select(2, idx), values.index_select(2, idx))
    k, v = kv(4, seed=97)
    store.append(k, v)
    kept_k, kept_v = keys.index_select(2, idx), values.index_select(2, idx)
    assert_holds(store, torch.cat([kept_k, k], 2), torch.cat([kept_v, v], 2))


@store_kinds
@pytest.mark.parametrize("rows", [[1, 0], [0, 0], [1, 1, 0], [0, 1, 0, 1], [1]])
def test_select_rows(kind: str, rows: list[int]) -> None:
    store, keys, values = filled(kind)
    r = torch.tensor(rows)
    store.select_rows(r)
    assert_holds(store, keys[r], values[r])
    k, v = kv(7, batch=len(rows), seed=96)
    store.append(k, v)
    assert_holds(store, torch.cat([keys[r], k], 2), torch.cat([values[r], v], 2))


@store_kinds
def test_clear_then_reuse(kind: str) -> None:
    store, _, _ = filled(kind)
    store.clear()
    assert store.size() == 0 and store.batch_size == 0
    k, v = kv(3, batch=4, seed=5)  # a new batch size is fine after clear()
    store.append(k, v)
    assert_holds(store, k, v)


@store_kinds
@pytest.mark.parametrize("how", ["truncate", "keep", "drop_front"])
def test_gather_after_removing_every_token(kind: str, how: str) -> None:
    """An emptied store (e.g. crop(-seen), or a policy that evicts everything) gathers zero tokens."""
    store, keys, _ = filled(kind)
    if how == "truncate":
        store.truncate(0)
    elif how == "keep":
        store.keep(torch.tensor([], dtype=torch.long))
    else:
        store.drop_front(keys.shape[2])
    got_k, got_v = store.gather()
    assert got_k.shape == (B, H, 0, D) and got_v.shape == (B, H, 0, D)
    k, v = kv(2, seed=3)
    store.append(k, v)
    assert_holds(store, k, v)


# -- memory reports --------------------------------------------------------------------------

@store_kinds
def test_memory_report_counts_stored_tokens(kind: str) -> None:
    store, keys, _ = filled(kind)
    report = store.memory_report()
    assert report.tokens == B * keys.shape[2]
    assert report.used == B * keys.shape[2] * SLOT
    assert report.allocated >= report.used and report.waste == report.allocated - report.used
    store.clear()
    assert store.memory_report().allocated == 0


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_memory_report_is_whole_blocks_with_under_one_page_of_waste(page_size: int) -> None:
    store = PagedStore(page_size=page_size)
    store.append(*kv(31))
    report = store.memory_report()
    blocks = -(-31 // page_size)
    assert report.allocated == B * blocks * page_size * SLOT
    assert report.waste < B * page_size * SLOT
    assert store.pool.memory_report().used == report.allocated  # the pool sees the same blocks


# -- paged: copy-on-write and refcounts ---------------------------------------------------------

def refcounts(pool) -> torch.Tensor:
    """Per-block refcounts of a layer pool, whatever array type the pool keeps them in."""
    return torch.as_tensor(pool.refcount).long()


def test_shared_blocks_are_copied_on_write() -> None:
    """Two rows share all blocks after select_rows; appending different tokens to each leaves the
    other row's data untouched, and the shared full block is not copied."""
    store = PagedStore(page_size=4)
    k0, v0 = kv(6, batch=1, seed=1)  # 1 full block + 2 tokens in a second block
    store.append(k0, v0)
    pool = block_pool(store)
    store.select_rows(torch.tensor([0, 0]))
    assert sorted(refcounts(pool)[refcounts(pool) > 0].tolist()) == [2, 2]
    before_k, before_v = (t.clone() for t in store.gather())
    view_k, _ = store.gather()

    k1, v1 = kv(1, batch=2, seed=2)  # row 0 and row 1 append different tokens into the shared block
    store.append(k1, v1)
    got_k, got_v = store.gather()
    for row in range(2):
        assert torch.equal(got_k[row], torch.cat([k0[0], k1[row]], 1))
        assert torch.equal(got_v[row], torch.cat([v0[0], v1[row]], 1))
    assert torch.equal(view_k, before_k)  # what was gathered before the write is unchanged
    counts = refcounts(pool)
    assert int(counts.sum()) == 4  # two rows x two blocks each
    assert (counts == 2).sum() == 1  # the full first block is still shared, not copied
    assert pool.num_blocks - len(pool.free) in (2, 3)  # one or both rows got a private copy

    k2, v2 = kv(3, batch=2, seed=3)  # crosses into a third block
    store.append(k2, v2)
    got_k, _ = store.gather()
    for row in range(2):
        assert torch.equal(got_k[row], torch.cat([k0[0], k1[row], k2[row]], 1))

    store.clear()
    assert int(refcounts(pool).abs().sum()) == 0
    assert sorted(pool.free) == list(range(pool.num_blocks))


def test_select_rows_refcounts_and_release() -> None:
    store = PagedStore(page_size=4)
    store.append(*kv(8, batch=3))  # 2 blocks per row
    pool = block_pool(store)
    free_before = len(pool.free)
    store.select_rows(torch.tensor([2, 2, 2, 0]))  # row 1 is dropped, row 2 is shared 3 times
    assert sorted(refcounts(pool)[refcounts(pool) > 0].tolist()) == [1, 1, 3, 3]
    assert len(pool.free) == free_before + 2  # row 1's two blocks went back
    store.select_rows(torch.tensor([3]))  # keep only the old row 0
    assert sorted(refcounts(pool)[refcounts(pool) > 0].tolist()) == [1, 1]
    store.clear()
    assert int(refcounts(pool).abs().sum()) == 0 and len(pool.free) == pool.num_blocks


def test_dropped_front_blocks_go_back_to_the_pool() -> None:
    store = PagedStore(page_size=4)
    store.append(*kv(16))  # 4 blocks per row
    pool = block_pool(store)
    free0 = len(pool.free)
    store.drop_front(3)  # still inside the first block
    assert len(pool.free) == free0
    store.drop_front(6)  # 9 dropped: the first two blocks are dead
    assert len(pool.free) == free0 + 2 * B
    store.truncate(2)  # tokens 9, 10: one block left per row
    assert len(pool.free) == free0 + 3 * B


def test_store_releases_blocks_when_garbage_collected() -> None:
    import gc

    pool = PagedPool(page_size=4, blocks=8)
    store = PagedStore(page_size=4)
    store.attach(pool)
    store.append(*kv(8))
    assert pool.free_blocks() == {0: 4}
    del store
    gc.collect()
    assert pool.free_blocks() == {0: 8}


# -- paged: pool growth and sizing -------------------------------------------------------------

def test_unsized_pool_grows_and_keeps_data() -> None:
    store = PagedStore(page_size=1)
    k1, v1 = kv(50, seed=1)
    store.append(k1, v1)
    pool = block_pool(store)
    initial = pool.num_blocks
    k2, v2 = kv(4 * initial, seed=2)
    store.append(k2, v2)
    assert pool.num_blocks >= B * (50 + 4 * initial) > initial
    assert_holds(store, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2))


@pytest.mark.parametrize(("options", "blocks"), [
    ({"pool_tokens": 100}, 7),  # ceil(100 / 16)
    ({"pool_tokens": 96}, 6),
    ({"pool_blocks": 5}, 5),
    ({"pool_bytes": 3 * 16 * SLOT}, 3),
    ({"pool_bytes": 3 * 16 * SLOT + 16 * SLOT - 1}, 3),  # rounds down
])
def test_sized_pool(options: dict, blocks: int) -> None:
    store = PagedStore(page_size=16, **options)
    store.append(*kv(1, batch=1))
    pool = block_pool(store)
    assert pool.num_blocks == blocks
    assert pool.memory_report().allocated == blocks * 16 * SLOT
    store.append(*kv(16 * (blocks - 1), batch=1))  # fills the pool exactly
    with pytest.raises(CacheFullError):
        store.append(*kv(16, batch=1))
    assert pool.num_blocks == blocks  # a sized pool never grows


def test_pool_bytes_are_split_over_layers() -> None:
    pool = PagedPool(page_size=16, bytes=6 * 16 * SLOT, num_layers=3)
    k, v = kv(1)
    assert pool.block_pool(PoolSpec.for_kv("kv", 0, 16, k, v)).num_blocks == 2
    assert pool.block_pool(PoolSpec.for_kv("kv", 2, 16, k, v)).num_blocks == 2


def test_pool_bytes_below_one_block_per_layer() -> None:
    store = PagedStore(page_size=16, pool_bytes=16 * SLOT - 1)
    with pytest.raises(ConfigError) as exc:
        store.append(*kv(1))
    assert "pool_bytes" in str(exc.value) and str(16 * SLOT - 1) in str(exc.value)


def test_full_pool_raises_before_writing() -> None:
    store = PagedStore(page_size=4, pool_tokens=64)  # 16 blocks
    store.append(*kv(20, batch=1))  # 5 blocks
    pool = block_pool(store)
    snapshot = store.gather()
    report = store.memory_report()
    with pytest.raises(CacheFullError) as exc:
        store.append(*kv(60, batch=1, seed=4))  # needs 15 more blocks (token 21..80), 11 are free
    err = exc.value
    assert (err.needed_blocks, err.free_blocks, err.total_blocks, err.page_size) == (15, 11, 16, 4)
    for number in ("15", "11", "16"):
        assert number in str(err)
    assert store.size() == 20 and store.memory_report() == report
    assert len(pool.free) == 11 and int(refcounts(pool).sum()) == 5
    assert torch.equal(store.gather()[0], snapshot[0])
    store.append(*kv(44, batch=1, seed=5))  # exactly what is left still fits
    assert len(pool.free) == 0


def test_append_each_writes_every_table_or_none() -> None:
    """A batched write of several tokens into several one-row tables (a batched flush's) stores each
    row's tokens after its own; a write the pool cannot hold for them all changes nothing."""
    pool = PagedStore.make_shared({"page_size": 4, "pool_tokens": 24}, 1)  # 6 blocks
    stores = []
    for seed in range(2):
        store = PagedStore(page_size=4)
        store.bind(0)
        store.attach(pool)
        store.append(*kv(6, batch=1, seed=seed))  # 2 blocks each, the second partly filled
        stores.append(store)
    blocks, tables = stores[0].blocks, [store._table for store in stores]
    before = [store.gather() for store in stores]
    more = kv(7, batch=2, seed=5)
    with pytest.raises(CacheFullError) as exc:
        append_each(tables, blocks, {"k": more[0], "v": more[1]}, 7)  # 2 more blocks each, 2 free
    assert "4" in str(exc.value) and "2" in str(exc.value)
    for store, (k, v) in zip(stores, before, strict=True):
        assert_holds(store, k, v)
    more = kv(3, batch=2, seed=6)
    append_each(tables, blocks, {"k": more[0], "v": more[1]}, 3)
    for i, (store, (k, v)) in enumerate(zip(stores, before, strict=True)):
        assert_holds(store, torch.cat([k, more[0][i:i + 1]], 2), torch.cat([v, more[1][i:i + 1]], 2))
    front = front_tokens(stores, 5)
    for i, store in enumerate(stores):
        assert all(torch.equal(front[j][i:i + 1], held[:, :, :5]) for j, held in enumerate(store.gather()))


# -- shape errors ------------------------------------------------------------------------------

@store_kinds
def test_three_dimensional_tensors(kind: str) -> None:
    store = STORES[kind]()
    with pytest.raises(ShapeError) as exc:
        store.append(torch.randn(H, 5, D), torch.randn(H, 5, D))
    assert str((H, 5, D)) in str(exc.value)


@store_kinds
def test_key_value_mismatch(kind: str) -> None:
    store = STORES[kind]()
    k, v = torch.randn(B, H, 5, D), torch.randn(B, H, 4, D)
    with pytest.raises(ShapeError) as exc:
        store.append(k, v)
    assert str(tuple(k.shape)) in str(exc.value) and str(tuple(v.shape)) in str(exc.value)
    with pytest.raises(ShapeError):
        store.append(k, k.to(torch.float64))
    assert store.size() == 0


@store_kinds
@pytest.mark.parametrize("change", ["batch", "heads", "head_dim"])
def test_append_incompatible_to_existing_store(kind: str, change: str) -> None:
    store, keys, values = filled(kind)
    shape = {"batch": (B + 1, H, 2, D), "heads": (B, H + 1, 2, D), "head_dim": (B, H, 2, D + 2)}[change]
    with pytest.raises(ShapeError) as exc:
        store.append(torch.randn(shape), torch.randn(shape))
    message = str(exc.value)
    wrong = {"batch": B + 1, "heads": H + 1, "head_dim": D + 2}[change]
    right = {"batch": B, "heads": H, "head_dim": D}[change]
    assert str(wrong) in message and str(right) in message, message
    assert_holds(store, keys, values)  # nothing was written


@store_kinds
def test_anything_but_floating_point_tensors_is_refused_by_type(kind: str) -> None:
    store = STORES[kind]()
    k, v = kv(2)
    with pytest.raises(TensorTypeError, match=r"key is a list: expected torch tensors of shape "
                                              r"\[batch, kv_heads, tokens, head_dim\]"):
        store.append(k.tolist(), v.tolist())
    with pytest.raises(TypeError, match="value is a ndarray"):  # callers catching TypeError still do
        store.append(k, v.numpy())
    with pytest.raises(TensorTypeError, match="key is a torch.int64 tensor: expected floating-point"):
        store.append(k.long(), v.long())
    assert store.size() == 0


def test_a_dense_buffer_the_allocator_refuses_raises_with_the_numbers() -> None:
    store, keys, values = filled("dense-tight")
    store.reserve_tokens = 10**12  # beyond any machine: torch's allocator refuses the new buffer
    with pytest.raises(AllocationError) as exc:
        store.append(*kv(1, seed=9))
    message, capacity = str(exc.value), keys.shape[2] + 1 + 10**12
    nbytes = B * H * capacity * 2 * D * 4
    for number in (f"{nbytes:,} bytes", f"{capacity:,} tokens", f"reserve_tokens={10**12:,}",
                   f"{memory_bytes():,} bytes of memory", "can't allocate memory"):
        assert number in message, message
    assert isinstance(exc.value, RuntimeError)  # as torch's own allocation error is
    assert_holds(store, keys, values)  # nothing was written


def test_dtype_mismatch_against_paged_pool() -> None:
    store = PagedStore(page_size=4)
    store.append(*kv(3))
    with pytest.raises(ShapeError) as exc:
        store.append(*kv(2, dtype=torch.float16))
    assert "float16" in str(exc.value) and "float32" in str(exc.value)
    assert store.size() == 3


def test_gather_before_append() -> None:
    for kind in STORES:
        with pytest.raises(ShapeError):
            STORES[kind]().gather()


def test_page_size_must_match_the_pool() -> None:
    store = PagedStore(page_size=8)
    with pytest.raises(ConfigError) as exc:
        store.attach(PagedPool(page_size=16))
    assert "page_size" in str(exc.value) and "8" in str(exc.value) and "16" in str(exc.value)


# -- random operation sequences against a plain-tensor model -------------------------------------

_OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 9)),
    st.tuples(st.just("drop_front"), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 40)),
    st.tuples(st.just("keep"), st.integers(0, 2 ** 16 - 1)),
    st.tuples(st.just("keep_heads"), st.integers(0, 2 ** 16 - 1)),
    st.tuples(st.just("select_rows"), st.lists(st.integers(0, 3), min_size=1, max_size=4)),
), min_size=1, max_size=25)


@store_kinds
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_random_operations_match_a_tensor_model(kind: str, ops) -> None:
    """Any sequence of edits leaves the store holding what the same edits do to plain tensors,
    and a paged pool's refcounts always equal the block references the store holds."""
    store = STORES[kind]()
    ref_k, ref_v = kv(4, seed=0)
    store.append(ref_k, ref_v)
    for step, (op, arg) in enumerate(ops):
        ref_k, ref_v = apply_edit(store, op, arg, ref_k, ref_v,
                                  lambda t, rows, i=step: kv(t, batch=rows, seed=i + 1))
        assert_holds(store, ref_k, ref_v)
        if isinstance(store, PagedStore):
            pool = block_pool(store)
            held = store.memory_report().allocated // pool.block_bytes  # distinct blocks held
            assert pool.num_blocks - len(pool.free) == held
            assert len(set(pool.free)) == len(pool.free)  # no block is free twice
    store.clear()
    if isinstance(store, PagedStore):
        pool = block_pool(store)
        assert int(refcounts(pool).abs().sum()) == 0 and len(pool.free) == pool.num_blocks
