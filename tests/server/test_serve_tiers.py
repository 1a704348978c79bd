"""Two ``kvfactory serve`` processes over one real Redis server (``--tiers``): the second, started
after the first stopped, loads the first one's 1,024-token system prompt instead of computing it,
and answers as ``model.generate`` with ``DynamicCache`` does."""

from __future__ import annotations

import pytest
from servers import MODEL, greedy_reference

pytestmark = pytest.mark.slow
SYSTEM, OWN, MAX_TOKENS = 1024, 48, 8


def test_a_second_server_reuses_the_first_ones_system_prompt(start_server, smollm2, wikitext_ids,
                                                              redis_url) -> None:
    model, tokenizer = smollm2
    ids = wikitext_ids.tolist()
    prompts = [ids[:SYSTEM] + ids[SYSTEM + OWN * i:SYSTEM + OWN * (i + 1)] for i in range(2)]
    answers = []
    for prompt in prompts:
        server = start_server("--pool-tokens", "4096", "--tiers", redis_url)
        response = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0)
        loaded = server.metric("kvfactory_tier_chunks", what="chunks_loaded")
        answers.append((response.choices[0].text, loaded, server.metric("kvfactory_prompt_tokens_total")))
        server.stop_clean()
    expected = [tokenizer.decode(greedy_reference(model, p, MAX_TOKENS), skip_special_tokens=True)
                for p in prompts]
    assert [text for text, _, _ in answers] == expected
    assert [loaded for _, loaded, _ in answers] == [0, SYSTEM // 256]
    assert [computed for _, _, computed in answers] == [SYSTEM + OWN, OWN]
