"""The engine and ``kvfactory serve`` on Gemma 3 270M (sliding window 512 in 15 of 18 layers, one KV
head): 8 requests sharing a 1,024-token prefix, the first alone and then 7 at once, answer
``model.generate``'s greedy tokens one request at a time, and the 7 start from the first one's
cached prefix (full-attention layers' blocks whole, sliding layers' over their last window)."""

from __future__ import annotations

import concurrent.futures

import pytest
from servers import ServerProcess

from kvfactory.engine import Engine, SamplingParams

pytestmark = pytest.mark.slow

NAME, REQUESTS, PREFIX, NEW, PAGE = "gemma3-270m", 8, 1024, 12, 16


@pytest.fixture(scope="module")
def engine_run(gemma3, gemma3_shared_prefix) -> tuple[list[list[int]], dict]:
    """The first request alone, then the other 7 together: their tokens and the engine's stats."""
    model, tokenizer = gemma3
    prompts, _ = gemma3_shared_prefix
    engine = Engine(model, tokenizer, {"type": "paged", "page_size": PAGE}, pool_tokens=4 * 2048)
    outputs = engine.generate(prompts[:1], SamplingParams(max_tokens=NEW, ignore_eos=True))
    outputs += engine.generate(prompts[1:], SamplingParams(max_tokens=NEW, ignore_eos=True))
    return [output.token_ids for output in outputs], engine.stats()


def test_the_engine_answers_as_generate(gemma3_shared_prefix, engine_run) -> None:
    tokens, stats = engine_run
    assert tokens == gemma3_shared_prefix[1]
    assert stats["pool_blocks_held"] == 0


def test_the_engine_computes_a_shared_prefix_once(engine_run) -> None:
    _, stats = engine_run
    assert stats["prefix_hit_blocks"] == (REQUESTS - 1) * PREFIX // PAGE, stats


def test_kvfactory_serve_answers_concurrent_requests_as_generate(gemma3, gemma3_shared_prefix,
                                                                 tmp_path) -> None:
    tokenizer = gemma3[1]
    prompts, references = gemma3_shared_prefix
    server = ServerProcess(tmp_path / "serve.log", "--model", NAME, "--cache", "paged16",
                           "--pool-tokens", str(4 * 2048))
    try:
        client = server.client(timeout=600)

        def complete(prompt: list[int]) -> str:
            response = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0,
                                                 extra_body={"ignore_eos": True})
            return response.choices[0].text

        first = complete(prompts[0])
        with concurrent.futures.ThreadPoolExecutor(REQUESTS - 1) as pool:
            texts = [first, *pool.map(complete, prompts[1:])]
        assert texts == [tokenizer.decode(reference) for reference in references]
        assert server.metric("kvfactory_prefix_cache_hit_tokens_total") == (REQUESTS - 1) * PREFIX
    finally:
        server.stop_clean()
