"""Cross-cutting sequence tests over the shared matrix (``configs.py``): fork, pause/resume and
save/load through ``KVCacheManager``, and several sequences over one pool. Each continuation must
equal an uninterrupted run of the same row on the same tokens; a row that does not support an
operation must raise the exception it states. Each case runs on every tiny model of ``MATRIX_ARCHS``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from configs import CASE_IDS, CASES, FORK, MANAGER, MATRIX_ARCHS, PAUSE, SAVE, Row
from helpers import assert_same_generation, generate
from tiny_models import random_prompt, tiny_model

from kvfactory import KVCacheFactory, KVCacheManager

PROMPT, NEW = 24, 4
cases = pytest.mark.parametrize(("row", "level"), CASES, ids=CASE_IDS)
archs = pytest.mark.parametrize("arch", MATRIX_ARCHS)


def continued(arch: str, cache, ids: torch.Tensor, new: int = NEW):
    return generate(tiny_model(arch), {"input_ids": ids}, cache, max_new_tokens=new, min_new_tokens=new)


def uninterrupted(row: Row, level: str, arch: str, *turns: torch.Tensor):
    """A fresh cache of the row fed ``turns`` one ``generate`` call each; the last call's output."""
    cache = KVCacheFactory(tiny_model(arch).config, row.config(level, arch)).create_cache()
    for ids in turns:
        out = continued(arch, cache, ids)
    return out


def managed(row: Row, level: str, arch: str) -> KVCacheManager | None:
    """A manager for the row, or None after checking that the row refuses one as it states."""
    config = tiny_model(arch).config
    if row.refuses(MANAGER, lambda: KVCacheManager(config, row.config(level, arch))):
        return None
    return KVCacheManager(config, row.config(level, arch))


@archs
@cases
def test_fork(row: Row, level: str, arch: str) -> None:
    """Both sides of a fork continue differently, each as an uninterrupted run of its own tokens."""
    cache = KVCacheFactory(tiny_model(arch).config, row.config(level, arch)).create_cache()
    ids = random_prompt(PROMPT)
    first = continued(arch, cache, ids).sequences
    if row.refuses(FORK, cache.fork):
        return
    twin = cache.fork()
    assert twin.get_seq_length() == cache.get_seq_length()
    assert twin.memory_report().keys() == cache.memory_report().keys()  # the same reports, peaks included
    assert twin.memory_report().get("peak_allocated") == cache.memory_report().get("peak_allocated")
    a_ids, b_ids = (torch.cat([first, torch.tensor([[token]])], 1) for token in (5, 9))
    out_b = continued(arch, twin, b_ids)
    out_a = continued(arch, cache, a_ids)
    assert_same_generation(uninterrupted(row, level, arch, ids, a_ids), out_a)
    assert_same_generation(uninterrupted(row, level, arch, ids, b_ids), out_b)


@archs
@cases
def test_pause_and_resume(row: Row, level: str, arch: str) -> None:
    """A pause gives the sequence's blocks back; resume restores them bit-exactly and it continues
    as the run that was never paused."""
    manager = managed(row, level, arch)
    if manager is None:
        return
    ids = random_prompt(PROMPT)
    cache, other = manager.create("a"), manager.create("u")
    first = continued(arch, cache, ids).sequences
    continued(arch, other, ids)
    stored = [cache.gather(i) for i in range(len(cache.layers))]
    used = manager.stats()["pool_blocks_used"]
    if row.refuses(PAUSE, lambda: manager.pause("a")):
        assert manager.stats()["pool_blocks_used"] == used and not manager.is_paused("a")
        return
    assert manager.pause("a") > 0
    assert manager.stats()["pool_blocks_used"] < used
    assert manager.resume("a") is cache
    for i, (keys, values) in enumerate(stored):
        got_keys, got_values = cache.gather(i)
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values), f"layer {i}"
    assert_same_generation(continued(arch, other, first), continued(arch, cache, first))
    manager.close()
    assert manager.stats()["pool_blocks_used"] == 0


@archs
@cases
def test_save_and_load(row: Row, level: str, arch: str, tmp_path: Path) -> None:
    """A sequence saved by one manager and loaded by another continues as the original does."""
    manager = managed(row, level, arch)
    if manager is None:
        return
    ids = random_prompt(PROMPT)
    cache = manager.create("a")
    first = continued(arch, cache, ids).sequences
    if row.refuses(SAVE, lambda: manager.save("a", tmp_path / "a.safetensors")):
        assert not (tmp_path / "a.safetensors").exists()
        return
    manager.save("a", tmp_path / "a.safetensors")
    elsewhere = KVCacheManager(tiny_model(arch).config, row.config(level, arch))
    loaded = elsewhere.load(tmp_path / "a.safetensors", "b")
    assert loaded.get_seq_length() == cache.get_seq_length()
    assert_same_generation(continued(arch, cache, first), continued(arch, loaded, first))


def greedy_steps(arch: str, cache, ids: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    """The last-position logits of a prefill and of ``steps`` greedy decode steps, one at a time (each
    forward in its own ``no_grad``: a generator suspended inside one would leak it to the caller)."""
    logits = None
    for _ in range(steps + 1):
        step = ids if logits is None else logits.argmax(-1, keepdim=True)
        with torch.no_grad():
            logits = tiny_model(arch)(step, past_key_values=cache).logits[:, -1]
        yield logits


@archs
@cases
def test_several_sequences_over_one_pool(row: Row, level: str, arch: str) -> None:
    """Three sequences decoding in turns over one pool each equal the row's cache alone; freeing
    them gives every block back."""
    manager = managed(row, level, arch)
    if manager is None:
        return
    prompts = [random_prompt(n, seed=seed) for seed, n in enumerate((PROMPT, 17, 9))]
    caches = [manager.create(f"s{i}") for i in range(len(prompts))]
    steps = (greedy_steps(arch, c, p, 5) for c, p in zip(caches, prompts, strict=True))
    together = list(zip(*steps, strict=True))
    assert manager.stats()["sequences"] == 3 and manager.stats()["pool_blocks_used"] > 0
    for i, ids in enumerate(prompts):
        alone = KVCacheFactory(tiny_model(arch).config, row.config(level, arch)).create_cache()
        for step, logits in enumerate(greedy_steps(arch, alone, ids, 5)):
            torch.testing.assert_close(together[step][i], logits, atol=1e-5, rtol=0)
    for i in range(len(prompts)):
        manager.free(f"s{i}")
    assert manager.stats()["pool_blocks_used"] == 0
