"""``quantized_decode`` (``kvfactory.quantization.ragged``) equals attention over each sequence's
decoded K/V: several KIVI stores of one pool (int4 and int2, 16- and 64-token pages, so packed blocks
hold one or two key groups and the last may be partly filled), lengths inside the full-precision
window, at a flush and far past it, GQA, MQA and multi-head shapes, code widths the kernel inlines and
ones it does not, and a store whose front was dropped. ``in_place`` refuses the stores it cannot
read. The compiled step's op over KIVI pages (``kvfactory::quantized_decode_step``) likewise."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from kvfactory import kernels
from kvfactory.codecs import native
from kvfactory.engine.batch import decode_plan
from kvfactory.engine.step_ops import PACKED
from kvfactory.manager import KVCacheManager
from kvfactory.quantization.ragged import (
    decode_blocks,
    flush_full_windows,
    flush_windows,
    in_place,
    packed_plan,
    quantized_decode,
)
from kvfactory.storage.ragged import block_tables, shared_fits, shared_prefix

pytestmark = pytest.mark.skipif(kernels.load("kivi") is None or kernels.load("ragged") is None,
                                reason="no C compiler")
PAGED_DEQUANTIZE = native.paged_dequantize
LENGTHS = [5, 128, 160, 161, 700, 1001]  # window only; at a flush; just past one; many blocks


def stores_of(config: dict, query_heads: int, kv_heads: int, head_dim: int, lengths: list[int],
              seed: int = 0) -> tuple[KVCacheManager, list]:
    """One manager's caches, layer 0 of each holding ``lengths[i]`` random tokens."""
    model_config = LlamaConfig(hidden_size=query_heads * head_dim, num_attention_heads=query_heads,
                               num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=1,
                               vocab_size=16, max_position_embeddings=4096)
    manager = KVCacheManager(model_config, {"pool_tokens": sum(lengths) + 64 * len(lengths), **config})
    gen = torch.Generator().manual_seed(seed)
    stores = []
    for i, length in enumerate(lengths):
        layer = manager.create(f"s{i}").layers[0]
        for chunk in torch.arange(length).split(300):  # writes in pieces, as prefill chunks and decodes do
            k, v = (torch.randn(1, kv_heads, chunk.numel(), head_dim, generator=gen) * 2 for _ in range(2))
            layer.append(k, v)
        stores.append(layer.store)
    return manager, stores


def reference(query: torch.Tensor, stores: list, scale: float) -> torch.Tensor:
    rows = []
    for s, store in enumerate(stores):
        keys, values = (x.double() for x in store.gather())
        q = query[None, s, :, None].double()
        rows.append(F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(rows).float()


@pytest.mark.parametrize("config", [{"type": "paged", "page_size": 16, "quantization": "int4"},
                                    {"type": "paged", "page_size": 64, "quantization": "int4"},
                                    {"type": "paged", "page_size": 16, "quantization": "int2"}],
                         ids=["int4-page16", "int4-page64", "int2-page16"])
@pytest.mark.parametrize(("query_heads", "kv_heads", "head_dim"),
                         [(9, 3, 64), (4, 1, 128), (4, 4, 32), (6, 2, 48)],
                         ids=["gqa-64", "mqa-128", "mha-32", "gqa-48"])
def test_matches_attention_over_decoded_kv(config, query_heads, kv_heads, head_dim) -> None:
    manager, stores = stores_of(config, query_heads, kv_heads, head_dim, LENGTHS)
    assert all(in_place(store, query_heads) for store in stores)
    assert stores[0].quantized_tokens == 0 and stores[-1].quantized_tokens > 0
    query = torch.randn(len(stores), query_heads, head_dim, generator=torch.Generator().manual_seed(5))
    scale = head_dim ** -0.5
    out = quantized_decode(query, stores, scale)
    torch.testing.assert_close(out, reference(query, stores, scale), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma")],
                         ids=["avx2", "portable"])
@pytest.mark.parametrize(("config", "query_heads", "kv_heads", "head_dim"),
                         [({"type": "paged", "page_size": 16, "quantization": "int4"}, 9, 3, 64),
                          ({"type": "paged", "page_size": 16, "quantization": "int2"}, 4, 1, 128)],
                         ids=["int4-gqa-64", "int2-mqa-128"])
def test_the_other_instruction_set_bodies_match_too(flags, config, query_heads, kv_heads, head_dim,
                                                    monkeypatch) -> None:
    """The kernels built without AVX-512 (their AVX2 bodies), and without AVX2 and FMA too (the portable
    ones), read the same pages as the reference the native build decodes."""
    _, stores = stores_of(config, query_heads, kv_heads, head_dim, LENGTHS)
    query = torch.randn(len(stores), query_heads, head_dim, generator=torch.Generator().manual_seed(5))
    scale = head_dim ** -0.5
    expected = reference(query, stores, scale)
    bodies = {name: kernels.load(name, flags) for name in ("kivi", "ragged", "chunk")}
    assert all(bodies.values())
    monkeypatch.setattr(kernels, "load", bodies.get)
    torch.testing.assert_close(quantized_decode(query, stores, scale), expected, atol=2e-5, rtol=1e-4)


def test_batches_without_a_window_read_the_packed_pages_only() -> None:
    """With ``residual: 0`` a layer of whole groups holds no full-precision token at all."""
    config = {"type": "paged", "quantization": {"codec": "int4", "residual": 0}}
    _, stores = stores_of(config, 9, 3, 64, [64, 320])
    assert all(store.inner.size() == 0 for store in stores)
    query = torch.randn(2, 9, 64)
    torch.testing.assert_close(quantized_decode(query, stores, 0.125), reference(query, stores, 0.125),
                               atol=2e-5, rtol=1e-4)


def test_window_only_batches_skip_the_packed_kernel() -> None:
    _, stores = stores_of({"type": "paged", "quantization": "int4"}, 9, 3, 64, [3, 100])
    query = torch.randn(2, 9, 64)
    torch.testing.assert_close(quantized_decode(query, stores, 0.125), reference(query, stores, 0.125),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("config", [{"type": "paged", "page_size": 16, "quantization": "int4"},
                                    {"type": "paged", "page_size": 64, "quantization": "int2"}],
                         ids=["int4-page16", "int2-page64"])
@pytest.mark.parametrize(("query_heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 256), (6, 2, 48)],
                         ids=["gqa-64", "mqa-256", "gqa-48"])
def test_a_prompt_every_sequence_shares_is_read_once_and_matches(config, query_heads, kv_heads, head_dim,
                                                                 monkeypatch) -> None:
    """Forks of one 700-token prompt share its whole packed blocks: those are decoded once and read for
    every query row together (exactly where ``shared_fits`` says the chunk kernel takes them; 48
    channels it does not, and nothing is decoded in vain), each fork's own tokens per sequence, and
    the result is attention over each sequence's decoded K/V."""
    manager, (prompt,) = stores_of({**config, "pool_tokens": 4096}, query_heads, kv_heads, head_dim, [700],
                                   seed=1)
    gen = torch.Generator().manual_seed(2)
    stores = [prompt]
    for i, extra in enumerate([0, 1, 40, 333]):
        layer = manager.fork("s0", f"f{i}").layers[0]
        if extra:
            layer.append(*(torch.randn(1, kv_heads, extra, head_dim, generator=gen) for _ in range(2)))
        stores.append(layer.store)
    tables = block_tables([store.runs.table.ids[0] for store in stores])
    tokens = torch.tensor([store.runs.tokens for store in stores])
    assert shared_prefix(tables, torch.zeros_like(tokens), tokens, stores[0].runs.block_tokens) > 0
    query = torch.randn(len(stores), query_heads, head_dim, generator=torch.Generator().manual_seed(5))
    scale = head_dim ** -0.5
    decoded = []
    with monkeypatch.context() as patch:
        patch.setattr(native, "paged_dequantize", lambda pool, ids, *rest: decoded.append(ids.numel())
                      or PAGED_DEQUANTIZE(pool, ids, *rest))
        out = quantized_decode(query, stores, scale)
    torch.testing.assert_close(out, reference(query, stores, scale), atol=2e-5, rtol=1e-4)
    assert (sum(decoded) > 0) == shared_fits(query) == (head_dim % 64 == 0 and chunk_has_body())


def test_a_packed_plan_is_kept_while_the_pages_stand_and_made_again_when_they_change() -> None:
    """``packed_plan`` hands back the last step's plan while every store holds the same packed blocks and
    tokens (most decode steps), and a new one, read as a fresh one is, once a store packs another group
    or the batch changes."""
    _, stores = stores_of({"type": "paged", "quantization": "int4"}, 9, 3, 64, [700, 300, 5], seed=3)
    plan = packed_plan(stores)
    assert plan is not None and packed_plan(stores, plan) is plan
    assert packed_plan(stores[:2], plan) is not plan
    gen = torch.Generator().manual_seed(8)
    layer_tokens = stores[1].quantized_tokens
    stores[1].append(*(torch.randn(1, 3, 64, 64, generator=gen) for _ in range(2)))
    assert stores[1].quantized_tokens > layer_tokens
    again = packed_plan(stores, plan)
    fresh = packed_plan(stores)
    assert again is not plan and torch.equal(again.tables, fresh.tables)
    assert torch.equal(again.tokens, fresh.tokens)
    query = torch.randn(3, 9, 64, generator=gen)
    torch.testing.assert_close(quantized_decode(query, stores, 0.125, plan=again),
                               reference(query, stores, 0.125), atol=2e-5, rtol=1e-4)
    assert packed_plan(stores[2:]) is None  # 5 tokens: all in the window


def chunk_has_body() -> bool:
    """Whether the chunk kernel computes here, found by calling it on one token."""
    one, out = torch.ones(1, 1, 64), torch.zeros(1, 1, 64)
    lib, at = kernels.load("chunk"), one.data_ptr()
    done = lib.chunk_attention(1, 1, 1, 1, 64, at, 64, 64, at, 64, 64, at, 64, 64, None, 1, 1, 1.0,
                               out.data_ptr(), None)
    assert torch.equal(out, one if done else torch.zeros(1, 1, 64))
    return bool(done)


@pytest.mark.parametrize("config", [{"type": "paged", "page_size": 16, "quantization": "int4"},
                                    {"type": "paged", "page_size": 64, "quantization": "int2"}],
                         ids=["int4-page16", "int2-page64"])
@pytest.mark.parametrize("head_dim", [64, 48, 128])
def test_a_read_decodes_the_pages_in_place_as_the_codecs_do(config, head_dim: int) -> None:
    """``gather`` (a prefill chunk's read) decodes KIVI pages straight from the pool's blocks in C,
    bit for bit what the codecs decode from the gathered codes, the window after them."""
    _, (store,) = stores_of(config, 9, 3, head_dim, [1001], seed=4)
    assert store.kernel_pages and store.quantized_tokens > 0
    keys, values = (x.clone() for x in store.gather())
    ek, ev = store.runs.encoded()
    window = store.inner.gather()
    assert torch.equal(keys, torch.cat([store.key_codec.decode(ek), window[0]], 2))
    assert torch.equal(values, torch.cat([store.value_codec.decode(ev), window[1]], 2))


@pytest.mark.parametrize("config", [{"type": "paged", "quantization": "int8"}, {"type": "paged"}],
                         ids=["int8", "plain"])
def test_refuses_other_stores(config) -> None:
    _, stores = stores_of(config, 9, 3, 64, [200])
    assert not in_place(stores[0], 9)


def test_refuses_query_heads_that_do_not_group() -> None:
    _, stores = stores_of({"type": "paged", "quantization": "int4"}, 9, 3, 64, [700])
    assert in_place(stores[0], 9) and not in_place(stores[0], 8)


def test_reads_a_store_whose_front_was_dropped() -> None:
    _, stores = stores_of({"type": "paged", "quantization": "int4"}, 9, 3, 64, [700, 400])
    stores[0].drop_front(100)
    assert in_place(stores[0], 9)
    query = torch.randn(2, 9, 64)
    torch.testing.assert_close(quantized_decode(query, stores, 0.125), reference(query, stores, 0.125),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("page_size", [16, 64])
def test_a_batched_flush_stores_what_each_store_would(page_size: int) -> None:
    """``flush_windows`` encodes the oldest group of every full window in one batch: the stores then
    hold, read and count (sampled quantization error included) exactly what each store's own ``append``
    of the next token leaves; stores whose window is not full are not flushed."""
    config = {"type": "paged", "page_size": page_size, "quantization": "int4"}
    lengths = [159, 191, 703, 100]  # 128 + 31 held in the first three: the next token flushes 32
    (_, batched), (_, each) = (stores_of(config, 9, 3, 64, lengths, seed=3) for _ in range(2))
    assert [store.batch_flush(1) for store in batched] == [32, 32, 32, 0]
    flush_windows(batched[:3], 32)
    new = torch.randn(len(lengths), 2, 1, 3, 1, 64, generator=torch.Generator().manual_seed(9))
    for i, (a, b) in enumerate(zip(batched, each, strict=True)):
        assert a.fits_window(1)
        a.append(new[i, 0], new[i, 1])
        b.append(new[i, 0], new[i, 1])
        assert (a.quantized_tokens, a.inner.size()) == (b.quantized_tokens, b.inner.size())
        assert all(torch.equal(x, y) for x, y in zip(a.gather(), b.gather(), strict=True))
        assert a.quantization_error() == pytest.approx(b.quantization_error(), nan_ok=True)
    query = torch.randn(len(lengths), 9, 64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(quantized_decode(query, batched, 0.125), quantized_decode(query, each, 0.125))


def _step_op_args(stores: list, query_heads: int, seed: int) -> tuple:
    """``kvfactory::quantized_decode_step``'s arguments for one new token of each store (one layer's),
    planned as the compiled step plans them: full windows flushed, room made in the windows."""
    flush_full_windows([store for store in stores if not store.fits_window(1)], 1)
    _, kv_heads, _, head_dim = stores[0].like[0].shape
    like = torch.empty(1, kv_heads, 1, head_dim)
    window = decode_plan([store.inner for store in stores], None, like, like)
    packed = packed_plan(stores)
    pool = stores[packed.first].runs.table.blocks.tensors
    blocks = stores[0].inner.blocks
    gen = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(1, heads, len(stores), head_dim, generator=gen)
                         for heads in (query_heads, kv_heads, kv_heads))
    bits, group = stores[0].key_codec.bits, stores[0].value_codec.group_size
    decoded = (decode_blocks(pool, bits, group, packed.tables[0, :packed.shared]) if packed.shared
               else torch.zeros(2, kv_heads, 2, head_dim))
    return (query, key, value, blocks.k, blocks.v, window.slots, window.tables, window.starts, window.lengths,
            torch.tensor(window.shared), [pool[name] for name in PACKED], packed.tables, packed.tokens,
            torch.tensor(packed.shared), decoded, head_dim ** -0.5, bits, group)


@pytest.mark.parametrize(("lengths", "fork"), [(LENGTHS, False), ([700], True)], ids=["own", "shared-prompt"])
def test_the_compiled_steps_op_writes_each_token_then_attends_over_its_decoded_kv(lengths, fork) -> None:
    """``kvfactory::quantized_decode_step`` (``kvfactory.engine.step_ops``) stores each sequence's new
    token in its window, where the stores then hold it, and returns attention over each sequence's
    decoded K/V: sequences of their own pages (some at a flush), and forks behind a shared prompt's
    packed blocks read once for all."""
    config = {"type": "paged", "page_size": 16, "quantization": "int4", "pool_tokens": 8192}
    manager, stores = stores_of(config, 9, 3, 64, lengths)
    if fork:
        stores += [manager.fork("s0", f"f{i}").layers[0].store for i in range(3)]
    args = _step_op_args(stores, 9, seed=4)
    query, key, value = args[:3]
    read = [*args[:3], *args[5:10], *args[10], *args[11:15]]  # every tensor but the windows' pools
    kept = [x.clone() for x in read]
    out = torch.ops.kvfactory.quantized_decode_step(*args)
    for before, after in zip(kept, read, strict=True):  # FP8 scales compared as bytes
        assert torch.equal(before.reshape(-1).view(torch.uint8), after.reshape(-1).view(torch.uint8))
    for i, store in enumerate(stores):
        held_k, held_v = store.inner.gather()
        assert torch.equal(held_k[0, :, -1], key[0, :, i]) and torch.equal(held_v[0, :, -1], value[0, :, i])
    assert fork == bool(args[13])  # the shared prompt's packed blocks, read once for all
    torch.testing.assert_close(out[0], reference(query[0].transpose(0, 1), stores, args[15]), atol=2e-5,
                               rtol=1e-4)


def test_the_compiled_steps_op_passes_torch_custom_op_checks() -> None:
    """The fake kernel's shapes, autograd registration and tracing with dynamic shapes. (opcheck's schema
    test cannot compare FP8 scales; the test above checks that the op changes nothing but the windows.)"""
    _, stores = stores_of({"type": "paged", "page_size": 16, "quantization": "int4"}, 9, 3, 64, [300, 161])
    torch.library.opcheck(torch.ops.kvfactory.quantized_decode_step.default, _step_op_args(stores, 9, seed=6),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def _prefill_op_args(stores: list, chunks: list[int], query_heads: int, seed: int) -> tuple:
    """``kvfactory::quantized_prefill_step``'s arguments for ``chunks[i]`` new tokens of each store (one
    layer's), planned as the compiled prefill step plans them: full windows flushed, room made in the
    windows, also for chunks that encode some of their own tokens (``own_flush``) and stores before their
    first write."""
    _, kv_heads, _, head_dim = next(store.like for store in stores if store.like is not None)[0].shape
    like = torch.empty(1, kv_heads, 1, head_dim)
    own = [store.own_flush(n) for store, n in zip(stores, chunks, strict=True)]
    flush_full_windows(stores, chunks)
    for store in stores:
        if store.like is None:
            store.check_like(like, like)
    pages = [store.inner for store in stores]
    slots = torch.cat([page.next_slots(like, like, n) for page, n in zip(pages, chunks, strict=True)])
    held = [page.pages_in_place() for page in pages]
    assert all(offset == 0 for _, _, offset, _ in held)
    packed = packed_plan(stores)
    pool = stores[packed.first].runs.table.blocks.tensors
    blocks = pages[0].layer_blocks(like, like)
    gen = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(1, heads, sum(chunks), head_dim, generator=gen)
                         for heads in (query_heads, kv_heads, kv_heads))
    return (query, key, value, blocks.k, blocks.v, slots, torch.tensor([0, *torch.tensor(chunks).cumsum(0)]),
            block_tables([ids for _, ids, _, _ in held]), torch.tensor([length for *_, length in held]),
            [pool[name] for name in PACKED], packed.tables, packed.tokens, torch.tensor(packed.shared),
            torch.tensor(own), head_dim ** -0.5, stores[0].key_codec.bits, stores[0].value_codec.group_size)


@pytest.mark.skipif(not chunk_has_body(), reason="the chunk kernel has no body on this CPU")
@pytest.mark.parametrize(("lengths", "chunks", "fork"),
                         [([5, 300, 700, 161], [40, 1, 60, 30], False), ([700], [50, 1, 20, 33], True),
                          ([0, 100, 700, 161], [300, 200, 1, 30], False)],
                         ids=["own", "shared-prompt", "own-flush"])
def test_the_compiled_prefill_op_writes_each_chunk_then_attends_over_its_decoded_kv(lengths, chunks,
                                                                                    fork) -> None:
    """``kvfactory::quantized_prefill_step`` stores each sequence's chunk (a decode token among them) in
    its window, where the stores then hold it, and returns each chunk's causal attention over its
    sequence's decoded K/V: sequences of their own pages (one with no packed token yet, some whose
    windows encoded their oldest groups first), forks behind a shared prompt's packed blocks, and chunks
    that encode some of their own tokens (one the store's first write), encoded by a batched flush after
    the op as ``append`` encodes them: the op read those tokens as the store then holds them."""
    config = {"type": "paged", "page_size": 16, "quantization": "int4", "pool_tokens": 8192}
    manager, stores = stores_of(config, 9, 3, 64, lengths)
    if fork:
        stores += [manager.fork("s0", f"f{i}").layers[0].store for i in range(3)]
    packed = [store.quantized_tokens for store in stores]
    args = _prefill_op_args(stores, chunks, 9, seed=4)
    query, key, value, bounds = *args[:3], args[6].tolist()
    out = torch.ops.kvfactory.quantized_prefill_step(*args)
    own = args[13].tolist()
    assert fork == bool(args[12])  # the shared prompt's packed blocks, read once for all
    assert (sum(own) > 0) == (0 in lengths)
    flush_full_windows([store for store, flush in zip(stores, own, strict=True) if flush], 0)
    flushed = any(store.quantized_tokens > n for store, n in zip(stores, packed, strict=True))
    assert fork or (0 in packed and flushed)
    for s, store in enumerate(stores):
        keys, values = (x.double() for x in store.gather())
        rows = slice(bounds[s], bounds[s + 1])
        held = store.inner.size() if own[s] else chunks[s]  # the chunk's tokens still in full precision
        assert own[s] == 0 or (store.quantized_tokens == packed[s] + own[s] and held < chunks[s])
        assert torch.equal(keys[0, :, -held:].float(), key[0, :, rows][:, -held:])
        assert torch.equal(values[0, :, -held:].float(), value[0, :, rows][:, -held:])
        mask = torch.ones(chunks[s], keys.shape[2], dtype=torch.bool).tril(keys.shape[2] - chunks[s])
        expected = F.scaled_dot_product_attention(query[:, :, rows].double(), keys, values, attn_mask=mask,
                                                  scale=args[14], enable_gqa=True)
        torch.testing.assert_close(out[0, rows], expected[0].transpose(0, 1).float(), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not chunk_has_body(), reason="the chunk kernel has no body on this CPU")
def test_the_compiled_prefill_op_passes_torch_custom_op_checks() -> None:
    """As the decode step's op: the fake kernel's shapes, autograd registration and dynamic tracing."""
    _, stores = stores_of({"type": "paged", "page_size": 16, "quantization": "int4"}, 9, 3, 64, [300, 161])
    torch.library.opcheck(torch.ops.kvfactory.quantized_prefill_step.default,
                          _prefill_op_args(stores, [40, 90], 9, seed=6),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
