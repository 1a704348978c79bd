"""Hostile requests for a live ``kvfactory serve``: hypothesis strategies for request bodies (odd
numbers, unicode with lone surrogates, huge and empty values, wrong types, unknown fields, bodies that
are not objects or not JSON), a client that sends one and checks the answer's form, and a steady
greedy stream that runs beside them. ``tests/server/test_server_fuzz.py`` runs a bounded number in
CI; ``benchmarks/fuzz_server.py`` a longer run.

A valid generated request stays short (``max_tokens`` at most 4, or so large it is refused), so a
run's time goes to many requests, not to a few long ones.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx2
from hypothesis import strategies as st

ROUTES = ("/v1/completions", "/v1/chat/completions")
NUMBER_EDGES = [0, -0.0, 1e-320, 5e-324, 1.1754943508222875e-38, 2, 2.0000001, 1e308, math.inf, -math.inf,
                math.nan, 2**63, 2**64, -(2**63) - 1, 10**40]
NAMES = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
         "stream", "stream_options", "n", "ignore_eos", "presence_penalty", "frequency_penalty",
         "logit_bias", "logprobs", "echo", "suffix", "best_of", "tools", "max_completion_tokens", "user"]

texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=40) | st.sampled_from(
    ["", "\ud800abc", "abc\udfff", "\x00", "Once upon a time", "é" * 300, "\U0001f600" * 20])
numbers = st.sampled_from(NUMBER_EDGES) | st.floats() | st.integers() | st.integers(-3, 5)
scalars = st.none() | st.booleans() | numbers | texts
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(texts, inner, max_size=4), max_leaves=10)


def _or_garbage(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly ``strategy``, sometimes any JSON value."""
    return st.one_of(strategy, strategy, strategy, values)


def _message() -> st.SearchStrategy:
    role = _or_garbage(st.sampled_from(["system", "user", "assistant", "tool", ""]))
    part = st.fixed_dictionaries({"type": _or_garbage(st.just("text")), "text": _or_garbage(texts)})
    content = _or_garbage(texts | st.lists(part, max_size=3))
    return _or_garbage(st.fixed_dictionaries({"role": role, "content": content},
                                             optional={"name": texts, "extra": values}))


def _fields(model: str) -> dict[str, st.SearchStrategy]:
    """Each field's values, valid or not."""
    short = st.integers(max_value=4) | st.integers(min_value=10_000) | st.sampled_from([2**64, 10**40])
    stop = texts | st.lists(texts, max_size=20)
    return {
        "model": _or_garbage(st.just(model) | texts),
        "prompt": _or_garbage(texts | st.lists(st.integers(-5, 50_000) | st.sampled_from([2**63, -1]),
                                               max_size=30)),
        "messages": _or_garbage(st.lists(_message(), max_size=4)),
        "max_tokens": _or_garbage(short), "max_completion_tokens": _or_garbage(short),
        "temperature": _or_garbage(numbers), "top_p": _or_garbage(numbers), "top_k": _or_garbage(numbers),
        "seed": _or_garbage(numbers), "stop": _or_garbage(stop), "stream": _or_garbage(st.booleans()),
        "stream_options": _or_garbage(st.fixed_dictionaries({"include_usage": _or_garbage(st.booleans())})),
        "n": _or_garbage(numbers), "ignore_eos": _or_garbage(st.just(False)),
        "presence_penalty": _or_garbage(numbers), "frequency_penalty": _or_garbage(numbers),
        "logit_bias": values, "logprobs": values, "echo": values, "suffix": values, "best_of": values,
        "tools": values, "user": values,
    }


def _valid_fields(model: str) -> dict[str, st.SearchStrategy]:
    """Values the API takes (any unicode text but lone surrogates; short answers)."""
    text = st.text(max_size=40)
    message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                     "content": text | st.lists(st.fixed_dictionaries(
                                         {"type": st.just("text"), "text": text}), max_size=2)})
    return {
        "model": st.just(model),
        "prompt": st.text(min_size=1, max_size=60)
        | st.lists(st.integers(0, 49_151), min_size=1, max_size=30),
        "messages": st.lists(message, min_size=1, max_size=3),
        "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4),
        "temperature": st.just(0) | st.floats(0, 2) | st.sampled_from([1e-38, 2]),
        "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.integers(0, 10**6),
        "seed": st.integers(0, 2**64 - 1), "stop": st.text(min_size=1, max_size=5)
        | st.lists(st.text(min_size=1, max_size=5), max_size=4),
        "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "n": st.just(1), "ignore_eos": st.booleans(), "presence_penalty": st.just(0),
        "frequency_penalty": st.just(0.0), "logit_bias": st.just({}), "logprobs": st.none(),
        "echo": st.just(False), "suffix": st.none(), "best_of": st.just(1), "tools": st.none(),
        "user": text,
    }


@st.composite
def requests(draw: st.DrawFn, model: str) -> tuple[str, bytes]:
    """``(route, body bytes)``: a valid request (now and then with one field replaced by anything),
    an object of the API's fields each valid or not with unknown ones beside, or now and then a body
    that is another JSON value or no JSON."""
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["valid"] * 6 + ["one bad"] * 6 + ["any"] * 6 + ["value", "bytes"]))
    if kind == "bytes":
        return route, draw(st.binary(max_size=64))
    if kind == "value":
        return route, json.dumps(draw(values)).encode()
    fields = _fields(model) if kind == "any" else _valid_fields(model)
    required = ["model", "prompt" if route == ROUTES[0] else "messages"]
    names = [name for name in NAMES if name not in ("prompt", "messages")] + required[1:]
    body = {name: draw(fields[name]) for name in required if kind != "any" or draw(st.integers(0, 9))}
    for name in draw(st.lists(st.sampled_from(names), max_size=6, unique=True)):
        body[name] = draw(fields[name])
    if kind == "one bad":
        body[draw(st.sampled_from(NAMES))] = draw(_fields(model)[draw(st.sampled_from(NAMES))] | values)
    if kind == "any":
        body |= draw(st.dictionaries(texts, values, max_size=2))
    return route, json.dumps(body).encode()  # ascii: lone surrogates travel as \ud800, NaN as NaN


@dataclass
class Answer:
    """What the server answered: the status, and what is wrong with the answer's form (empty: fine)."""

    status: int
    problems: list[str] = field(default_factory=list)


def send(url: str, route: str, body: bytes, timeout: float = 120.0) -> Answer:
    """POST ``body``; an answer is well-formed when its status is 2xx or 4xx and it is JSON (every
    event of a stream, which ends with ``[DONE]`` and carries no error)."""
    headers = {"Content-Type": "application/json"}
    with httpx2.stream("POST", url + route, content=body, headers=headers, timeout=timeout) as response:
        answer = Answer(response.status_code)
        if not (200 <= response.status_code < 300 or 400 <= response.status_code < 500):
            answer.problems.append(f"status {response.status_code}")
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            events = _events(response)
            if not events or events[-1] != "[DONE]":
                answer.problems.append(f"a stream that does not end with [DONE]: {events[-2:]}")
            for event in events[:-1]:
                if "error" in _json(event, answer):
                    answer.problems.append(f"an error event: {event}")
        else:
            parsed = _json(response.read().decode("utf-8", "replace"), answer)
            if response.status_code >= 400 and "message" not in parsed.get("error", {}):
                answer.problems.append(f"an error without a message: {parsed}")
    return answer


def _events(response: httpx2.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def _json(text: str, answer: Answer) -> dict[str, Any]:
    try:
        parsed = json.loads(text)
    except ValueError:
        answer.problems.append(f"not JSON: {text[:200]!r}")
        return {}
    if not isinstance(parsed, dict):
        answer.problems.append(f"not a JSON object: {text[:200]!r}")
        return {}
    return parsed


class Steady(threading.Thread):
    """Greedy streamed completions of one prompt, one after another until ``stop``: every answer's
    text in ``texts`` (or the error that ended it in ``errors``)."""

    def __init__(self, url: str, model: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True}
        self.texts: list[str] = []
        self.errors: list[str] = []
        self.finished = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.finished.is_set():
            try:
                url = f"{self.url}/v1/completions"
                with httpx2.stream("POST", url, json=self.body, timeout=120) as response:
                    events = _events(response)
                chunks = [json.loads(event) for event in events[:-1]]
                failed = events[-1] != "[DONE]" or any("error" in c for c in chunks)
                if response.status_code != 200 or failed:
                    self.errors.append(f"{response.status_code}: {events[-2:]}")
                else:
                    self.texts.append("".join(c["choices"][0]["text"] for c in chunks))
            except Exception as exc:  # recorded: the test fails on any
                self.errors.append(repr(exc))

    def stop(self) -> None:
        self.finished.set()
        self.join(180)
