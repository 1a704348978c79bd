"""Two threads generating with two caches of one factory (one pool, one read workspace): their
forwards take turns (``kvfactory.storage.forward_lock``), so each output equals its single-threaded run."""

from __future__ import annotations

import threading

import pytest
from helpers import assert_same_generation, generate
from tiny_models import random_prompt, tiny_model

from kvfactory import KVCacheFactory

CONFIGS = {
    "paged-fixed-pool": {"type": "paged", "page_size": 4, "pool_blocks": 48},
    "paged-int4": {"type": "paged", "page_size": 4, "quantization": {"codec": "int4", "residual": 8}},
    "quest": {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 4}, {"name": "quest", "read_budget": 0.25, "dense_layers": 0}]},
}


def in_two_threads(model, factory: KVCacheFactory, prompts: list[dict], new_tokens: int) -> list:
    outputs: list = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            outputs[i] = generate(model, prompts[i], factory.create_cache(), max_new_tokens=new_tokens)
        except BaseException as err:  # reported by the test
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return outputs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_threads_on_one_pool_equal_their_single_threaded_runs(name: str) -> None:
    model = tiny_model("llama")
    prompts = [{"input_ids": random_prompt(60, seed=s)} for s in (1, 2)]
    alone = [generate(model, p, KVCacheFactory(model.config, CONFIGS[name]).create_cache(), max_new_tokens=12)
             for p in prompts]
    for _ in range(3):
        factory = KVCacheFactory(model.config, CONFIGS[name])
        for ref, out in zip(alone, in_two_threads(model, factory, prompts, 12), strict=True):
            assert_same_generation(ref, out)


def test_a_forward_that_raises_gives_the_pool_back() -> None:
    model = tiny_model("llama")
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": 4, "pool_blocks": 4})
    with pytest.raises(Exception, match="exhausted"):
        generate(model, {"input_ids": random_prompt(40)}, factory.create_cache(), max_new_tokens=2)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (factory.create_cache().clear(), done.set()))
    thread.start()
    thread.join(timeout=30)
    assert done.is_set()  # another thread takes the lock: the failed forward released it


@pytest.mark.slow
def test_two_threads_on_one_pool_with_smollm2(smollm2, wikitext_ids) -> None:
    model, _ = smollm2
    prompts = [{"input_ids": wikitext_ids[None, start:start + 200]} for start in (0, 1000)]
    config = {"type": "paged", "page_size": 16, "pool_tokens": 1024}
    alone = [generate(model, p, KVCacheFactory(model.config, config).create_cache(), max_new_tokens=8)
             for p in prompts]
    for _ in range(3):
        factory = KVCacheFactory(model.config, config)
        for ref, out in zip(alone, in_two_threads(model, factory, prompts, 8), strict=True):
            assert_same_generation(ref, out)
