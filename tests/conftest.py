"""Shared fixtures: the embedded model (loaded once per session), the WikiText-2 test text and a
real Redis server per test module (``redis_server``; ``redis_url`` flushes it first, and starts it
again after a test killed it)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import wikitext_excerpt
from redis_server import RedisServer

# The suite runs on shared 2-core machines where a second thread mostly waits on the first: with
# other jobs running, 2 threads made SmolLM2 generation 4-9x slower than 1. Override with
# KVFACTORY_TEST_THREADS (at most 2) on a quiet machine.
torch.set_num_threads(max(1, min(2, int(os.environ.get("KVFACTORY_TEST_THREADS", "1")))))


@pytest.fixture(autouse=True)
def suite_threads():
    """Each test ends on the threads it started with: a CLI command run in-process sets torch's threads
    for the whole process (``--threads``), which would change what later tests measure or choose
    (the engine's panel layout is picked on one thread only)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the embedded SmolLM2-135M-Instruct, fp32, eval mode."""
    from kvfactory.models import load_model

    model, tokenizer = load_model()
    return model, tokenizer


@pytest.fixture(scope="session")
def gemma3():
    """``(model, tokenizer)`` of the packaged Gemma 3 270M (``kvfactory[gemma]``), fp32, eval mode."""
    from kvfactory.models import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_shared_prefix(gemma3) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompts, references)`` on Gemma 3: 8 prompts of one 1,024-token prefix of the shipped book
    (with BOS) and a question of their own, and each one's 12 greedy tokens, the tokens a lossless
    server answers with. The prefix is prefilled once and its ``DynamicCache`` copied per prompt
    (three times faster than each prompt alone, and the same tokens)."""
    import copy

    from helpers import greedy_tokens
    from transformers import DynamicCache

    from kvfactory.texts import shipped_text

    model, tokenizer = gemma3
    prefix = tokenizer(shipped_text())["input_ids"][:1024]
    words = ("Queen", "Hatter", "cat", "Duchess", "rabbit", "King", "baby", "Mouse")
    prompts = [prefix + tokenizer(f" Question {i}: what happens next to the {word}?",
                                  add_special_tokens=False)["input_ids"] for i, word in enumerate(words)]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
    return prompts, [greedy_tokens(model, prompt[len(prefix):], 12, cache=copy.deepcopy(cache))
                     for prompt in prompts]


@pytest.fixture(scope="session")
def wikitext_ids(smollm2) -> torch.Tensor:
    """The first ~8k tokens of WikiText-2 test as a 1-D tensor of SmolLM2 token ids."""
    _, tokenizer = smollm2
    ids = tokenizer(wikitext_excerpt(), return_tensors="pt", add_special_tokens=False).input_ids[0]
    assert ids.numel() > 4096
    return ids



@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    if redis_server.process is None:
        redis_server.start()
    redis_server.flush()
    return redis_server.url
