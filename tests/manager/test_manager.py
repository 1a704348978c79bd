"""KVCacheManager: sequences over one pool, forks, prefix sharing, pause/resume, save/load, errors."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import assert_same_generation, attn_implementation, generate
from tiny_models import random_prompt, tiny_model
from transformers import DynamicCache

from kvfactory import (
    CacheFullError,
    ConfigError,
    KVCacheFactory,
    KVCacheManager,
    SequenceFileError,
    SequenceStateError,
    ShapeError,
    UnknownSequenceError,
    UnsupportedError,
)
from kvfactory.manager import persist

PAGE = 4
PAGED = {"type": "paged", "page_size": PAGE}


def manager_for(model, host_bytes: int | None = None, **options) -> KVCacheManager:
    return KVCacheManager(model.config, PAGED | options, host_bytes=host_bytes)


def reference(model, ids: torch.Tensor, new: int):
    return generate(model, {"input_ids": ids}, DynamicCache(config=model.config), max_new_tokens=new,
                    min_new_tokens=new)


def continued(model, cache, ids: torch.Tensor, new: int):
    return generate(model, {"input_ids": ids}, cache, max_new_tokens=new, min_new_tokens=new)


def test_sequences_are_created_used_and_freed_by_id() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    ids = random_prompt(21)
    cache = manager.create("a")
    assert manager.get("a") is cache and "a" in manager and len(manager) == 1
    assert_same_generation(reference(model, ids, 6), continued(model, cache, ids, 6))
    used = manager.stats()["pool_blocks_used"]
    assert used == -(-(21 + 5) // PAGE)  # 26 tokens stored; a block holds a page of both layers
    manager.free("a")
    assert "a" not in manager and manager.stats()["pool_blocks_used"] == 0
    with manager.sequence("b") as cache:
        continued(model, cache, ids, 2)
    assert len(manager) == 0 and manager.stats()["pool_blocks_used"] == 0


def test_bad_ids_raise_specific_errors_and_change_nothing() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    manager.create("a")
    with pytest.raises(UnknownSequenceError, match="'zz'.*1 held: 'a'") as err:
        manager.free("zz")
    assert isinstance(err.value, KeyError)
    for call in (lambda: manager.get("zz"), lambda: manager.fork("zz", "y"), lambda: manager.pause("zz"),
                 lambda: manager.resume("zz"), lambda: manager.attach_shared_cache("y", "zz")):
        with pytest.raises(UnknownSequenceError):
            call()
    with pytest.raises(SequenceStateError, match="exists already"):
        manager.create("a")
    with pytest.raises(SequenceStateError, match="exists already"):
        manager.fork("a", "a")
    assert manager.sequences() == ["a"]


SPARSE = {"type": "composite", "strategies": [{"name": "paged", "page_size": PAGE},
                                             {"name": "quest", "read_budget": 0.5}]}
EVICTION = {"type": "composite", "strategies": [{"name": "paged", "page_size": PAGE},
                                                {"name": "eviction", "policy": "h2o", "budget": 12}]}


def test_a_manager_needs_paged_storage_and_other_caches_refuse_to_fork() -> None:
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="paged storage"):
        KVCacheManager(model.config, {"type": "dense"})
    assert KVCacheManager(model.config, SPARSE).prefix_caching  # plain pages under a selector share prefixes
    with pytest.raises(ConfigError, match="prefix_caching"):
        KVCacheManager(model.config, EVICTION, prefix_caching=True)
    assert KVCacheManager(model.config, PAGED | {"quantization": "int8"}).prefix_caching  # whole packed pages
    mixed = {"layers": ["int8", "int4"], "residual": 8, "group_size": 8}  # quantized pages of 4 and 8 tokens
    with pytest.raises(ConfigError, match="prefix_caching"):
        KVCacheManager(model.config, PAGED | {"quantization": mixed}, prefix_caching=True)
    with attn_implementation(model, "kvfactory"):
        cache = KVCacheFactory(model.config, SPARSE).create_cache()
        generate(model, {"input_ids": random_prompt(9)}, cache, max_new_tokens=2)
    with pytest.raises(UnsupportedError, match="cannot be forked"):
        cache.fork()


def test_an_evicting_cache_forks_pauses_and_saves_with_its_policy_state(tmp_path: Path) -> None:
    model = tiny_model("llama")
    with attn_implementation(model, "kvfactory"):
        manager = KVCacheManager(model.config, EVICTION)
        assert not manager.prefix_caching
        ids = random_prompt(30)
        cache, uninterrupted = manager.create("a"), manager.create("u")
        first = continued(model, cache, ids, 6).sequences
        continued(model, uninterrupted, ids, 6)
        assert cache.size() <= 12 + PAGE < cache.get_seq_length()  # evicted: H2O's budget of 12 tokens
        twin = manager.fork("a", "b")
        manager.save("a", tmp_path / "a.safetensors")
        manager.pause("a")
        assert manager.stats()["pool_blocks_used"] < 3 * 2 * 5  # evicted tokens gave their blocks back
        manager.resume("a")
        loaded = manager.load(tmp_path / "a.safetensors", "c")
        expected = continued(model, uninterrupted, first, 6)
        for other in (cache, twin, loaded):  # H2O's accumulated scores came along: the same evictions
            assert_same_generation(expected, continued(model, other, first, 6), atol=0.0)
    manager.close()
    assert manager.stats()["pool_blocks_used"] == 0


def test_a_fork_shares_blocks_and_both_continue_as_if_alone() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    ids = random_prompt(22)
    first = reference(model, ids, 4).sequences
    cache = manager.create("a")
    continued(model, cache, ids, 4)
    before = manager.stats()["pool_blocks_used"]
    twin = manager.fork("a", "b")
    assert manager.stats()["pool_blocks_used"] == before  # nothing copied yet
    # the two sides continue differently: each must match an uninterrupted run of its own tokens
    a_ids = torch.cat([first, torch.tensor([[5]])], 1)
    b_ids = torch.cat([first, torch.tensor([[9]])], 1)
    out_b = continued(model, twin, b_ids, 5)
    out_a = continued(model, cache, a_ids, 5)
    assert_same_generation(reference(model, a_ids, 5), out_a)
    assert_same_generation(reference(model, b_ids, 5), out_b)
    assert manager.stats()["pool_blocks_used"] < 2 * before + 2 * 3  # the full prompt blocks stay shared


def test_pause_frees_blocks_and_resume_continues_bit_exactly() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    ids = random_prompt(19)
    cache = manager.create("a")
    first = continued(model, cache, ids, 4).sequences
    uninterrupted = manager.create("u")
    continued(model, uninterrupted, ids, 4)
    stored = [cache.gather(i) for i in range(len(cache.layers))]
    moved = manager.pause("a")
    assert moved == sum(k.nbytes + v.nbytes for k, v in stored) and manager.is_paused("a")
    assert manager.stats()["host_bytes"] == moved
    assert manager.stats()["pool_blocks_used"] == -(-22 // PAGE)  # only the uninterrupted run's
    with pytest.raises(SequenceStateError, match="paused"):
        continued(model, cache, first, 2)
    with pytest.raises(SequenceStateError, match="paused"):
        manager.pause("a")
    assert manager.resume("a") is cache
    with pytest.raises(SequenceStateError, match="not paused"):
        manager.resume("a")
    for i, (k, v) in enumerate(stored):
        got_k, got_v = cache.gather(i)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    expected = continued(model, uninterrupted, first, 6)
    assert_same_generation(expected, continued(model, cache, first, 6), atol=0.0)
    stats = manager.stats()
    assert (stats["bytes_to_host"], stats["bytes_from_host"], stats["host_bytes"]) == (moved, moved, 0)


def test_resume_into_a_full_pool_raises_and_the_sequence_stays_paused() -> None:
    model = tiny_model("llama")
    manager = manager_for(model, pool_blocks=8)
    cache = manager.create("a")
    continued(model, cache, random_prompt(20), 1)  # 5 blocks a layer
    manager.pause("a")
    other = manager.create("b")
    other_ids = random_prompt(16, seed=3)
    continued(model, other, other_ids, 1)  # 4 blocks a layer: 'a' no longer fits
    with pytest.raises(CacheFullError):
        manager.resume("a")
    assert manager.is_paused("a") and cache.get_seq_length() == 0
    manager.free("b")
    manager.resume("a")
    assert cache.get_seq_length() == 20


def test_host_tier_budget_is_enforced() -> None:
    model = tiny_model("llama")
    manager = manager_for(model, host_bytes=1000)
    cache = manager.create("a")
    continued(model, cache, random_prompt(20), 1)
    with pytest.raises(SequenceStateError, match="host tier holds 0 of 1000 bytes"):
        manager.pause("a")
    assert not manager.is_paused("a") and cache.get_seq_length() == 20


def test_save_and_load_round_trip_bit_exactly(tmp_path: Path) -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    ids = random_prompt(18)
    cache = manager.create("a")
    first = continued(model, cache, ids, 3).sequences
    path = tmp_path / "a.safetensors"
    manager.save("a", path)
    other = manager_for(model)
    loaded = other.load(path)
    assert other.sequences() == ["a"] and loaded.get_seq_length() == cache.get_seq_length()
    for i in range(len(cache.layers)):
        assert all(torch.equal(x, y) for x, y in zip(cache.gather(i), loaded.gather(i), strict=True))
    expected = continued(model, cache, first, 5)  # the saved sequence, continued where it is
    assert_same_generation(expected, continued(model, loaded, first, 5), atol=0.0)
    length = cache.get_seq_length()
    manager.pause("a")
    manager.save("a", tmp_path / "paused.safetensors")  # a paused sequence saves from the host tier
    assert other.load(tmp_path / "paused.safetensors", "a2").get_seq_length() == length == 25


def saved_sequence(tmp_path: Path, prompt: int, new: int):
    """A manager holding sequence "a" (``prompt`` tokens, ``new`` generated), saved to a file."""
    model = tiny_model("llama")
    manager = manager_for(model)
    continued(model, manager.create("a"), random_prompt(prompt), new)
    path = tmp_path / "a.safetensors"
    manager.save("a", path)
    return model, manager, path


def test_bad_files_are_refused_with_the_reason(tmp_path: Path) -> None:
    model, manager, path = saved_sequence(tmp_path, 18, 2)
    data = bytearray(path.read_bytes())
    corrupted = tmp_path / "corrupted.safetensors"
    data[-20] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(SequenceFileError, match="checksum"):
        manager.load(corrupted, "x")
    with pytest.raises(SequenceFileError, match="not a readable"):
        manager.load(truncated, "x")
    with pytest.raises(SequenceFileError, match="no such file"):
        manager.load(tmp_path / "missing", "x")
    with pytest.raises(SequenceFileError, match="another model"):
        KVCacheManager(tiny_model("qwen2").config, PAGED).load(path, "x")
    with pytest.raises(SequenceFileError, match="cache config"):
        KVCacheManager(model.config, {"type": "paged", "page_size": 8}).load(path, "x")
    with pytest.raises(SequenceStateError, match="exists already"):
        manager.load(path)
    assert manager.sequences() == ["a"] and "x" not in manager


def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch) -> None:
    model, manager, path = saved_sequence(tmp_path, 10, 1)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(persist, "save_file", crash)
    with pytest.raises(SequenceFileError) as exc:
        manager.save("a", path)
    assert str(exc.value) == f"{path}: cannot be written (disk full)"
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_prompts_reuse_cached_prefix_blocks_and_generate_as_if_alone() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    system = random_prompt(13, seed=1)
    prompts = [torch.cat([system, random_prompt(6, seed=s)], 1) for s in (2, 3, 4)]
    outputs = []
    for i, ids in enumerate(prompts):
        cache = manager.create(f"s{i}", prompt=ids[0])
        outputs.append(continued(model, cache, ids, 4))
    assert [manager.cached_tokens(f"s{i}") for i in range(3)] == [0, 12, 12]  # 3 whole blocks of 13 tokens
    for ids, out in zip(prompts, outputs, strict=True):
        ref = reference(model, ids, 4)
        assert torch.equal(ref.sequences, out.sequences)
        assert_same_generation(ref, out, atol=1e-5)
    stats = manager.stats()
    assert stats["prefix_hit_blocks"] == 6 and stats["prompt_tokens_cached"] == 24
    prompt_blocks = -(-(19 + 3) // PAGE)
    assert stats["pool_blocks_used"] == 3 * prompt_blocks - 2 * 3  # the shared blocks once


def test_freed_prompt_blocks_stay_cached_until_the_pool_needs_them() -> None:
    model = tiny_model("llama")
    manager = manager_for(model, pool_blocks=12)
    system = random_prompt(17, seed=1)
    continued(model, manager.create("a", prompt=system[0]), system, 1)
    manager.free("a")
    stats = manager.stats()
    assert stats["prefix_cached_blocks"] == 4 and stats["pool_blocks_used"] == 4
    again = manager.create("b", prompt=system[0])
    assert manager.cached_tokens("b") == 16
    manager.free("b")
    assert manager.pin_prefix(system[0]) == 4
    with pytest.raises(CacheFullError):  # 8 free blocks a layer: the pinned 4 are not given up
        continued(model, manager.create("c"), random_prompt(40, seed=5), 1)
    manager.free("c")
    manager.close()
    assert manager.stats()["pool_blocks_used"] == 0 and not manager.pool.reclaimers  # the pool forgets it
    unpinned = manager_for(model, pool_blocks=12)
    continued(model, unpinned.create("a", prompt=system[0]), system, 1)
    unpinned.free("a")
    continued(model, unpinned.create("c"), random_prompt(40, seed=5), 1)  # reclaims the cached blocks
    assert unpinned.stats()["prefix_evicted_blocks"] >= 2 and again.get_seq_length() == 0


def test_a_prefix_cache_that_never_hits_warns_once() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    with pytest.warns(UserWarning, match="none of 8 prompts reused a cached block"):
        for i in range(9):
            manager.create(str(i), prompt=random_prompt(12, seed=i)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager.create("again", prompt=random_prompt(12, seed=20)[0])


def test_explicitly_shared_prefixes_attach_to_new_sequences() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    system = random_prompt(14, seed=1)
    source = manager.create("system")
    continued(model, source, system, 1)
    manager.mark_as_shareable("system", 0, 14)
    manager.free("system")  # the shared prefix keeps its blocks
    ids = torch.cat([system, random_prompt(5, seed=7)], 1)
    cache = manager.attach_shared_cache("user", "system")
    assert cache.get_seq_length() == 14 and manager.cached_tokens("user") == 14
    assert_same_generation(reference(model, ids, 4), continued(model, cache, ids, 4), atol=1e-5)
    with pytest.raises(SequenceStateError, match=r"\[0, end\)"):
        manager.mark_as_shareable("user", 2, 10)
    manager.close()
    assert manager.stats()["pool_blocks_used"] == 0


def test_exhausting_the_pool_writes_nothing_and_freeing_makes_room() -> None:
    model = tiny_model("llama")
    manager = manager_for(model, pool_blocks=10)
    continued(model, manager.create("a"), random_prompt(24), 1)  # 6 blocks a layer
    b = manager.create("b")
    with pytest.raises(CacheFullError, match="need 6 free blocks"):
        continued(model, b, random_prompt(24, seed=2), 1)
    assert b.get_seq_length() == 0 and manager.stats()["pool_blocks_used"] == 6
    manager.free("a")
    continued(model, b, random_prompt(24, seed=2), 1)
    assert b.get_seq_length() == 24


def test_a_prefetched_sequence_resumes_from_its_staged_copy() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    ids = random_prompt(15)
    cache, uninterrupted = manager.create("a"), manager.create("u")
    first = continued(model, cache, ids, 3).sequences
    continued(model, uninterrupted, ids, 3)
    with pytest.raises(SequenceStateError, match="not paused"):
        manager.prefetch("a")
    manager.pause("a")
    manager.prefetch("a")
    manager.prefetch("a")  # once is enough: the second call reuses the first
    assert manager.stats()["prefetches"] == 1
    manager.resume("a")
    stats = manager.stats()
    assert stats["resumes"] == 1 and 0 <= stats["prefetch_stalls"] <= 1
    expected = continued(model, uninterrupted, first, 4)
    assert_same_generation(expected, continued(model, cache, first, 4), atol=0.0)
    manager.close()


@pytest.mark.parametrize("options", [{"num_beams": 3}, {"do_sample": True, "num_return_sequences": 3}],
                         ids=["beams", "samples"])
def test_beams_and_samples_share_the_prompts_blocks(options: dict) -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    ids = random_prompt(32)
    cache = manager.create("a")
    out = generate(model, {"input_ids": ids}, cache, seed=0, max_new_tokens=3, min_new_tokens=3, **options)
    alone = generate(model, {"input_ids": ids}, DynamicCache(config=model.config), seed=0, max_new_tokens=3,
                     min_new_tokens=3, **options)
    assert torch.equal(out.sequences, alone.sequences)
    # 3 rows of 34 stored tokens: the 8 full prompt blocks once, each row's last 2 blocks of its own
    assert manager.stats()["pool_blocks_used"] <= 8 + 3 * 2


def test_a_partial_swap_moves_the_oldest_pages_and_comes_back_bit_exactly(tmp_path: Path) -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    ids = random_prompt(27)
    cache, uninterrupted = manager.create("a"), manager.create("u")
    first = continued(model, cache, ids, 4).sequences  # 30 tokens stored: 8 blocks a layer
    continued(model, uninterrupted, ids, 4)
    stored = [cache.gather(i) for i in range(len(cache.layers))]
    used = manager.stats()["pool_blocks_used"]
    moved = manager.pause("a", blocks=3)
    assert moved == sum(k[:, :, :12].nbytes + v[:, :, :12].nbytes for k, v in stored)
    assert manager.stats()["pool_blocks_used"] == used - 3 and cache.size() == 18
    with pytest.raises(SequenceStateError, match="paused"):
        continued(model, cache, first, 1)
    manager.save("a", tmp_path / "a.safetensors")  # host pages and pool pages together
    manager.resume("a")
    for i, (k, v) in enumerate(stored):
        assert all(torch.equal(x, y) for x, y in zip(cache.gather(i), (k, v), strict=True))
    loaded = manager.load(tmp_path / "a.safetensors", "b")
    assert all(torch.equal(x, y) for x, y in zip(loaded.gather(1), stored[1], strict=True))
    expected = continued(model, uninterrupted, first, 5)
    assert_same_generation(expected, continued(model, cache, first, 5), atol=0.0)
    with pytest.raises(SequenceStateError, match="whole plain pages"):
        manager.pause("a", blocks=0)


def test_swap_out_pauses_the_least_recently_used_sequences_first() -> None:
    model = tiny_model("llama")
    manager = manager_for(model, pool_blocks=24)
    for name, seed in (("old", 1), ("mid", 2), ("new", 3)):
        continued(model, manager.create(name), random_prompt(23, seed=seed), 1)  # 6 blocks a layer each
    manager.get("old")  # handed out again: now the most recently used
    assert manager.stats()["pool_blocks_free"] == 6
    assert manager.swap_out(9, keep=["new"]) == {"mid": 3}
    assert manager.is_paused("mid") and not manager.is_paused("old")
    assert manager.swap_out(14, keep=["new"]) == {"old": 5}
    with pytest.raises(CacheFullError):
        manager.swap_out(24, keep=["new"])
    assert manager.get("old").size() == 3 and manager.get("new").size() == 23  # 23 - 5 pages of 4
    manager.close()
    assert manager.stats()["pool_blocks_used"] == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("quantization", [{"codec": "int8", "residual": 8},
                                          {"codec": "int4", "residual": 8, "group_size": 8}])
def test_quantized_pages_share_cached_prefixes_and_generate_as_if_computed(arch: str, quantization) -> None:
    """A prompt adopts a cached prefix's whole quantized pages (codes are shared, the full-precision window
    is computed again), so it generates exactly what computing the prompt does; a hybrid model's
    sliding layers adopt from token 0 and give their past back after the prompt."""
    model = tiny_model(arch)
    config = PAGED | {"quantization": quantization}
    manager = KVCacheManager(model.config, config)
    assert manager.prefix_caching
    unit = manager.layout.block_tokens  # a packed page: the page, or KIVI's 8-token groups
    assert manager.layout.kind == "packed" and unit == max(PAGE, quantization.get("group_size", 1))
    system = random_prompt(42, seed=1)
    prompts = [torch.cat([system, random_prompt(12, seed=s)], 1) for s in (2, 3, 4)]
    prompts[2] = prompts[2][:, :46]  # 4 tokens after the system prompt: the window leaves 38 to share
    outputs = [generate(model, {"input_ids": ids}, manager.create(f"s{i}", prompt=ids[0]), max_new_tokens=6)
               for i, ids in enumerate(prompts)]
    cached = [manager.cached_tokens(f"s{i}") for i in range(3)]
    assert cached == [0, 42 // unit * unit, (46 - 8) // unit * unit]
    assert manager.stats()["pool_blocks_used"] > 0
    for i in (1, 2):
        alone = KVCacheFactory(model.config, config).create_cache()  # the same prompt, computed whole
        expected = generate(model, {"input_ids": prompts[i]}, alone, max_new_tokens=6)
        assert_same_generation(expected, outputs[i])
    manager.close()
    assert manager.stats()["pool_blocks_used"] == 0


def test_a_prefix_hit_on_kivi_pages_adopts_the_window_seen_where_an_earlier_prompt_ended() -> None:
    """A system prompt computed first leaves its last ``residual`` tokens in full-precision window pages;
    a prompt starting with it adopts its quantized pages and those window pages, computes only its own
    tokens, and generates exactly what computing it in two chunks split there does (quantized prefill
    depends on where chunks end: a chunk's tokens are encoded before it attends). A prompt ending
    inside those tokens finds no window and computes the window again, as computing it whole does."""
    model = tiny_model("llama")
    quantization = {"codec": "int4", "residual": 8, "group_size": 8}
    config = PAGED | {"quantization": quantization}
    manager = KVCacheManager(model.config, config)
    assert manager.layout.window == 8 and manager.layout.block_tokens == 8
    system = random_prompt(48, seed=1)
    first = torch.cat([system, random_prompt(1, seed=2)], 1)  # its write ends with the window [40, 49)
    generate(model, {"input_ids": first}, manager.create("system", prompt=first[0]), max_new_tokens=2)
    assert manager.stats()["prefix_window_blocks"] >= 1
    prompts = [torch.cat([system, random_prompt(12, seed=3)], 1), torch.cat([system[:, :44],
                                                                           random_prompt(9, seed=4)], 1)]
    outputs = [generate(model, {"input_ids": ids}, manager.create(f"s{i}", prompt=ids[0]), max_new_tokens=6)
               for i, ids in enumerate(prompts)]
    assert [manager.cached_tokens(f"s{i}") for i in range(2)] == [48, 40]  # 40: quantized pages alone
    store = manager.get("s0").layers[0].store
    assert store.quantized_tokens >= 48 and store.size() == 48 + 12 + 5
    for ids, out, split in zip(prompts, outputs, (48, 0), strict=True):
        alone = KVCacheFactory(model.config, config).create_cache()
        if split:
            with torch.no_grad():
                model(input_ids=ids[:, :split], past_key_values=alone)
        assert_same_generation(generate(model, {"input_ids": ids}, alone, max_new_tokens=6), out)
    manager.close()
    assert manager.stats()["pool_blocks_used"] == 0


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_quantized_pages_fork_pause_and_save_packed(codec: str, tmp_path: Path) -> None:
    model = tiny_model("llama")
    options = {"quantization": {"codec": codec, "residual": 8, "group_size": 8} if codec == "int4" else codec}
    manager = manager_for(model, **options)
    ids = random_prompt(40)
    cache, uninterrupted = manager.create("a"), manager.create("u")
    first = continued(model, cache, ids, 3).sequences
    continued(model, uninterrupted, ids, 3)
    assert cache.layers[0].store.quantized_tokens > 0  # packed pages exist
    twin = manager.fork("a", "b")
    path = tmp_path / "a.safetensors"
    manager.save("a", path)
    saved = persist.load_state(path, model.config, manager.factory.config.raw)[0]
    assert any(name.startswith("packed.") and t.dtype != torch.float32 for name, t in saved.layers[0].items())
    moved = manager.pause("a")
    assert moved == saved.nbytes < sum(k.nbytes + v.nbytes for k, v in (twin.gather(i) for i in range(2)))
    manager.resume("a")
    with pytest.raises(SequenceStateError, match="whole plain pages"):  # no partial swap of packed pages
        manager.pause("a", blocks=1)
    loaded = manager.load(path, "c")
    expected = continued(model, uninterrupted, first, 4)
    for other in (cache, twin, loaded):  # resumed, forked and loaded: all continue bit-exactly
        assert_same_generation(expected, continued(model, other, first, 4), atol=0.0)
    manager.close()
    assert manager.stats()["pool_blocks_used"] == 0


def test_blocks_are_cached_under_the_tokens_written_not_the_prompt_declared() -> None:
    """``create("a", prompt=X)`` then generating from Y: Y's blocks are cached as Y's, never as X's."""
    model = tiny_model("llama")
    manager = manager_for(model)
    declared, written = random_prompt(17, seed=1), random_prompt(17, seed=2)
    continued(model, manager.create("a", prompt=declared[0]), written, 2)
    manager.free("a")
    b = manager.create("b", prompt=declared[0])
    assert manager.cached_tokens("b") == 0
    assert_same_generation(reference(model, declared, 3), continued(model, b, declared, 3))
    c = manager.create("c", prompt=written[0])
    assert manager.cached_tokens("c") == 16
    assert_same_generation(reference(model, written, 3), continued(model, c, written, 3))


def test_a_sliding_window_offers_a_prompt_from_the_blocks_of_its_last_window() -> None:
    model = tiny_model("mistral-sw8")  # window 8 < prompt: whole 4-token pages leave the window
    manager = manager_for(model)
    prompt = random_prompt(21, seed=3)
    a = manager.create("a", prompt=prompt[0])
    continued(model, a, prompt, 3)
    assert all(layer.store.block_ids() is None for layer in a.layers)  # no longer from token 0
    b = manager.create("b", prompt=prompt[0])
    assert manager.cached_tokens("b") == 20 and manager.stats()["prefix_cached_blocks"] == 5
    assert all(layer.store.size() == 7 for layer in b.layers)  # its window, from the cached blocks
    assert_same_generation(reference(model, prompt, 3), continued(model, b, prompt, 3))


def test_appends_without_token_ids_leave_a_sequence_out_of_the_prefix_cache() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    prompt = random_prompt(13, seed=4)
    cache = manager.create("a", prompt=prompt[0])
    config = model.config
    shape = (1, config.num_key_value_heads, 12, config.hidden_size // config.num_attention_heads)
    for layer in range(len(cache.layers)):
        cache.append(layer, torch.randn(shape), torch.randn(shape))
    assert cache.written_tokens() is None
    manager.free("a")
    assert manager.stats()["prefix_cached_blocks"] == 0


def test_every_low_level_write_checks_its_layer_and_the_sequence_state() -> None:
    model = tiny_model("llama")
    manager = manager_for(model, pool_blocks=6)
    config = model.config
    shape = (1, config.num_key_value_heads, 5, config.hidden_size // config.num_attention_heads)
    cache = manager.create("a")
    for layer in range(len(cache.layers)):
        cache.append(layer, torch.randn(shape), torch.randn(shape))
    manager.pause("a")
    for layer in range(len(cache.layers)):  # not only layer 0: a paused cache takes no write at all
        with pytest.raises(SequenceStateError, match="paused"):
            cache.append(layer, torch.randn(shape), torch.randn(shape))
    manager.resume("a")
    for bad in (-1, len(cache.layers), 1.0):
        with pytest.raises(ShapeError, match=f"layer {bad} is out of range: this cache has 2 layers"):
            cache.append(bad, torch.randn(shape), torch.randn(shape))
    big = (*shape[:2], 6 * PAGE, shape[3])
    with pytest.raises(CacheFullError):  # layer 1's own pool is checked before it writes
        cache.append(1, torch.randn(big), torch.randn(big))
    assert [cache.size(i) for i in range(len(cache.layers))] == [5, 5]
    assert_same_generation(*(continued(model, c, random_prompt(9), 2) for c in (
        manager.create("b"), KVCacheFactory(model.config, PAGED).create_cache())))


def test_the_pool_layout_comes_from_the_model_not_from_the_first_writer() -> None:
    model = tiny_model("llama")
    factory = KVCacheFactory(model.config, PAGED)
    config = model.config
    heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    cache = factory.create_cache()
    narrow = torch.randn(1, heads, 5, 8)
    with pytest.raises(ShapeError, match="head_dim=16"):  # the model's shape, on every layer
        cache.append(1, narrow, narrow)
    assert factory.pool.pools == {} and cache.size(1) == 0
    half = torch.randn(1, heads, 5, head_dim, dtype=torch.float16)
    for layer in range(len(cache.layers)):
        cache.append(layer, half, half)
    cache.free()  # the fp16 blocks are all free again: the model's fp32 writes take the pool back
    ids = random_prompt(11)
    assert_same_generation(reference(model, ids, 3), continued(model, factory.create_cache(), ids, 3))
    with pytest.raises(ConfigError, match="head_dim=16"):  # one pool, one model layout
        KVCacheFactory(tiny_model("llama", hidden_size=128).config, PAGED, pool=factory.pool)


def rewrite_metadata(path: Path, edit, redigest: bool) -> None:
    """Edit a saved file's metadata in place, as a hand edit would (``redigest``: and forge its digest)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(str(path), framework="pt") as file:
        meta = json.loads(file.metadata()["kvfactory"])
    edit(meta)
    if redigest:
        meta["digest"] = persist._meta_digest(meta)
    save_file(load_file(str(path)), str(path), metadata={"kvfactory": json.dumps(meta)})


@pytest.mark.parametrize(("edit", "match"), [
    (lambda m: m.update(seen=[1000, 1000]), "stores 20 tokens but has seen 1000"),
    (lambda m: m.update(seen=[0, 0]), "stores 20 tokens but has seen 0"),
    (lambda m: m.update(seen=[-5, -5]), "token counts >= 0"),
    (lambda m: m.update(seen=[20]), "token counts >= 0"),
    (lambda m: m.update(seen="20"), "expected a list"),
    (lambda m: m.pop("fingerprint"), "expected a dict"),
    (lambda m: m.update(checksums=None), "expected a dict"),
    (lambda m: m.update(seq_id=7), "expected a str"),
    (lambda m: m["fingerprint"].update(kv_heads=1), "another model"),
])
def test_saved_metadata_is_covered_by_the_digest_and_checked_field_by_field(tmp_path: Path, edit,
                                                                           match: str) -> None:
    model, manager, path = saved_sequence(tmp_path, 18, 3)
    rewrite_metadata(path, edit, redigest=False)
    with pytest.raises(SequenceFileError, match="digest"):
        manager.load(path, "x")
    rewrite_metadata(path, lambda m: None, redigest=True)  # a forged digest: the fields themselves
    with pytest.raises(SequenceFileError, match=match):
        manager.load(path, "x")
    assert manager.sequences() == ["a"]


def test_a_file_of_another_dtype_is_refused_and_the_pool_keeps_its_own(tmp_path: Path) -> None:
    model, manager, path = saved_sequence(tmp_path, 10, 2)
    half = tiny_model("llama").config.__class__.from_dict(model.config.to_dict() | {"dtype": "bfloat16"})
    with pytest.raises(SequenceFileError, match="dtype float32, this manager's are torch.bfloat16"):
        KVCacheManager(half, PAGED).load(path)
    manager.free("a")
    other = manager_for(model)
    kept = other.create("b")
    shape = (1, model.config.num_key_value_heads, 4, 16)
    for layer in range(2):
        kept.append(layer, torch.randn(shape, dtype=torch.float16), torch.randn(shape, dtype=torch.float16))
    with pytest.raises(SequenceFileError, match="dtype float32, this manager's are torch.float16"):
        other.load(path)


def test_saves_and_loads_name_a_directory_or_an_unwritable_path(tmp_path: Path) -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    continued(model, manager.create("a"), random_prompt(10), 1)
    with pytest.raises(SequenceFileError, match="is a directory; give the path of a file to write"):
        manager.save("a", tmp_path)
    with pytest.raises(SequenceFileError, match="is a directory; give the path of a saved sequence file"):
        manager.load(tmp_path, "b")
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    target = blocker / "folder" / "a.safetensors"  # a folder that cannot be made: its parent is a file
    with pytest.raises(SequenceFileError) as exc:
        manager.save("a", target)
    assert str(exc.value) == f"{target}: cannot be written ([Errno 20] Not a directory: '{target.parent}')"
    assert sorted(tmp_path.iterdir()) == [blocker] and manager.sequences() == ["a"]


def test_saves_and_loads_remove_only_temporaries_of_writers_that_no_longer_run(tmp_path: Path) -> None:
    model, manager, path = saved_sequence(tmp_path, 10, 1)
    finished = subprocess.Popen([sys.executable, "-c", ""])
    finished.wait()  # its pid names no process now
    stale = tmp_path / f".a.safetensors.{finished.pid}.k2x9_q1z.tmp"
    kept = [tmp_path / f".a.safetensors.{os.getpid()}.a1b2c3d4.tmp",  # a running writer's (this process)
            tmp_path / f".b.safetensors.{finished.pid}.a1b2c3d4.tmp",  # another file's
            tmp_path / f".a.safetensors.5.{finished.pid}.a1b2c3d4.tmp",  # a file named a.safetensors.5's
            tmp_path / ".a.safetensors.notes"]  # no temporary's name
    for name in (stale, *kept):
        name.write_bytes(b"half a save")
    manager.load(path, "b")
    assert sorted(tmp_path.iterdir()) == sorted([path, *kept])
    stale.write_bytes(b"half a save")
    manager.save("a", path)
    assert sorted(tmp_path.iterdir()) == sorted([path, *kept])
