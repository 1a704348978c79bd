"""Eviction and sparse reads in one config (RocketKV's two stages): eviction compresses the prompt,
then each decode step reads a fraction of the pages of what it kept."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_generation, generate
from tiny_models import random_prompt, tiny_model

from kvfactory import ConfigError, KVCacheFactory

SNAPKV = {"name": "eviction", "policy": "snapkv", "window_size": 4, "compression_ratio": 0.5}


def config(*entries: dict) -> dict:
    return {"type": "composite", "strategies": [{"name": "paged", "page_size": 4}, *entries]}


def quest(read_budget: float) -> dict:
    return {"name": "quest", "dense_layers": 0, "read_budget": read_budget}


def test_a_selector_reading_every_page_leaves_eviction_exact() -> None:
    """Quest with the whole budget over SnapKV gives SnapKV's own tokens and logits: the eviction
    stage sees the same attention calls and keeps the same tokens under the selector."""
    model = tiny_model("llama")
    inputs = {"input_ids": random_prompt(48), "attention_mask": torch.ones(1, 48, dtype=torch.long)}
    alone = generate(model, inputs, KVCacheFactory(model.config, config(SNAPKV)).create_cache(),
                     max_new_tokens=10)
    both = generate(model, inputs, KVCacheFactory(model.config, config(SNAPKV, quest(1.0))).create_cache(),
                    max_new_tokens=10)
    assert_same_generation(alone, both)


def test_decode_reads_a_fraction_of_the_kept_pages() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(64)
    evicting = KVCacheFactory(model.config, config(SNAPKV)).create_cache()
    composed = KVCacheFactory(model.config, config(SNAPKV, quest(0.25))).create_cache()
    with torch.no_grad():
        model(prompt, cache=evicting)
        model(prompt, cache=composed)
    for plain, layer in zip(evicting.layers, composed.layers, strict=True):
        store = layer.store
        assert store.size() == plain.store.size() == 32  # half the prompt kept
        assert torch.equal(store.gather()[0], plain.store.gather()[0])
        assert store.summaries.pages == 32 // 4  # summaries rebuilt over the kept keys
    out = model.generate(prompt, cache=composed, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == 64 + 12
    metrics = composed.routing_metrics()
    assert metrics["steps"] == 11 and metrics["read_fraction"] < 0.6, metrics
    assert composed.memory_report()["tokens_stored"] < 64 * 2 * 2  # fewer tokens than seen, every layer


def test_a_decode_budget_under_a_selector_is_refused() -> None:
    model = tiny_model("llama")
    budget = {"name": "eviction", "policy": "h2o", "budget": 32}
    with pytest.raises(ConfigError, match="eviction.budget.*compression_ratio instead"):
        KVCacheFactory(model.config, config(budget, quest(0.25)))


def test_the_preset_name_joins_both_stages() -> None:
    from kvfactory.presets import load_preset

    assert load_preset("snapkv@0.5+quest@0.125")["strategies"][1:] == [
        {"name": "eviction", "policy": "snapkv", "compression_ratio": 0.5},
        {"name": "quest", "read_budget": 0.125}]
    with pytest.raises(ConfigError, match="eviction.budget=1024"):
        load_preset("streaming_llm@1024+quest@0.125")


def test_the_engine_gives_each_sequence_its_own_caches_tokens() -> None:
    """Prefilled in one step each, sequences batched by the engine keep and read what their own cache
    keeps and reads alone."""
    from kvfactory.engine import Engine, SamplingParams

    model = tiny_model("llama")
    composed = config(SNAPKV, quest(0.5))
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (30, 45, 38)]
    engine = Engine(model, None, composed, pool_tokens=1024, max_num_batched_tokens=256)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        cache = KVCacheFactory(model.config, composed).create_cache()
        alone = model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=8, do_sample=False)
        assert output.token_ids == alone[0, len(prompt):].tolist()
    assert engine.stats()["sequences"] == 0
