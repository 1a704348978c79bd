"""Lossless configs on the real embedded model (SmolLM2-135M) and WikiText-2 prompts.

Greedy tokens must equal ``DynamicCache``'s and logits must agree within 1e-5 (fp32); the paged
pool must waste less than one page per sequence per layer.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_generation, generate, kv_slot_bytes
from transformers import DynamicCache

from kvfactory import KVCacheFactory

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
CONFIGS = {
    "dense": {"type": "dense"},
    "paged1": {"type": "paged", "page_size": 1},
    "paged16": {"type": "paged", "page_size": 16},
    "paged256": {"type": "paged", "page_size": 256},
}
BATCH_LENGTHS = [37, 300, 129, 211]  # four prompts of different lengths, left-padded

_references: dict[object, object] = {}


def single_prompt(ids: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    prompt = ids[:length][None]
    return {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}


def padded_batch(ids: torch.Tensor, tokenizer, lengths: list[int]) -> dict[str, torch.Tensor]:
    """Prompts from different places of the text, left-padded the way the tokenizer pads."""
    assert tokenizer.pad_token_id is not None
    texts = [tokenizer.decode(ids[1000 * i:1000 * i + n]) for i, n in enumerate(lengths)]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    lengths_seen = batch["attention_mask"].sum(1)
    assert len(set(lengths_seen.tolist())) == len(lengths)  # really different lengths
    assert (batch["attention_mask"][:, 0] == 0).sum() == len(lengths) - 1  # padded on the left
    return dict(batch)


def reference(model, key, inputs):
    """DynamicCache's generation for ``inputs``, computed once per prompt set."""
    if key not in _references:
        cache = DynamicCache(config=model.config)
        _references[key] = generate(model, inputs, cache, max_new_tokens=NEW_TOKENS)
    return _references[key]


def check_waste(model, cache, page_size: int, rows: int) -> None:
    report = cache.memory_report()
    slot = kv_slot_bytes(model.config)
    layers = model.config.num_hidden_layers
    assert report["used"] == report["tokens_stored"] * slot
    assert 0 <= report["waste"] < page_size * slot * rows * layers, report


# every config at 32 and 1024 tokens; at 4096, dense storage and the default page size (CI's time)
SINGLE = [(length, config) for length in (32, 1024) for config in CONFIGS]
SINGLE += [(4096, "dense"), (4096, "paged16")]


@pytest.mark.parametrize(("length", "config"), SINGLE)
def test_single_prompt_matches_dynamic_cache(smollm2, wikitext_ids, length: int, config: str) -> None:
    model, _ = smollm2
    inputs = single_prompt(wikitext_ids, length)
    ref = reference(model, length, inputs)
    cache = KVCacheFactory(model.config, CONFIGS[config]).create_cache()
    out = generate(model, inputs, cache, max_new_tokens=NEW_TOKENS)
    assert_same_generation(ref, out)
    assert cache.get_seq_length() == length + NEW_TOKENS - 1
    layers = model.config.num_hidden_layers
    assert cache.memory_report()["tokens_stored"] == (length + NEW_TOKENS - 1) * layers
    if config.startswith("paged"):
        check_waste(model, cache, CONFIGS[config]["page_size"], rows=1)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_left_padded_batch_matches_dynamic_cache(smollm2, wikitext_ids, config: str) -> None:
    model, tokenizer = smollm2
    inputs = padded_batch(wikitext_ids, tokenizer, BATCH_LENGTHS)
    ref = reference(model, "batch", inputs)
    cache = KVCacheFactory(model.config, CONFIGS[config]).create_cache()
    out = generate(model, inputs, cache, max_new_tokens=NEW_TOKENS)
    assert_same_generation(ref, out)
    if config.startswith("paged"):
        check_waste(model, cache, CONFIGS[config]["page_size"], rows=len(BATCH_LENGTHS))
