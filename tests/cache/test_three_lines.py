"""The user's three lines with models built the plain transformers way (SDPA, no kvfactory call):
kvfactory switches the attention function and hooks the decoder itself, says so once, and refuses
what cannot work with a clear error before any output."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
from configs import BY_ID, CASE_IDS, CASES, Row
from helpers import generate
from tiny_models import TINY_HIDDEN, random_prompt, tiny_config
from transformers import AutoModelForCausalLM, BloomConfig

from kvfactory import ConfigError, KVCacheFactory
from kvfactory import cache as adapter

PAGE = 4
INT4 = BY_ID["int4-paged"].config("small")


def plain_model(name: str = "llama") -> torch.nn.Module:
    """A fresh model as ``from_pretrained`` leaves it: SDPA, no hooks."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(name)).eval()
    assert model.config._attn_implementation == "sdpa"
    return model


def composite(entry: dict) -> dict:
    return {"type": "composite", "strategies": [{"name": "paged", "page_size": PAGE}, entry]}


@pytest.mark.parametrize(("row", "level"), CASES, ids=CASE_IDS)
def test_every_strategy_works_through_the_three_lines(row: Row, level: str, caplog) -> None:
    """A row that needs kvfactory's attention switches a plain SDPA model to it, saying so once; the
    others leave the model alone."""
    model = plain_model()
    factory = KVCacheFactory(model_config=model.config, cache_config=row.config(level))
    with caplog.at_level(logging.WARNING, logger="kvfactory"):
        cache = factory.create_cache()
        factory.create_cache()
    switches = [r for r in caplog.records if "attn_implementation" in r.getMessage()]
    if row.kvfactory_attention:
        assert len(switches) == 1 and "'sdpa' to 'kvfactory'" in switches[0].getMessage()
    else:
        assert not switches
    out = generate(model, {"input_ids": random_prompt(40)}, cache, max_new_tokens=5, min_new_tokens=5)
    assert out.sequences.shape == (1, 45)
    assert cache.get_seq_length() == 44
    assert model.config._attn_implementation == ("kvfactory" if row.kvfactory_attention else "sdpa")
    if cache.routing is not None:  # the selector read each decode step, OVAL from the decoder's state
        assert cache.routing_metrics()["steps"] == 4
        assert cache.routing_context.hidden.shape == (1, TINY_HIDDEN)
    if row.evicts:  # the policy compressed the prompt inside attention
        assert cache.size(0) < 44


def test_the_finder_hook_is_gone_once_no_cache_awaits_its_first_forward() -> None:
    gc.collect()  # caches other tests dropped
    model = plain_model()
    cache = KVCacheFactory(model.config, BY_ID["quest"].config("small")).create_cache()
    assert adapter._finder is not None and cache in adapter._first_forward
    generate(model, {"input_ids": random_prompt(20)}, cache, max_new_tokens=2)
    assert cache not in adapter._first_forward and model.get_decoder()._kvfactory_watched
    plain_model()(random_prompt(4))  # any module call after that checks
    assert (adapter._finder is None) == (len(adapter._first_forward) == 0)


def test_a_cache_built_from_another_config_object_refuses_the_forward() -> None:
    """A config that is not the model's own is switched alone: the model still runs SDPA, which would
    attend over part of the K/V. The forward fails before it returns logits."""
    model = plain_model()
    cache = KVCacheFactory(copy.deepcopy(model.config), INT4).create_cache()
    with pytest.raises(ConfigError, match=r"KVCacheFactory\(model.config"):
        generate(model, {"input_ids": random_prompt(20)}, cache, max_new_tokens=3)
    assert model.config._attn_implementation == "sdpa"


def test_an_architecture_without_attention_dispatch_gets_one_clear_error() -> None:
    config = BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=256)
    policy = composite({"name": "eviction", "policy": "h2o", "budget": 8})
    with pytest.raises(ConfigError, match="BloomForCausalLM") as err:
        KVCacheFactory(config, policy).create_cache()
    assert "'quantization': 'int4'" in str(err.value)
    quantized = KVCacheFactory(config, INT4).create_cache()  # read whole by Bloom's attention
    model = AutoModelForCausalLM.from_config(config).eval()
    generate(model, {"input_ids": random_prompt(20)}, quantized, max_new_tokens=3)
    assert quantized.get_seq_length() == 22 and config._attn_implementation != "kvfactory"
