"""KVCacheManager on the embedded model: prompts sharing a system prompt reuse its blocks and
answer exactly as they do alone."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvfactory import KVCacheManager
from kvfactory.texts import shipped_text

pytestmark = pytest.mark.slow


def test_prompts_behind_one_system_prompt_share_its_blocks_and_answer_as_alone(smollm2) -> None:
    model, tokenizer = smollm2
    ids = tokenizer(shipped_text()[:20_000], return_tensors="pt").input_ids[0]
    system = ids[:256]
    prompts = [torch.cat([system, ids[256 + 24 * i:256 + 24 * (i + 1)]])[None] for i in range(3)]
    manager = KVCacheManager(model.config, {"type": "paged", "page_size": 16})
    for i, prompt in enumerate(prompts):
        cache = manager.create(str(i), prompt=prompt[0])
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False)
        alone = model.generate(prompt, past_key_values=DynamicCache(config=model.config), max_new_tokens=8,
                               do_sample=False)
        assert torch.equal(out, alone), i
        assert manager.cached_tokens(str(i)) == (0 if i == 0 else 256)
    stats = manager.stats()
    # the system prompt's 16 blocks once, each question and answer 2 (a block holds a page of every layer)
    assert stats["pool_blocks_used"] == 16 + 3 * 2
    manager.close()
