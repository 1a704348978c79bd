"""Eviction on the embedded model: what a policy keeps decides what the model can still answer."""

from __future__ import annotations

import pytest
import torch

from kvfactory import KVCacheFactory
from kvfactory.eval.data import passkey_prompts

pytestmark = pytest.mark.slow


def answer(model, tokenizer, prompt: str, config: dict | None) -> tuple[str, object]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    cache = KVCacheFactory(model.config, config or {"type": "dense"}).create_cache()
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:]), cache


def evicting(policy: str, **options) -> dict:
    return {"type": "composite", "strategies": [{"name": "paged", "page_size": 16},
                                                {"name": "eviction", "policy": policy, **options}]}


def test_query_aware_snapkv_keeps_the_passkey_a_recency_window_loses(smollm2) -> None:
    """With the question inside the prefill, SnapKV's observation window finds the key line and keeps
    it at 50 % compression; a sliding window of the same size has evicted it. The window is the
    question's length: with kvpress's default of 64 queries, filler queries outvote the question on
    this small model (0/10 passkeys at 1k tokens against 10/10 with 16, measured)."""
    model, tokenizer = smollm2
    record = passkey_prompts(tokenizer, 1024, [0.3], keys_per_depth=1)[0]
    full, _ = answer(model, tokenizer, record.prompt, None)
    assert record.answer in full  # the task works with every token kept
    snap, cache = answer(model, tokenizer, record.prompt, evicting("snapkv", compression_ratio=0.5,
                                                                                window_size=16))
    assert record.answer in snap
    assert cache.size(0) <= 0.5 * record.prompt_tokens + 8
    window, _ = answer(model, tokenizer, record.prompt, evicting("window", budget=cache.size(0)))
    assert record.answer not in window


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "streaming_llm"])
def test_a_left_padded_batch_of_four_answers_as_each_prompt_alone(smollm2, wikitext_ids, policy) -> None:
    model, tokenizer = smollm2
    lengths = [300, 180, 240, 120]
    rows = [wikitext_ids[i * 400:i * 400 + n] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.full((4, width), tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros((4, width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - row.numel():], mask[i, width - row.numel():] = row, 1
    options = {"compression_ratio": 0.5} if policy == "snapkv" else {"budget": 96, "slack": 8}
    make = KVCacheFactory(model.config, evicting(policy, **options)).create_cache
    greedy = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    with torch.no_grad():
        batch = model.generate(input_ids=ids, attention_mask=mask, past_key_values=make(), **greedy)
        for i, row in enumerate(rows):
            alone = model.generate(row[None], past_key_values=make(), **greedy)
            assert torch.equal(batch[i, width:], alone[0, row.numel():]), (policy, i)
