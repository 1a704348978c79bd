"""``kvfactory serve`` over the embedded model with plain 16-token pages (lossless): the OpenAI
client's completions and chat, streamed and not, several clients at once, greedy answers equal to
``model.generate`` with ``DynamicCache``; the other routes; each invalid request's 400 and the
field it names; clients that go away mid-request. One server for the module; it must end with the
pool free and exit 0 on SIGTERM."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import openai
import pytest
from servers import MODEL, ServerProcess, greedy_reference, text_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
POOL_TOKENS = 4096
CONTEXT = 8192  # SmolLM2's max_position_embeddings
TEXT_PROMPT = "The history of the city begins"
CHAT = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You answer in one short sentence."},
         {"role": "user", "content": "Name a colour of the sky."}]]


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    server = start_server("--pool-tokens", str(POOL_TOKENS), "--max-num-seqs", "8")
    yield server
    server.stop_clean()


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return text_prompts(smollm2[1], 3, 40)


@pytest.fixture(scope="module")
def expected(smollm2, prompts) -> list[str]:
    """The greedy continuation of each prompt by ``model.generate`` with ``DynamicCache``."""
    model, tokenizer = smollm2
    return [_decode(tokenizer, greedy_reference(model, p, MAX_TOKENS)) for p in prompts]


@pytest.fixture(scope="module")
def text_expected(smollm2) -> str:
    """The same for ``TEXT_PROMPT``, tokenized as the engine tokenizes text."""
    model, tokenizer = smollm2
    ids = tokenizer(TEXT_PROMPT, add_special_tokens=True)["input_ids"]
    return _decode(tokenizer, greedy_reference(model, ids, MAX_TOKENS))


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)  # as the engine detokenizes


@pytest.fixture(scope="module")
def chat_expected(smollm2) -> list[tuple[list[int], str]]:
    model, tokenizer = smollm2
    answers = []
    for messages in CHAT:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        answers.append((ids, _decode(tokenizer, greedy_reference(model, ids, MAX_TOKENS))))
    return answers


def complete(client: openai.OpenAI, prompt: str | list[int], stream: bool = False, **kwargs: object) -> tuple:
    """``(text, finish_reason, usage)`` of a greedy completion, streamed or not."""
    args = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0) | kwargs
    if not stream:
        response = client.completions.create(**args)
        return response.choices[0].text, response.choices[0].finish_reason, response.usage
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    text = "".join(c.choices[0].text for c in chunks[:-1])
    return text, chunks[-2].choices[0].finish_reason, usage


def test_health_and_models(server: ServerProcess) -> None:
    health = server.health()
    assert health["status"] == "ok" and health["model"] == MODEL
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_equal_generate(server: ServerProcess, prompts, expected, text_expected, stream: bool
                                    ) -> None:
    client = server.client()
    for prompt, reference in zip(prompts, expected, strict=True):
        text, reason, usage = complete(client, prompt, stream)
        assert text == reference
        assert reason in ("length", "stop")
        assert usage.prompt_tokens == len(prompt)
        assert usage.total_tokens == len(prompt) + usage.completion_tokens
    assert complete(client, TEXT_PROMPT, stream)[0] == text_expected


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_equals_generate(server: ServerProcess, chat_expected, stream: bool) -> None:
    client = server.client()
    for messages, (ids, reference) in zip(CHAT, chat_expected, strict=True):
        args = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **args))
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
            reason, usage = chunks[-2].choices[0].finish_reason, chunks[-1].usage
        else:
            response = client.chat.completions.create(**args)
            assert response.choices[0].message.role == "assistant"
            text, reason, usage = (response.choices[0].message.content, response.choices[0].finish_reason,
                                   response.usage)
        assert text == reference
        assert reason in ("length", "stop")
        assert usage.prompt_tokens == len(ids)


def test_concurrent_clients(server: ServerProcess, prompts, expected) -> None:
    jobs = [(prompt, reference, stream) for prompt, reference in zip(prompts, expected, strict=True)
            for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: complete(server.client(), job[0], job[2])[0], jobs))
    assert texts == [reference for _, reference, _ in jobs]


def test_sampling_with_a_seed_repeats(server: ServerProcess, prompts) -> None:
    client = server.client()
    args = dict(prompt=prompts[1], temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 50})
    first, second = complete(client, **args), complete(client, stream=True, **args)
    assert first[0] == second[0]


def test_stop_string(server: ServerProcess, prompts, expected) -> None:
    words = expected[0].split()
    stop = words[len(words) // 2]
    text, reason, _ = complete(server.client(), prompts[0], stop=[stop])
    assert text == expected[0][:expected[0].index(stop)]
    assert reason == "stop"


def test_metrics(server: ServerProcess) -> None:
    response = httpx2.get(f"{server.url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    for name in ("kvfactory_requests_running", "kvfactory_requests_waiting", "kvfactory_requests_swapped",
                 "kvfactory_pool_blocks_used", "kvfactory_pool_blocks_total", "kvfactory_pool_usage",
                 "kvfactory_prompt_tokens_total", "kvfactory_generation_tokens_total",
                 "kvfactory_requests_finished_total", "kvfactory_time_to_first_token_seconds_bucket",
                 "kvfactory_inter_token_latency_seconds_bucket", "kvfactory_step_seconds_bucket",
                 "kvfactory_prefix_cache_hit_tokens_total", "kvfactory_generation_tokens_per_second"):
        assert f"\n{name}" in response.text, name
    assert server.metric("kvfactory_generation_tokens_total") > 0


BAD_REQUESTS = [
    ("completions", {"model": "gpt-4", "prompt": "Hi"}, "model"),
    ("completions", {"model": MODEL, "prompt": [1] * CONTEXT}, "prompt"),
    ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": CONTEXT}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": POOL_TOKENS + 16}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": -3}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "Hi", "temperature": -0.5}, "temperature"),
    ("completions", {"model": MODEL, "prompt": "Hi", "top_p": 0}, "top_p"),
    ("completions", {"model": MODEL, "prompt": "Hi", "top_p": 1.5}, "top_p"),
    ("completions", {"model": MODEL, "prompt": "Hi", "n": 2}, "n"),
    ("completions", {"model": MODEL, "prompt": "Hi", "stop": [3]}, "stop"),
    ("completions", {"model": MODEL, "prompt": "Hi", "stop": ["a"] * 17}, "stop"),
    ("completions", {"model": MODEL, "prompt": "Hi", "frequency_penalty": 1}, "frequency_penalty"),
    ("completions", {"model": MODEL, "prompt": "Hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": "16"}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": ["Hi", "there"]}, "prompt"),
    ("completions", {"model": MODEL, "prompt": [10 ** 6]}, "prompt"),
    ("completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("completions", {"model": MODEL}, "prompt"),
    ("completions", {"prompt": "Hi"}, "model"),
    ("chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "Hi"}]},
     "messages.0.role"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0},
     "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                          "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"model": "other", "messages": [{"role": "user", "content": "Hi"}]}, "model"),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD_REQUESTS,
                         ids=[f"{route}-{param}-{i}" for i, (route, _, param) in enumerate(BAD_REQUESTS)])
def test_invalid_request_is_a_400_naming_the_field(server: ServerProcess, route: str, body: dict,
                                                   param: str) -> None:
    response = httpx2.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["code"] is None and error["message"]


def test_malformed_json_is_a_400(server: ServerProcess) -> None:
    response = httpx2.post(f"{server.url}/v1/completions", content=b'{"model": "smollm2", "prompt": ',
                           headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_the_error(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert caught.value.status_code == 400 and caught.value.param == "temperature"


def _aborted(server: ServerProcess) -> float:
    return server.metric("kvfactory_requests_finished_total", reason="abort")


def _wait_idle(server: ServerProcess, aborted: float) -> None:
    """Until the abort was counted and nothing runs any more."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _aborted(server) > aborted and server.metric("kvfactory_requests_running") == 0:
            break
        time.sleep(0.25)
    assert _aborted(server) == aborted + 1
    assert server.metric("kvfactory_requests_running") == 0
    health = server.health()
    assert (health["sequences"], health["blocks_held"]) == (0, 0), health


def test_client_leaving_mid_stream_aborts(server: ServerProcess) -> None:
    before = _aborted(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks = []
    with httpx2.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line.removeprefix("data: ")))
            if len(chunks) == 3:
                break  # leaving the block closes the connection
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    _wait_idle(server, before)


def test_client_leaving_before_the_answer_aborts(server: ServerProcess) -> None:
    before = _aborted(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(f"{server.url}/v1/completions", json=body, timeout=httpx2.Timeout(30, read=1.0))
    _wait_idle(server, before)
