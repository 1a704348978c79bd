"""Twelve concurrent greedy requests over a pool that holds about four of them: the engine preempts
(swapping to host memory, the default) and every answer is still ``model.generate``'s with
``DynamicCache`` for the same prompt alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from servers import MODEL, ServerProcess, greedy_reference, text_prompts

pytestmark = pytest.mark.slow

REQUESTS, PROMPT_TOKENS, MAX_TOKENS = 12, 200, 32
POOL_TOKENS = 4 * (PROMPT_TOKENS + MAX_TOKENS)


def test_preempted_requests_answer_as_alone(start_server, smollm2) -> None:
    model, tokenizer = smollm2
    prompts = text_prompts(tokenizer, REQUESTS, PROMPT_TOKENS)
    server: ServerProcess = start_server("--pool-tokens", str(POOL_TOKENS))
    client = server.client(timeout=600)

    def complete(prompt: list[int]) -> tuple[str, str]:
        choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0).choices[0]
        return choice.text, choice.finish_reason

    with ThreadPoolExecutor(REQUESTS) as pool:
        answers = pool.map(complete, prompts)
        # the references are computed here while the server works
        expected = [tokenizer.decode(greedy_reference(model, p, MAX_TOKENS), skip_special_tokens=True)
                    for p in prompts]
        answers = list(answers)
    assert [text for text, _ in answers] == expected
    assert all(reason in ("length", "stop") for _, reason in answers)
    assert server.metric("kvfactory_preemptions_total", mode="swap") > 0
    server.stop_clean()
