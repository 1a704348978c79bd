"""Retraining OVAL's query scorer on drift: samples from shadow steps, a bounded fine-tune in the
background, and a swap that every selector of the router file sees while decoding goes on."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from helpers import attn_implementation, generate, tiny_router
from tiny_models import random_prompt, tiny_model

from kvfactory import KVCacheFactory
from kvfactory.selectors.oval import load_router
from kvfactory.selectors.oval.drift import DriftRetrainer


def config(router: str) -> dict:
    return {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 4},
        {"name": "oval", "router": router, "read_budget": 0.25, "dense_layers": 0, "shadow_every": 1}]}


@pytest.fixture
def router(tmp_path) -> str:
    """A query scorer file of the tiny models' shape, of this test's own (its slot is not shared)."""
    path = tmp_path / "router.safetensors"
    shutil.copy(tiny_router(64, 2, 16, (0, 1)), path)
    return str(path)


def test_the_alert_retrains_in_the_background_and_the_swap_reaches_every_cache(router: str) -> None:
    model = tiny_model("llama")
    original = load_router(router)
    retrainer = DriftRetrainer(router, threshold=1.0, duration_s=0.0, window=1, samples=32, steps=20)
    with attn_implementation(model, "kvfactory"):
        cache = KVCacheFactory(model.config, config(router)).create_cache()
        retrainer.attach(cache)
        out = generate(model, {"input_ids": random_prompt(48)}, cache, max_new_tokens=24, min_new_tokens=24)
        retrainer.wait(timeout=60)
        assert all(torch.isfinite(step).all() for step in out.logits)
        assert len(retrainer.history) == 1  # fired once: it re-arms only when the hit rate recovers
        record = retrainer.history[0]
        assert record["samples"] >= 1 and record["steps"] == 20 and record["hit_rate"] < 1.0
        tuned = load_router(router)
        assert tuned is not original and not torch.equal(tuned.query, original.query)
        # the key side is frozen: codes already stored stay what the new scorer would write
        assert torch.equal(tuned.key, original.key) and torch.equal(tuned.code_scale, original.code_scale)
        other = KVCacheFactory(model.config, config(router)).create_cache()
        generate(model, {"input_ids": random_prompt(30, seed=2)}, other, max_new_tokens=3, min_new_tokens=3)
        stores = [layer.store for layer in other.layers]
        assert all(store.selector.loaded_router is tuned for store in stores)


def test_retraining_fits_its_samples_and_swaps_under_concurrent_decoding(router: str) -> None:
    model = tiny_model("llama")
    retrainer = DriftRetrainer(router, threshold=0.0, samples=64, steps=60, lr=1e-2)  # the alert never fires
    with attn_implementation(model, "kvfactory"):
        cache = KVCacheFactory(model.config, config(router)).create_cache()
        retrainer.attach(cache)
        generate(model, {"input_ids": random_prompt(48)}, cache, max_new_tokens=12, min_new_tokens=12)
        assert retrainer.history == [] and len(retrainer.samples) == 2 * 11  # 2 layers, 11 decode steps
        record = retrainer.retrain()
        assert record["loss_after"] < record["loss_before"]
        errors, done = [], threading.Event()

        def decode() -> None:
            try:
                for seed in range(4):
                    fresh = KVCacheFactory(model.config, config(router)).create_cache()
                    out = generate(model, {"input_ids": random_prompt(40, seed=seed)}, fresh,
                                   max_new_tokens=10, min_new_tokens=10)
                    assert all(torch.isfinite(step).all() for step in out.logits)
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=decode)
        thread.start()
        swaps = 0
        while not done.is_set():
            retrainer.retrain()
            swaps += 1
        thread.join()
    assert not errors, errors
    assert swaps >= 1 and len(retrainer.history) == 1 + swaps


def test_only_a_query_scorer_is_retrained(tmp_path) -> None:
    with pytest.raises(ValueError, match="prefetch router"):
        DriftRetrainer(tiny_router(64, 2, 16, (0, 1), "prefetch"))
    with pytest.raises(ValueError, match="steps"):
        DriftRetrainer(tiny_router(64, 2, 16, (0, 1)), steps=0)


def test_an_engine_feeds_every_request_to_the_retrainer(router: str) -> None:
    """Attached to an engine, the retrainer watches each request's cache from its admission: the
    alert fires on their shadow samples and the retrained scorer serves the requests after it."""
    from kvfactory.engine import Engine, SamplingParams

    model = tiny_model("llama")
    original = load_router(router)
    engine = Engine(model, None, config(router), pool_tokens=512)
    retrainer = DriftRetrainer(router, threshold=1.0, duration_s=0.0, window=1, samples=32, steps=5)
    retrainer.attach(engine)
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (30, 41, 25)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    retrainer.wait(timeout=60)
    assert [len(o.token_ids) for o in outputs] == [8, 8, 8]
    assert len(retrainer.history) == 1 and load_router(router) is not original
    layers = {sample.layer for sample in retrainer.samples}
    assert layers == {0, 1} and len(retrainer.samples) > 2 * 7  # shadow steps of more than one request
    later = engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(later[0].token_ids) == 4 and engine.stats()["sequences"] == 0


def test_an_engine_over_another_selector_is_refused(router: str) -> None:
    from kvfactory.engine import Engine

    model = tiny_model("llama")
    quest = {"type": "composite", "strategies": [{"name": "paged", "page_size": 4}, {"name": "quest"}]}
    with pytest.raises(ValueError, match="'quest'"):
        DriftRetrainer(router).attach(Engine(model, None, quest, pool_tokens=512))
