"""``kvfactory serve`` under hostile input: generated requests (``fuzzing.requests``) beside a steady
greedy stream; every answer is a well-formed 2xx or 4xx, the stream's every answer equals
``model.generate``'s, and nothing is left held. Then poisonous sampling values beside three streams:
each is a 400 naming the field, the streams finish as they would alone. And the drain: a request
during SIGTERM's drain is a 503 with ``Retry-After``."""

from __future__ import annotations

import json
import threading
import time

import httpx2
import pytest
from fuzzing import Answer, Steady, requests, send
from hypothesis import HealthCheck, given, settings
from servers import MODEL, ServerProcess, greedy_reference, text_prompts

pytestmark = pytest.mark.slow

EXAMPLES = 100  # generated requests per CI run; benchmarks/fuzz_server.py runs thousands
STEADY_TOKENS = 24
POISONS = [("temperature", 1e-320), ("temperature", float("inf")), ("temperature", 2.5), ("seed", 2**64),
           ("presence_penalty", 0.5)]


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server("--pool-tokens", "4096", "--max-num-seqs", "8", "--max-tokens", "4",
                        "--shutdown-timeout", "20")


@pytest.fixture(scope="module")
def reference(smollm2) -> tuple[list[int], str, list[list[int]], list[str]]:
    """A prompt and its greedy continuation, and three more for the streams beside the poisons."""
    model, tokenizer = smollm2
    prompts = text_prompts(tokenizer, 4, 48)
    texts = [tokenizer.decode(greedy_reference(model, p, STEADY_TOKENS), skip_special_tokens=True)
             for p in prompts]
    return prompts[0], texts[0], prompts[1:], texts[1:]


def test_generated_requests_never_hurt_the_server_or_a_neighbour(server: ServerProcess, reference) -> None:
    prompt, expected, _, _ = reference
    steady = Steady(server.url, MODEL, prompt, STEADY_TOKENS)
    answers: list[tuple[str, bytes, Answer]] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=requests(MODEL))
    def fuzz(request: tuple[str, bytes]) -> None:
        route, body = request
        answer = send(server.url, route, body)
        answers.append((route, body, answer))
        assert not answer.problems, (route, body, answer)

    try:
        fuzz()
    finally:
        steady.stop()
    assert len(answers) >= EXAMPLES
    assert steady.errors == [] and steady.texts and set(steady.texts) == {expected}, steady.texts[:3]
    statuses = [answer.status for _, _, answer in answers]
    assert statuses.count(200) >= 5 and sum(400 <= s < 500 for s in statuses) >= EXAMPLES // 3, statuses
    health = server.health()
    assert health["status"] == "ok" and (health["sequences"], health["blocks_held"]) == (0, 0), health
    assert server.metric("kvfactory_requests_rejected_total", reason="invalid", status="400") > 0
    assert server.metric("kvfactory_requests_finished_total", reason="error") == 0


class Stream(threading.Thread):
    """One greedy streamed completion on its own thread: its events and text."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int = STEADY_TOKENS) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens, self.text, self.events = url, prompt, max_tokens, None, []
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx2.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as response:
            self.events = [line.removeprefix("data: ") for line in response.iter_lines()
                           if line.startswith("data: ")]
        self.text = "".join(json.loads(e)["choices"][0]["text"] for e in self.events[:-1])


def test_poisonous_values_are_400s_and_their_neighbours_finish(server: ServerProcess, reference) -> None:
    """Each value that once failed a whole step (or sampled noise) is refused naming its field, while
    three greedy streams run; they finish with ``generate``'s text."""
    _, _, prompts, expected = reference
    streams = [Stream(server.url, p) for p in prompts]
    for field, value in POISONS:
        body = json.dumps({"model": MODEL, "prompt": "The sky is", "max_tokens": 4, field: value})
        answer = httpx2.post(f"{server.url}/v1/completions", content=body,
                             headers={"Content-Type": "application/json"}, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
    for stream in streams:
        stream.join(120)
    assert [s.text for s in streams] == expected and all(s.events[-1] == "[DONE]" for s in streams)
    health = server.health()
    assert (health["sequences"], health["blocks_held"]) == (0, 0), health


def test_a_lone_surrogate_in_a_prompt_is_a_400(server: ServerProcess) -> None:
    body = json.dumps({"model": MODEL, "prompt": "\ud800abc", "max_tokens": 2})  # ascii: "\\ud800abc"
    answer = httpx2.post(f"{server.url}/v1/completions", content=body.encode(),
                         headers={"Content-Type": "application/json"}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt", answer.text
    assert "surrogate" in answer.json()["error"]["message"]


def test_requests_during_the_drain_are_503s_with_retry_after(server: ServerProcess, reference) -> None:
    """Last in the module: it stops the server. SIGTERM with a stream in flight keeps the listener
    open for the drain; a new request meanwhile is a 503 with Retry-After; the stream then finishes."""
    _, _, prompts, _ = reference
    stream = Stream(server.url, prompts[0], max_tokens=160)
    deadline = time.monotonic() + 60
    while server.health()["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.process.send_signal(15)
    deadline = time.monotonic() + 20
    while (health := httpx2.get(f"{server.url}/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert health.status_code == 503
    answer = httpx2.post(f"{server.url}/v1/completions", timeout=60,
                         json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
    assert "shutting down" in answer.json()["error"]["message"]
    stream.join(120)
    server.process.wait(timeout=10)  # the drain ends when the stream does, well before --shutdown-timeout
    assert stream.events[-1] == "[DONE]"
    assert json.loads(stream.events[-2])["choices"][0]["finish_reason"] == "length"
    code, log = server.stop()
    assert code == 0 and "the pool is free: 0 sequences, 0 blocks held" in log, log
    assert "Traceback" not in log, log
