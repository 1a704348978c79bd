"""Quantized storage: configs, the residual window, packed bytes, edits and generation (no trained model)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import apply_edit, generate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import random_prompt, tiny_config, tiny_model
from transformers import DynamicCache

from kvfactory import CacheFullError, ConfigError, DenseStore, KVCacheFactory, PagedStore
from kvfactory.codecs import make_codec
from kvfactory.codecs.spec import QuantizationSpec
from kvfactory.quantization.store import QuantizedStore
from kvfactory.storage.workspace import ReadWorkspace

B, H, D = 2, 3, 64
CODECS = ["int8", "int4", "int2", "fp8", "fp8_e5m2"]


def kv(tokens: int, batch: int = B, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, H, tokens, D, generator=gen), torch.randn(batch, H, tokens, D, generator=gen)


def store(codec: str, residual: int = 8, inner: str = "dense", group_size: int = 4,
          page_size: int = 4, **pool: int) -> QuantizedStore:
    spec = QuantizationSpec(codec=codec, residual=residual, group_size=group_size)
    codecs = spec.codecs(0, 1)
    # storage built for the window, as kvfactory.compose builds it
    unit = math.lcm(codecs[0].unit, codecs[1].unit)
    window = PagedStore(page_size=page_size, kind="window")
    base = DenseStore(reserve_tokens=unit) if inner == "dense" else window
    built = QuantizedStore(base, *codecs, residual, ReadWorkspace())
    built.bind(0)
    if inner == "paged":
        built.attach(PagedStore.make_shared({"page_size": page_size, **pool}, 1))
    return built


def expected(codec: str, keys: torch.Tensor, values: torch.Tensor, quantized: int, group_size: int = 4):
    """What a store must return: the first ``quantized`` tokens through the codecs, the rest exact."""
    opts = {"group_size": group_size} if codec in ("int4", "int2") else {}
    kc, vc = make_codec(codec, "key", **opts), make_codec(codec, "value", **opts)
    ek = kc.decode(kc.encode(keys[:, :, :quantized])) if quantized else keys[:, :, :0]
    ev = vc.decode(vc.encode(values[:, :, :quantized])) if quantized else values[:, :, :0]
    return torch.cat([ek, keys[:, :, quantized:]], 2), torch.cat([ev, values[:, :, quantized:]], 2)


# -- configs --------------------------------------------------------------------------------------

def test_config_forms_build_quantized_stores() -> None:
    config = tiny_config("llama")
    forms = [{"type": "paged", "page_size": 16, "quantization": "int4"},
             {"type": "dense", "quantization": {"codec": "int2", "group_size": 16, "residual": 32}},
             {"type": "composite", "strategies": [{"name": "paged", "page_size": 16},
                                                  {"name": "quantized", "bits": 4}]}]
    for form in forms:
        cache = KVCacheFactory(config, form).create_cache()
        stores = [layer.store for layer in cache.layers]
        assert all(isinstance(s, QuantizedStore) for s in stores), form
    spec = KVCacheFactory(config, forms[1]).config.quantization
    assert (spec.codec, spec.group_size, spec.residual) == ("int2", 16, 32)
    assert KVCacheFactory(config, forms[2]).config.quantization.codec == "int4"


def test_residual_defaults_follow_kivi() -> None:
    assert QuantizationSpec("int4").residual_for("int4") == 128
    assert QuantizationSpec("int8").residual_for("int8") == 0
    assert QuantizationSpec("int4", residual=0).residual_for("int4") == 0


def test_per_layer_precision() -> None:
    config = tiny_config("llama", num_hidden_layers=6)
    cache = KVCacheFactory(config, {"type": "dense", "quantization": {
        "codec": "int4", "full_precision_first": 2, "full_precision_last": 1}}).create_cache()
    kinds = [type(layer.store).__name__ for layer in cache.layers]
    assert kinds == ["DenseStore"] * 2 + ["QuantizedStore"] * 3 + ["DenseStore"]
    cache = KVCacheFactory(config, {"type": "dense", "quantization": {
        "layers": ["none", "int8", "int4", "int2", "fp8", "none"]}}).create_cache()
    names = [getattr(layer.store, "key_codec", None) for layer in cache.layers]
    assert [n.name if n else None for n in names] == [None, "int8", "int4", "int2", "fp8", None]
    with pytest.raises(ConfigError, match="one codec per layer: 6 names"):
        KVCacheFactory(config, {"type": "dense", "quantization": {"layers": ["int8"] * 5}}).create_cache()


@pytest.mark.parametrize(("config", "key"), [
    ({"type": "dense", "quantization": "int3"}, "quantization"),
    ({"type": "dense", "quantization": {"codec": "int4", "group_size": 0}}, "group_size"),
    ({"type": "dense", "quantization": {"codec": "int4", "residual": -1}}, "residual"),
    ({"type": "dense", "quantization": {"codec": "int4", "colour": 1}}, "colour"),
    ({"type": "dense", "quantization": 4}, "quantization"),
    ({"type": "composite", "strategies": [{"name": "dense"}, {"name": "quantized", "bits": 3}]},
     "strategies[1].bits"),
    ({"type": "composite", "strategies": [{"name": "quantized", "bits": 4}]}, "strategies"),
    ({"type": "composite", "strategies": [{"name": "dense"}, {"name": "quantized"}, {"name": "quantized"}]},
     "strategies[2].name"),
    ({"type": "dense", "quantization": {"codec": "int4", "layers": ["int4"], "full_precision_first": 1}},
     "layers"),
])
def test_bad_quantization_configs(config: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVCacheFactory(tiny_config("llama"), config)
    assert info.value.key == key


@pytest.mark.parametrize(("options", "key", "allowed"), [
    ({"full_precision_first": 6}, "full_precision_first", "fewer than the model's 6 layers"),
    ({"full_precision_last": 9}, "full_precision_last", "fewer than the model's 6 layers"),
    ({"full_precision_first": 3, "full_precision_last": 3}, "full_precision_first",
     "at most 2 with full_precision_last=3"),
])
def test_full_precision_layers_leave_at_least_one_layer_quantized(options: dict, key: str,
                                                                  allowed: str) -> None:
    config = tiny_config("llama", num_hidden_layers=6)
    with pytest.raises(ConfigError) as info:
        KVCacheFactory(config, {"type": "paged", "quantization": {"codec": "int4", **options}})
    assert (info.value.key, info.value.value) == (key, options[key]) and allowed in str(info.value)
    cache = KVCacheFactory(config, {"type": "dense", "quantization": {
        "codec": "int4", "full_precision_first": 3, "full_precision_last": 2}}).create_cache()
    assert [type(layer.store).__name__ for layer in cache.layers].count("QuantizedStore") == 1


# -- the store ------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("inner", ["dense", "paged"])
def test_window_keeps_recent_tokens_exact_and_encodes_whole_units(codec: str, inner: str) -> None:
    s = store(codec, residual=8, inner=inner)
    keys, values = kv(0)
    for step, n in enumerate([13, 1, 1, 5, 2, 9]):
        k, v = kv(n, seed=step + 1)
        s.append(k, v)
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        total = keys.shape[2]
        quantized = max(0, (total - 8) // s.unit * s.unit)
        assert s.size() == total and s.quantized_tokens == quantized
        assert 8 <= s.inner.size() < 8 + s.unit or total < 8 + s.unit
        got_k, got_v = s.gather()
        want_k, want_v = expected(codec, keys, values, quantized)
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)
        torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-6)
        assert torch.equal(got_k[:, :, quantized:], keys[:, :, quantized:])  # the window is exact


def test_a_decode_flush_gives_the_encoded_pages_back_and_leaves_the_window_in_place() -> None:
    s = store("int4", residual=8, inner="paged", page_size=4)  # units of 4 tokens: one page each
    s.append(*kv(11, batch=1))  # 8 + 3 held: no whole unit beyond the window yet
    window = s.inner._table
    before, pool = window.ids.clone(), window.blocks.pool
    s.append(*kv(1, batch=1, seed=1))  # 12 held: the oldest unit is encoded
    assert s.quantized_tokens == 4 and s.inner.size() == 8
    assert torch.equal(window.ids, before[:, 1:])  # the kept tokens stay in their pages, not rewritten
    assert pool.refcount[int(before[0, 0])] == 0  # the encoded unit's page went back


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("inner", ["dense", "paged"])
def test_packed_bytes_are_real(codec: str, inner: str) -> None:
    s = store(codec, residual=0, group_size=32, inner=inner, page_size=16)
    s.append(*kv(4096))
    report = s.memory_report()
    codec_bytes = sum(make_codec(codec, r).bytes_per_token(H, D) for r in ("key", "value"))
    assert report.used == pytest.approx(B * 4096 * codec_bytes, rel=0.01)
    assert report.allocated < 1.02 * report.used + 2 * D * H * B * 4 * s.unit  # headroom of under a unit
    fp16 = B * 4096 * 2 * H * D * 2
    assert report.allocated / fp16 < (0.53 if codec == "int8" else 0.30)


@pytest.mark.parametrize(("codec", "bound"), [("int8", 1e-4), ("fp8", 2e-3), ("int4", 0.02), ("int2", 0.3)])
def test_quantization_error_is_sampled_from_what_was_stored(codec: str, bound: float) -> None:
    s = store(codec, residual=0, group_size=32)
    assert all(v != v for v in s.quantization_error().values())  # NaN before anything was encoded
    keys, values = kv(64)
    s.append(keys, values)  # one flush of 64 tokens: sampled whole
    error = s.quantization_error()
    for role, x in (("key", keys), ("value", values)):
        c = make_codec(codec, role)
        exact = (c.decode(c.encode(x)).double() - x.double()).square().sum() / x.double().square().sum()
        assert error[role] == pytest.approx(exact.item(), rel=1e-9) and 0 < error[role] < bound
    cache = KVCacheFactory(tiny_config("llama"), {"type": "dense", "quantization": {
        "codec": codec, "full_precision_first": 1}}).create_cache()
    assert list(cache.quantization_error()) == [1]  # layer 0 stays in full precision


def test_select_rows_and_clear() -> None:
    s = store("int4", residual=4)
    keys, values = kv(23, batch=3)
    s.append(keys, values)
    before_k, before_v = (t.clone() for t in s.gather())
    s.select_rows(torch.tensor([2, 0]))
    got_k, got_v = s.gather()
    assert torch.equal(got_k, before_k[[2, 0]]) and torch.equal(got_v, before_v[[2, 0]])
    assert s.batch_size == 2
    s.clear()
    assert s.size() == 0 and s.memory_report().allocated == 0


_EDITS = st.lists(st.one_of(st.tuples(st.just("append"), st.integers(1, 12)),
                            st.tuples(st.just("drop_front"), st.integers(0, 9)),
                            st.tuples(st.just("truncate"), st.integers(0, 40)),
                            st.tuples(st.just("keep"), st.integers(0, 2 ** 16 - 1)),
                            st.tuples(st.just("keep_heads"), st.integers(0, 2 ** 16 - 1))),
                  min_size=1, max_size=12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_EDITS, codec=st.sampled_from(["int8", "int4"]), inner=st.sampled_from(["dense", "paged"]))
def test_edits_match_edits_of_the_decoded_tensors(ops, codec: str, inner: str) -> None:
    """Evicting from quantized data re-encodes what stays; the result equals the edit applied to what
    the store returned before, within the codec's own round-trip error."""
    s = store(codec, residual=4, inner=inner, page_size=8)
    s.append(*kv(6))
    for step, (op, arg) in enumerate(ops):
        ref_k, ref_v = (t.clone() for t in s.gather())
        ref_k, ref_v = apply_edit(s, op, arg, ref_k, ref_v,
                                  lambda t, rows, i=step: kv(t, batch=rows, seed=i + 1))
        assert s.size() == ref_k.shape[2]
        if s.size():
            got_k, got_v = s.gather()
            scale = max(ref_k.abs().max().item(), ref_v.abs().max().item())
            bound = scale * (1 / 127 if codec == "int8" else 1 / 7)
            assert (got_k - ref_k).abs().max() <= bound and (got_v - ref_v).abs().max() <= bound


# -- quantized pages ------------------------------------------------------------------------------

def test_paged_quantization_keeps_packed_bytes_in_pool_blocks() -> None:
    s = store("int4", residual=8, inner="paged", group_size=32, page_size=16)
    keys, values = kv(200)
    s.append(keys, values)
    pool = s.inner.pool
    packed, window = pool.pools[("packed", (0,))], pool.pools[("window", (0,))]
    assert packed.page_size == 32  # lcm of the 16-token page and KIVI's 32-token key groups
    codes = packed.layer(0).tensors["k.codes"]
    assert codes.dtype == torch.uint8 and codes.shape[-1] == D // 2
    used = packed.num_blocks - len(packed.free)
    assert used == B * 192 // 32 and s.quantized_tokens == 192
    assert window.num_blocks - len(window.free) == B * 1  # the 8 exact tokens: one 16-token page per row
    assert pool.memory_report().used == s.memory_report().allocated  # the blocks this store holds
    want_k, want_v = expected("int4", keys, values, 192, group_size=32)
    got_k, got_v = s.gather()
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-6)
    s.clear()
    assert len(packed.free) == packed.num_blocks and len(window.free) == window.num_blocks


def test_quantized_pages_are_bounded_by_the_pool_and_fail_before_writing() -> None:
    config = tiny_config("llama", hidden_size=H * D, num_attention_heads=H, num_key_value_heads=H)
    factory = KVCacheFactory(config, {"type": "paged", "page_size": 16, "pool_tokens": 256,
                                      "quantization": {"codec": "int4", "residual": 32}})
    cache = factory.create_cache()
    key, value = kv(224, batch=1)
    for layer in range(len(cache.layers)):
        cache.append(layer, key, value)
    before = cache.memory_report()
    with pytest.raises(CacheFullError) as info:
        cache.append(0, *kv(96, batch=1, seed=3))  # 320 tokens: 288 to encode, 9 blocks of 32; 8 exist
    assert (info.value.needed_blocks, info.value.page_size) == (3, 32)
    assert cache.memory_report() == before and cache.size(0) == 224


def test_forked_rows_share_quantized_pages_and_copy_on_write() -> None:
    s = store("int4", residual=0, inner="paged", group_size=8, page_size=32)
    keys, values = kv(40, batch=1)
    s.append(keys, values)  # 40 tokens encoded: one full 32-token page and one partial page
    s.select_rows(torch.tensor([0, 0]))
    packed = s.inner.pool.pools[("packed", (0,))]
    assert packed.num_blocks - len(packed.free) == 2  # both rows share both pages
    k2, v2 = kv(8, batch=2, seed=5)
    s.append(k2, v2)  # writes into the shared partial page: each row gets its own copy first
    assert packed.num_blocks - len(packed.free) == 3
    want_k, want_v = expected("int4", torch.cat([keys.expand(2, -1, -1, -1), k2], 2),
                              torch.cat([values.expand(2, -1, -1, -1), v2], 2), 48, group_size=8)
    got_k, got_v = s.gather()
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-6)


# -- generation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_generation_stays_close_to_dynamic_cache(codec: str) -> None:
    model = tiny_model("llama")
    inputs = {"input_ids": random_prompt(40)}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    ref = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=6)
    cache = KVCacheFactory(model.config, {"type": "dense", "quantization": codec}).create_cache()
    out = generate(model, inputs, cache, max_new_tokens=6)
    first = (ref.logits[0] - out.logits[0]).abs().max().item()
    assert 0 < first < 0.05  # lossy, but close
    assert cache.memory_report()["workspace"] > 0


@pytest.mark.parametrize("codec", ["int4", "int8"])
@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_a_forward_outside_no_grad_works_as_under_it(codec: str, storage: str) -> None:
    """Codes are not differentiable; a plain ``model(...)`` call (grad mode) stores and reads them all
    the same (it used to fail decoding into the workspace)."""
    model = tiny_model("llama")
    config = {"type": storage, "quantization": {"codec": codec, "residual": 8, "group_size": 8}}
    if storage == "paged":
        config["page_size"] = 4
    logits = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            cache = KVCacheFactory(model.config, config).create_cache()
            model(random_prompt(40), past_key_values=cache)
            logits.append(model(random_prompt(1, seed=1), past_key_values=cache).logits.detach())
    # the same codes are read; compiled int8 kernels may be specialised apart in the two modes
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
