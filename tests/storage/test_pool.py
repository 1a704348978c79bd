"""The paged pool under generation: exhaustion (``CacheFullError``), reuse after free, waste."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import FirstLastRetain, assert_same_generation, generate, kv_slot_bytes, layer_sizes
from tiny_models import (
    GEMMA3_LAYERS,
    TINY_IDS,
    left_padded_batch,
    random_prompt,
    tiny_config,
    tiny_model,
)
from transformers import AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList

from kvfactory import CacheFullError, KVCacheFactory, PagedStore, register_cache_strategy

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # tiny llama


def kv(tokens: int, batch: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=gen),
            torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=gen))


def free_blocks(factory) -> dict[int, int]:
    return factory.pool.free_blocks()


def state(cache) -> tuple:
    """Everything a failed step must leave unchanged."""
    return layer_sizes(cache), cache.get_seq_length(), cache.memory_report()


class Snapshots(LogitsProcessor):
    """Records the cache state after every successful generation step."""

    def __init__(self, cache) -> None:
        self.cache, self.states = cache, []

    def __call__(self, input_ids, scores):
        self.states.append(state(self.cache))
        return scores


# -- exhaustion through the low-level API -------------------------------------------------------

def test_exhaustion_message_and_no_partial_write() -> None:
    factory = KVCacheFactory(tiny_config("llama"), {"type": "paged", "page_size": 4, "pool_tokens": 64})
    cache = factory.create_cache()
    for layer in range(LAYERS):
        cache.append(layer, *kv(20, seed=layer))  # 5 of 16 blocks per layer
    before = state(cache)
    with pytest.raises(CacheFullError) as exc:
        cache.append(0, *kv(60, seed=7))  # needs 15 blocks, 11 are free
    err = exc.value
    assert (err.needed_blocks, err.free_blocks, err.total_blocks) == (15, 11, 16)
    for number in ("15", "11", "16"):
        assert number in str(err), str(err)
    assert state(cache) == before
    assert free_blocks(factory) == {0: 11, 1: 11}


def test_exhaustion_on_first_write_of_a_fresh_pool() -> None:
    factory = KVCacheFactory(tiny_config("llama"), {"type": "paged", "page_size": 16, "pool_tokens": 64})
    cache = factory.create_cache()
    with pytest.raises(CacheFullError) as exc:
        cache.append(0, *kv(65))
    assert "5" in str(exc.value) and "4" in str(exc.value)
    assert layer_sizes(cache) == [0, 0] and cache.memory_report()["allocated"] == 0
    cache.append(0, *kv(64))  # exactly the pool
    assert layer_sizes(cache) == [64, 0]


# -- exhaustion through model.generate ------------------------------------------------------------

def test_exhaustion_in_generate_then_free_and_reuse() -> None:
    model = tiny_model("llama")
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": 16, "pool_tokens": 64})
    cache = factory.create_cache()
    snapshots = Snapshots(cache)
    prompt = random_prompt(40)
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    with pytest.raises(CacheFullError) as exc:
        generate(model, inputs, cache, max_new_tokens=40, logits_processor=LogitsProcessorList([snapshots]))
    err = exc.value
    assert (err.needed_blocks, err.free_blocks, err.total_blocks, err.page_size) == (1, 0, 4, 16)
    # the step that would write token 65 failed as a whole: the state is the one after the last good step
    assert snapshots.states[-1][0] == [64] * LAYERS
    assert state(cache) == snapshots.states[-1]
    assert free_blocks(factory) == {0: 0, 1: 0}

    # another cache of the same factory cannot get blocks while this one holds them ...
    other = factory.create_cache()
    with pytest.raises(CacheFullError):
        generate(model, {"input_ids": prompt[:, :8], "attention_mask": torch.ones(1, 8, dtype=torch.long)},
                 other)
    assert layer_sizes(other) == [0] * LAYERS

    # ... and both are usable again once the blocks are given back
    cache.free()
    assert free_blocks(factory) == {0: 4, 1: 4}
    ref = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=8)
    assert_same_generation(ref, generate(model, inputs, other, max_new_tokens=8))
    other.free()
    assert_same_generation(ref, generate(model, inputs, cache, max_new_tokens=8))


def _mixed_window_model():
    """Layer 0 slides over 4 tokens, layer 1 attends to everything: the layers' pools fill unevenly."""
    cfg = tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1,
                      layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_exhaustion_of_a_batched_prefill_writes_nothing() -> None:
    """A batch of 2 prompts needs twice the blocks of one; the check before layer 0 writes must know."""
    model = _mixed_window_model()
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": 4, "pool_tokens": 64})
    assert factory.windows == [4, None]
    first = factory.create_cache()
    generate(model, {"input_ids": random_prompt(40), "attention_mask": torch.ones(1, 40, dtype=torch.long)},
             first, max_new_tokens=2)
    # the sliding layer kept 1 block, the full layer 11: a 12-token batch of 2 needs 6 blocks per layer
    assert free_blocks(factory) == {0: 14, 1: 5}
    cache = factory.create_cache()
    pool_before = factory.pool.memory_report()
    with pytest.raises(CacheFullError):
        with torch.no_grad():
            model(torch.randint(3, 256, (2, 12)), past_key_values=cache)
    assert layer_sizes(cache) == [0, 0], "a layer was written before the pool ran out"
    assert cache.get_seq_length() == 0
    assert factory.pool.memory_report() == pool_before


@dataclass(eq=False)
class PagedFirstLast(FirstLastRetain, PagedStore):
    """An eviction policy over paged storage: keep the first 4 and the last 8 stored tokens."""


register_cache_strategy("test_paged_first_last", PagedFirstLast)


@pytest.mark.parametrize("pool_blocks", [4, 6])
def test_eviction_on_a_tight_pool_never_leaves_a_partial_step(pool_blocks: int) -> None:
    """A policy keeping 12 tokens (3 blocks of 4) per layer: whether or not the pool has room for
    its compaction, a step is written in every layer or in none (the contract of CacheFullError)."""
    model = tiny_model("llama")
    factory = KVCacheFactory(model.config, {"type": "test_paged_first_last", "page_size": 4,
                                            "pool_blocks": pool_blocks})
    cache = factory.create_cache()
    prompt = random_prompt(12)
    try:
        generate(model, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, cache,
                 max_new_tokens=10)
    except CacheFullError:
        pass
    seen = [layer.get_seq_length() for layer in cache.layers]
    assert len(set(seen)) == 1, f"layers saw different numbers of tokens: {seen}"
    sizes = layer_sizes(cache)
    assert len(set(sizes)) == 1, f"layers store different numbers of tokens: {sizes}"


# -- waste ---------------------------------------------------------------------------------------

NO_WINDOW = [name for name in TINY_IDS if name not in ("mistral-sw8", "gemma3")]


@pytest.mark.parametrize("page_size", [4, 16, 256])
@pytest.mark.parametrize("arch", NO_WINDOW)
def test_paged_waste_under_one_page_per_row_and_layer(arch: str, page_size: int) -> None:
    model = tiny_model(arch)
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": page_size})
    cache = factory.create_cache()
    inputs = left_padded_batch([23, 9, 17], seed=4)
    generate(model, inputs, cache, max_new_tokens=6)
    rows, layers, slot = 3, len(cache.layers), kv_slot_bytes(model.config)
    report = cache.memory_report()
    assert report["tokens_stored"] == rows * layers * (23 + 6 - 1)
    assert report["used"] == report["tokens_stored"] * slot
    assert report["waste"] == report["allocated"] - report["used"]
    assert 0 <= report["waste"] < page_size * slot * rows * layers
    assert report["allocated"] % (page_size * slot) == 0  # whole blocks
    assert factory.pool.memory_report().used == report["allocated"]  # the pool agrees
    assert report["bytes_per_token"] == report["allocated"] / (rows * (23 + 6 - 1))


def test_dense_memory_report() -> None:
    model = tiny_model("llama")
    cache = KVCacheFactory(model.config, {"type": "dense", "growth": 1.0, "reserve_tokens": 0}).create_cache()
    generate(model, left_padded_batch([12, 5]), cache, max_new_tokens=4)
    report = cache.memory_report()
    slot = kv_slot_bytes(model.config)
    assert report["used"] == 2 * LAYERS * 15 * slot
    assert report["allocated"] >= report["used"]


# -- caches created under inference_mode stay usable outside it --------------------------------

@pytest.mark.parametrize("cache_config", [{"type": "dense"}, {"type": "paged", "page_size": 4}],
                         ids=["dense", "paged4"])
def test_cache_filled_in_inference_mode_continues_under_no_grad(cache_config) -> None:
    model = tiny_model("llama")
    prompt = random_prompt(10, seed=8)
    steps = random_prompt(6, seed=9)
    cache = KVCacheFactory(model.config, cache_config).create_cache()
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(prompt, past_key_values=cache)
    with torch.no_grad():
        model(prompt, past_key_values=ref)
        for i in range(steps.shape[1]):
            token = steps[:, i:i + 1]
            got = model(token, past_key_values=cache).logits
            want = model(token, past_key_values=ref).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        cache.layers[0].batch_repeat_interleave(2)  # reorder/expand outside inference_mode too
    assert cache.get_seq_length() == 16 and cache.layers[0].store.batch_size == 2


def test_blocks_come_back_when_a_cache_is_collected_during_fake_tensor_tracing() -> None:
    """torch.compile traces under a fake-tensor mode; a block table's finalizer run by the garbage
    collector then must still give its blocks back (it once refused the real ids and kept them)."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensorMode

    store = PagedStore(page_size=4)
    pool = store.ensure_pool()
    store.append(*kv(9))
    (block_pool,) = pool.pools.values()
    assert int((block_pool.refcount > 0).sum()) == 3
    with FakeTensorMode():
        del store
        gc.collect()
    assert int((block_pool.refcount > 0).sum()) == 0


# -- one block table per sequence and layer group ------------------------------------------------



def test_the_layers_of_a_group_share_one_block_table_and_each_block_is_allocated_once() -> None:
    """Gemma 3's layout: the full-attention layers share one block table per sequence, the sliding
    layers another; a block is allocated, refcounted and asked for once per group, and generation is
    unchanged."""
    torch.manual_seed(0)  # sliding, full, sliding, full
    config = tiny_config("gemma3", num_hidden_layers=4, layer_types=list(GEMMA3_LAYERS * 2))
    model = AutoModelForCausalLM.from_config(config).eval()
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": 4})
    assert factory.groups == [(0, 2), (1, 3)]
    cache, prompt = factory.create_cache(), random_prompt(10)
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    out = generate(model, inputs, cache, max_new_tokens=5)
    assert_same_generation(generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=5), out)
    sliding, full = factory.pool.block_pools()
    assert (sliding.layers, full.layers) == ((0, 2), (1, 3))
    stored = 10 + 4  # generate feeds the last token back without storing its successor
    assert full.num_blocks - len(full.free) == -(-stored // 4)
    assert set(full.refcount[full.refcount > 0]) == {1}
    for group in factory.groups:  # one table: the same blocks, the same tensor
        first, second = (cache.layers[layer].store.held_blocks() for layer in group)
        assert first is second
    key, value = torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16)
    requests = cache.block_requests(4, key, value)  # 14 stored, 4 more: a block per group
    assert [(spec.layers, blocks) for spec, blocks in requests] == [((0, 2), 1), ((1, 3), 1)]


def test_quantized_layers_share_one_table_per_group_for_their_pages_and_windows() -> None:
    """KIVI pages: the layers of one window size and codec encode the same tokens at the same steps, so
    their quantized pages and the full-precision windows in front of them each take one block table per
    group, every block allocated once; generation equals the same codecs over dense storage."""
    torch.manual_seed(0)
    config = tiny_config("gemma3", num_hidden_layers=4, layer_types=list(GEMMA3_LAYERS * 2))
    model = AutoModelForCausalLM.from_config(config).eval()
    quantization = {"codec": "int4", "group_size": 8, "residual": 4}
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": 4, "quantization": quantization})
    assert factory.groups == [(0, 2), (1, 3)]
    cache, prompt = factory.create_cache(), random_prompt(30)
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    out = generate(model, inputs, cache, max_new_tokens=12)
    dense = KVCacheFactory(model.config, {"type": "dense", "quantization": quantization}).create_cache()
    assert_same_generation(generate(model, inputs, dense, max_new_tokens=12), out)
    for group in factory.groups:
        first, second = (cache.layers[layer].store for layer in group)
        assert first.inner.held_blocks() is second.inner.held_blocks()  # one window table
    first, second = cache.layers[1].store, cache.layers[3].store  # full attention: quantized pages too
    assert first.quantized_tokens == second.quantized_tokens == 32
    assert first.runs.table.ids is second.runs.table.ids and first.runs.table.ids.shape == (1, 4)
    for kind in ("packed", "window"):
        pools = factory.pool.block_pools(kind)
        assert [pool.layers for pool in pools] == [(0, 2), (1, 3)]
        assert all(set(pool.refcount[pool.refcount > 0]) <= {1} for pool in pools)  # allocated once
    packed = factory.pool.pools[("packed", (1, 3))]
    assert int((packed.refcount > 0).sum()) == 4  # 32 tokens in 8-token groups, in both layers
    requests = cache.block_requests(16, *(torch.zeros(1, 1, 1, 16),) * 2)  # two groups more: asked once
    packed_groups = [spec.layers for spec, n in requests if spec.kind == "packed" and n]
    assert (1, 3) in packed_groups and sorted(set(packed_groups)) == sorted(packed_groups)


def test_a_fork_copies_a_shared_block_once_per_group_on_write() -> None:
    model = tiny_model("llama")
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": 4})
    cache = factory.create_cache()
    with torch.no_grad():
        model(input_ids=random_prompt(10), past_key_values=cache, use_cache=True)
    (pool_of,) = factory.pool.block_pools()
    assert pool_of.num_blocks - len(pool_of.free) == 3
    twin = cache.fork()
    assert twin.layers[0].store.held_blocks() is twin.layers[1].store.held_blocks()
    with torch.no_grad():
        model(input_ids=random_prompt(1, seed=1), past_key_values=twin, use_cache=True)
        assert pool_of.num_blocks - len(pool_of.free) == 4  # the third block, copied once for both layers
        expected = DynamicCache(config=model.config)
        model(input_ids=torch.cat([random_prompt(10), random_prompt(1, seed=1)], 1), past_key_values=expected)
    for layer in range(2):
        torch.testing.assert_close(twin.gather(layer)[0], expected.layers[layer].keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(cache.gather(layer)[0], expected.layers[layer].keys[:, :, :10],
                                   atol=1e-6, rtol=0)


def test_layers_that_evict_keep_their_own_blocks() -> None:
    """Eviction keeps different tokens in each layer: no layer shares a block table."""
    model = tiny_model("llama")
    factory = KVCacheFactory(model.config, {"type": "test_paged_first_last", "page_size": 4})
    assert factory.groups == [(0,), (1,)]
