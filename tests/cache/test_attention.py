"""kvfactory's attention function: chunked attention over quantized layers equals decode-then-SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_generation, attn_implementation, generate
from tiny_models import TINY_IDS, left_padded_batch, tiny_model
from transformers import DynamicCache

from kvfactory import KVCacheFactory, attention, kernels
from kvfactory.codecs import fused, native
from kvfactory.codecs.spec import QuantizationSpec
from kvfactory.quantization.store import QuantizedRead, QuantizedStore
from kvfactory.storage import DenseStore, PagedStore
from kvfactory.storage.workspace import ReadWorkspace

QUANTIZED = [
    {"type": "dense", "quantization": {"codec": "int4", "residual": 8, "group_size": 8}},
    {"type": "paged", "page_size": 4, "quantization": {"codec": "int2", "residual": 0, "group_size": 8}},
    {"type": "dense", "quantization": "int8"},
    {"type": "paged", "page_size": 16, "quantization": "fp8"},
]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch) -> None:
    """Chunks of a few hundred bytes, so tiny layers are read in many chunks (real ones: 4 MiB)."""
    monkeypatch.setattr(QuantizedRead, "chunk_bytes", 512)


def filled_store(codec: str, batch: int, heads: int, tokens: int, inner: str = "dense") -> QuantizedStore:
    spec = QuantizationSpec(codec=codec, residual=8, group_size=8)
    base = DenseStore() if inner == "dense" else PagedStore(page_size=8)
    store = QuantizedStore(base, *spec.codecs(0, 1), 8, ReadWorkspace())
    store.bind(0)
    gen = torch.Generator().manual_seed(0)
    store.append(torch.randn(batch, heads, tokens, 16, generator=gen),
                 torch.randn(batch, heads, tokens, 16, generator=gen))
    return store


def sdpa_reference(query, store, mask, scale):
    keys, values = (t.clone() for t in store.gather())
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    causal = mask is None and query.shape[2] > 1
    if causal:  # the queries are the last q positions
        q, t = query.shape[2], keys.shape[2]
        mask = torch.ones(q, t, dtype=torch.bool).tril(t - q)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("codec", ["int4", "int2", "int8", "fp8"])
@pytest.mark.parametrize("inner", ["dense", "paged"])
@pytest.mark.parametrize(("query_heads", "kv_heads"), [(6, 3), (4, 1), (2, 2)])
@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "per_head"])
@pytest.mark.parametrize("kernels", ["native", "fused", "chunks"])
def test_chunked_attention_equals_sdpa_over_the_decoded_cache(codec, inner, query_heads, kv_heads, queries,
                                                              mask_kind, kernels, monkeypatch) -> None:
    """C kernels or fused kernels over the codes, or decoding in 8-token chunks: the same attention
    as SDPA. The C kernels (KIVI only) read every quantized token in one run."""
    if kernels == "native" and not native.available():
        pytest.skip("no C compiler on this machine")
    if kernels != "native":
        monkeypatch.setattr(native, "available", lambda: False)
    if kernels == "chunks":
        monkeypatch.setitem(fused._state, "available", False)
    monkeypatch.setattr(QuantizedRead, "chunk_bytes", 2 * kv_heads * 16 * 4 * 8)  # 8-token chunks
    batch, tokens = 2, 45
    store = filled_store(codec, batch, kv_heads, tokens, inner)
    read = store.deferred_read()
    one_run = kernels == "native" and codec in ("int4", "int2")
    assert read is not None and read.length == tokens and read.chunk == (read.quantized if one_run else 8)
    monkeypatch.setattr(QuantizedRead, "chunk_bytes", 10 ** 6)
    whole = store.deferred_read() is None  # a layer that fits two chunks is read whole...
    assert whole == (kernels == "chunks" or codec == "fp8")  # ...unless kernels read it
    query = torch.randn(batch, query_heads, queries, 16, generator=torch.Generator().manual_seed(1))
    mask = None
    if mask_kind == "bool":  # row 1 is left-padded by 5 tokens
        mask = torch.ones(batch, 1, queries, tokens, dtype=torch.bool).tril(tokens - queries)
        mask[1, :, :, :5] = False
    elif mask_kind == "float":
        mask = torch.randn(batch, 1, queries, tokens)
    elif mask_kind == "per_head":
        mask = torch.rand(batch, query_heads, queries, tokens) > 0.3
        mask[..., -1] = True
    got = attention.attend(query, read, mask, 0.25)
    want = sdpa_reference(query, store, mask, 0.25)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_a_read_left_for_other_keys_is_an_error_or_stale() -> None:
    store = filled_store("int8", 1, 2, 20)
    read = store.deferred_read()
    tail = read.tail()[0]
    attention.defer(read, tail, 0)
    with pytest.raises(RuntimeError, match="not the ones the cache returned"):
        attention.take(tail.clone(), 0)  # this layer, same length, other tensor: K/V were transformed
    assert attention.take(tail, 0) == (None, None)  # the slot is cleared either way
    for other_layer, key in ((1, tail.clone()), (0, torch.zeros(1, 2, 3, 16))):
        attention.defer(read, tail, 0)
        assert attention.take(key, other_layer) == (None, None)  # left by an update outside this forward
    attention.defer(read, tail, 0)
    assert attention.take(tail, 0) == (read, None)


@pytest.mark.parametrize("model_id", TINY_IDS)
@pytest.mark.parametrize("config", QUANTIZED, ids=["dense-int4", "paged-int2", "dense-int8", "paged-fp8"])
def test_generation_with_kvfactory_attention_equals_sdpa(model_id: str, config: dict) -> None:
    """Same cache config, two attention implementations: identical tokens, logits within 1e-5. The
    factory switches the model to kvfactory's attention; switched back to SDPA, the cache reads whole."""
    model = tiny_model(model_id)
    inputs = left_padded_batch([30, 22, 17])
    with attn_implementation(model, "sdpa"):
        cache = KVCacheFactory(model.config, config).create_cache()
        model.set_attn_implementation("sdpa")
        ref = generate(model, inputs, cache, max_new_tokens=8)
        out = generate(model, inputs, KVCacheFactory(model.config, config).create_cache(), max_new_tokens=8)
        assert model.config._attn_implementation == "kvfactory"
    assert_same_generation(ref, out)


def test_decode_steps_take_the_chunked_path_and_never_decode_a_whole_layer(monkeypatch) -> None:
    model = tiny_model("llama")
    calls = []
    real = attention.attend
    monkeypatch.setattr(attention, "attend", lambda *a: calls.append(a[0].shape) or real(*a))
    factory = KVCacheFactory(model.config, QUANTIZED[0])
    cache = factory.create_cache()
    inputs = left_padded_batch([40, 33])
    with attn_implementation(model, "kvfactory"):
        generate(model, inputs, cache, max_new_tokens=6)
    layers = model.config.num_hidden_layers
    assert len(calls) == 5 * layers  # every decode step of every layer (the prefill reads whole)
    assert attention.take(torch.zeros(1), 0) == (None, None)  # each read was taken by its layer's attention


def test_reads_left_by_updates_outside_a_forward_are_dropped() -> None:
    """Filling a cache by hand leaves a read pending; the next forward's first layer (here a
    full-precision one, which defers nothing) must not receive it."""
    model = tiny_model("llama")
    config = {"type": "dense", "quantization": {"codec": "int8", "full_precision_first": 1}}
    inputs = left_padded_batch([30, 30])
    ref = generate(model, inputs, KVCacheFactory(model.config, config).create_cache(), max_new_tokens=4)
    cache = KVCacheFactory(model.config, config).create_cache()
    with attn_implementation(model, "kvfactory"):
        with torch.no_grad():
            prefill = DynamicCache(config=model.config)
            model(inputs["input_ids"][:, :-1], attention_mask=inputs["attention_mask"][:, :-1],
                  past_key_values=prefill)
        for i, layer in enumerate(prefill.layers):
            cache.update(layer.keys, layer.values, i)  # the last layer's read stays pending
        out = generate(model, inputs, cache, max_new_tokens=4)
    assert torch.equal(out.sequences, ref.sequences)
    for i, layer in enumerate(prefill.layers):
        cache.update(layer.keys, layer.values, i)
    dynamic = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=4)
    with attn_implementation(model, "kvfactory"):  # another cache's forward ignores the pending read
        assert torch.equal(generate(model, inputs, DynamicCache(config=model.config),
                                    max_new_tokens=4).sequences, dynamic.sequences)


def test_beam_search_and_lossless_configs_with_kvfactory_attention() -> None:
    model = tiny_model("qwen2")
    inputs = left_padded_batch([25, 19])
    config = QUANTIZED[0]
    with attn_implementation(model, "sdpa"):
        cache = KVCacheFactory(model.config, config).create_cache()
        model.set_attn_implementation("sdpa")  # the quantized layers are read whole
        ref = generate(model, inputs, cache, max_new_tokens=5, num_beams=3, num_return_sequences=2)
    dynamic = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=5)
    with attn_implementation(model, "kvfactory"):
        out = generate(model, inputs, KVCacheFactory(model.config, config).create_cache(), max_new_tokens=5,
                       num_beams=3, num_return_sequences=2)
        lossless = generate(model, inputs, KVCacheFactory(model.config, {"type": "paged", "page_size": 4})
                            .create_cache(), max_new_tokens=5)
    assert_same_generation(ref, out)
    assert_same_generation(dynamic, lossless)


def test_a_compiler_failure_falls_back_to_decoding_in_chunks(monkeypatch) -> None:
    """No C++ toolchain (or any compile error): a warning, then the same attention from decoded runs."""
    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no compiler")
        return call

    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setitem(fused._state, "available", True)
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(torch, "compile", broken)
    store = filled_store("int4", 2, 3, 45)
    query = torch.randn(2, 6, 1, 16, generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="no compiler"):
        got = attention.attend(query, store.deferred_read(), None, 0.25)
    assert not fused.available()
    torch.testing.assert_close(got, sdpa_reference(query, store, None, 0.25), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("chunk", "total"), [(1, 1), (5, 5), (7, 40), (33, 100), (16, 17)])
@pytest.mark.parametrize(("query_heads", "kv_heads"), [(9, 3), (4, 4), (4, 1)])
@pytest.mark.parametrize("path", ["causal_chunk", "_split_chunk", "_biased_chunk"])
def test_causal_chunk_equals_sdpa_with_a_mask_aligned_to_the_end(chunk, total, query_heads, kv_heads,
                                                                  path) -> None:
    """A prefill chunk over stored tokens: the CPU's split (stored tokens, then the chunk causally,
    merged by log-sum-exps), the lower-right causal bias used elsewhere, and the choice between them
    all equal SDPA with an explicit mask."""
    if path == "_split_chunk" and chunk == total:
        pytest.skip("the split needs stored tokens before the chunk")
    gen = torch.Generator().manual_seed(chunk * total)
    query = torch.randn(2, query_heads, chunk, 16, generator=gen)
    key, value = (torch.randn(2, kv_heads, total, 16, generator=gen) for _ in range(2))
    got = getattr(attention, path)(query, key, value, 0.3)
    visible = torch.arange(total)[None, :] <= torch.arange(chunk)[:, None] + (total - chunk)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=0.3,
                                              enable_gqa=True)
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-6, rtol=1e-5)


AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@pytest.mark.skipif(not AVX512 or kernels.load("chunk") is None, reason="the chunk kernel needs AVX-512")
@pytest.mark.parametrize(("chunk", "total"), [(1, 1), (48, 48), (37, 100), (300, 700), (512, 1300)])
@pytest.mark.parametrize(("query_heads", "kv_heads", "dim"),
                         [(9, 3, 64), (4, 1, 256), (2, 2, 128), (50, 1, 64)])
def test_the_chunk_kernel_equals_sdpa_with_a_mask_aligned_to_the_end(chunk, total, query_heads, kv_heads,
                                                                     dim) -> None:
    """The C kernel for a prefill chunk (``chunk.c``): tiles of one to many positions (a group of 50
    heads takes one position a tile), chunks shorter and longer than a tile, past and no past, a
    query laid out as the model hands it (heads transposed from ``[1, chunk, heads, dim]``)."""
    gen = torch.Generator().manual_seed(chunk + total + dim)
    query = torch.randn(1, chunk, query_heads, dim, generator=gen).transpose(1, 2)
    key, value = (torch.randn(1, kv_heads, total, dim, generator=gen) for _ in range(2))
    got = attention._kernel_chunk(query, key, value, dim ** -0.5)
    assert got is not None
    visible = torch.arange(total)[None, :] <= torch.arange(chunk)[:, None] + (total - chunk)
    expected = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=visible,
                                              scale=dim ** -0.5, enable_gqa=True)
    torch.testing.assert_close(got, expected.transpose(1, 2).float(), atol=1e-5, rtol=1e-5)
    whole = attention._biased_chunk(query, key, value, dim ** -0.5)  # a whole sequence: as generate runs it
    chosen = attention.causal_chunk(query, key, value, dim ** -0.5)
    assert torch.equal(chosen, got if chunk < total else whole)


@pytest.mark.parametrize("change", ["dim", "batch", "dtype", "strided"])
def test_the_chunk_kernel_declines_what_it_does_not_take(change) -> None:
    """A head size not a multiple of 64, more than one row, float64, channels not contiguous: None,
    and ``causal_chunk`` answers through SDPA."""
    batch, dim, dtype = (2 if change == "batch" else 1), (48 if change == "dim" else 64), torch.float32
    if change == "dtype":
        dtype = torch.float64
    query = torch.randn(batch, 3, 5, dim, dtype=dtype)
    key, value = (torch.randn(batch, 1, 9, dim, dtype=dtype) for _ in range(2))
    if change == "strided":
        key = torch.randn(batch, 1, 9, 2 * dim)[..., ::2]
    assert attention._kernel_chunk(query, key, value, 0.1) is None
    visible = torch.arange(9)[None, :] <= torch.arange(5)[:, None] + 4
    expected = F.scaled_dot_product_attention(query, key.to(dtype), value, attn_mask=visible, scale=0.1,
                                              enable_gqa=True)
    torch.testing.assert_close(attention.causal_chunk(query, key.to(dtype), value, 0.1),
                               expected.transpose(1, 2))
