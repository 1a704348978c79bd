"""The engine and ``kvfactory serve`` on Gemma 3 270M (sliding window 512 in 15 of 18 layers, one KV
head): 8 concurrent requests sharing a 1,024-token prefix answer ``model.generate``'s greedy tokens,
one request at a time. The prefix is not yet computed once: sliding-window layers give back a
prompt's blocks before its last window, so a later request finds no whole prefix to reuse (an
expected failure until prefix caching keeps, for those layers, the blocks of the last window)."""

from __future__ import annotations

import concurrent.futures

import pytest
from servers import ServerProcess, greedy_reference

from kvfactory import models
from kvfactory.engine import Engine, SamplingParams
from kvfactory.texts import shipped_text

pytestmark = pytest.mark.slow

NAME, REQUESTS, PREFIX, NEW, PAGE = "gemma3-270m", 8, 1024, 12, 16


@pytest.fixture(scope="module")
def gemma3():
    return models.load_model(NAME)


@pytest.fixture(scope="module")
def shared_prefix(gemma3) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompts, references)``: 8 prompts of one 1,024-token prefix (with BOS) and a question of
    their own, and each one's greedy tokens from ``model.generate`` alone."""
    model, tokenizer = gemma3
    ids = tokenizer(shipped_text())["input_ids"]
    prefix = ids[:PREFIX]
    prompts = [prefix + tokenizer(f" Question {i}: what happens next to the {word}?",
                                  add_special_tokens=False)["input_ids"]
               for i, word in enumerate(("Queen", "Hatter", "cat", "Duchess", "rabbit", "King", "baby",
                                         "Mouse"))]
    return prompts, [greedy_reference(model, prompt, NEW) for prompt in prompts]


@pytest.fixture(scope="module")
def engine_run(gemma3, shared_prefix) -> tuple[list[list[int]], dict]:
    """The first request alone, then the other 7 together: their tokens and the engine's stats."""
    model, tokenizer = gemma3
    prompts, _ = shared_prefix
    engine = Engine(model, tokenizer, {"type": "paged", "page_size": PAGE}, pool_tokens=4 * 2048)
    outputs = engine.generate(prompts[:1], SamplingParams(max_tokens=NEW, ignore_eos=True))
    outputs += engine.generate(prompts[1:], SamplingParams(max_tokens=NEW, ignore_eos=True))
    return [output.token_ids for output in outputs], engine.stats()


def test_the_engine_answers_as_generate(shared_prefix, engine_run) -> None:
    tokens, stats = engine_run
    assert tokens == shared_prefix[1]
    assert stats["pool_blocks_held"] == 0


@pytest.mark.xfail(strict=True, reason="sliding-window layers give back a finished prompt's early blocks, "
                                        "so a later request finds no whole prefix in the prefix cache")
def test_the_engine_computes_a_shared_prefix_once(engine_run) -> None:
    _, stats = engine_run
    assert stats["prefix_hit_blocks"] >= (REQUESTS - 1) * (PREFIX // PAGE - 1), stats


def test_kvfactory_serve_answers_concurrent_requests_as_generate(gemma3, shared_prefix, tmp_path) -> None:
    tokenizer = gemma3[1]
    prompts, references = shared_prefix
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
    finally:
        server.stop_clean()
