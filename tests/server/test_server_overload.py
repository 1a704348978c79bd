"""A server that runs one sequence and queues one more: the next request is a 503 with Retry-After;
SIGTERM ends the stream in flight well-formed (``finish_reason: "abort"``, ``[DONE]``), answers the
queued request 503, frees the pool and exits 0."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import openai
import pytest
from servers import MODEL, ServerProcess

pytestmark = pytest.mark.slow

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
SHORT = {"model": MODEL, "prompt": "The sky is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server("--max-num-seqs", "1", "--max-waiting", "1", "--shutdown-timeout", "1")


class Stream(threading.Thread):
    """A streamed completion read on its own thread: ``started`` once its first chunk came, then every
    ``data:`` payload until the server ends it (or ``close`` is set)."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.started, self.close = threading.Event(), threading.Event()
        self.events: list[str] = []
        self.start()

    def run(self) -> None:
        with httpx2.stream("POST", f"{self.url}/v1/completions", json={**self.body, "stream": True},
                           timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line.removeprefix("data: "))
                    self.started.set()
                if self.close.is_set():
                    return


def wait_for(server: ServerProcess, field: str, value: int) -> None:
    deadline = time.monotonic() + 60
    while server.health()[field] != value:
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.1)


def test_full_queue_is_a_503_with_retry_after(server: ServerProcess) -> None:
    running = Stream(server.url, LONG)
    assert running.started.wait(60)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(httpx2.post, f"{server.url}/v1/completions", json=SHORT, timeout=120)
        wait_for(server, "waiting", 1)
        response = httpx2.post(f"{server.url}/v1/completions", json=SHORT, timeout=30)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "server_error"
        with pytest.raises(openai.APIStatusError) as caught:
            server.client(max_retries=0).completions.create(**SHORT)
        assert caught.value.status_code == 503
        running.close.set()  # the client leaves: its sequence is aborted and the queued one runs
        answer = queued.result(timeout=120)
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
    running.join(30)
    wait_for(server, "sequences", 0)


def test_sigterm_aborts_what_is_in_flight(server: ServerProcess) -> None:
    running = Stream(server.url, LONG)
    assert running.started.wait(60)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(httpx2.post, f"{server.url}/v1/completions", json=SHORT, timeout=120)
        wait_for(server, "waiting", 1)
        code, log = server.stop()
        answer = queued.result(timeout=60)
    running.join(30)
    assert code == 0, log
    assert "the pool is free: 0 sequences, 0 blocks held" in log
    assert running.events[-1] == "[DONE]"
    assert json.loads(running.events[-2])["choices"][0]["finish_reason"] == "abort"
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
