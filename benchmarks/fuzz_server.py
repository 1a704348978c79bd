"""A long fuzz run of ``kvfactory serve``: thousands of generated requests (the strategies of
``tests/server/fuzzing.py``: odd numbers, lone surrogates, huge and empty values, wrong types,
unknown fields, bodies that are not JSON) against a live server beside a steady greedy stream.
Prints JSON: requests tried, answers by status, server errors (5xx) and malformed answers, the
steady stream's answers against ``model.generate``'s, and the pool at the end.

    python benchmarks/fuzz_server.py --requests 2000
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import httpx2
import torch
from hypothesis import HealthCheck, given, settings
from serve_http import REPO, Server, free_port

sys.path.insert(0, str(REPO / "tests" / "server"))
sys.path.insert(0, str(REPO / "tests"))
from fuzzing import Steady, requests, send  # noqa: E402
from servers import greedy_reference, text_prompts  # noqa: E402

from kvfactory.measure import cpu_model  # noqa: E402
from kvfactory.models import load_model  # noqa: E402

MODEL = "smollm2"
STEADY_TOKENS = 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--log", type=Path, default=Path("/tmp/kvfactory-fuzz-server.log"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    prompt = text_prompts(tokenizer, 1, 48)[0]
    expected = tokenizer.decode(greedy_reference(model, prompt, STEADY_TOKENS), skip_special_tokens=True)
    del model
    port = free_port()
    command = [sys.executable, "-m", "kvfactory.cli", "serve", "--port", str(port), "--threads", "1",
               "--pool-tokens", "4096", "--max-num-seqs", "8", "--max-tokens", "4", "--log-level", "warning"]
    server = Server(command, port, args.log, {"PYTHONPATH": str(REPO)})
    statuses: collections.Counter[int] = collections.Counter()
    problems: list[dict] = []
    steady = Steady(server.url, MODEL, prompt, STEADY_TOKENS)
    started = time.perf_counter()

    @settings(max_examples=args.requests, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=requests(MODEL))
    def fuzz(request: tuple[str, bytes]) -> None:
        route, body = request
        answer = send(server.url, route, body)
        statuses[answer.status] += 1
        if answer.problems:
            problems.append({"route": route, "body": body.decode("ascii", "replace")[:300],
                             "problems": answer.problems})

    try:
        fuzz()
    finally:
        steady.stop()
        seconds = time.perf_counter() - started
        health = httpx2.get(f"{server.url}/health", timeout=30).json()
        server.stop()
    log = args.log.read_text(errors="replace")
    print(json.dumps({
        "benchmark": "fuzz_server", "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"),
        "requests": sum(statuses.values()), "seconds": round(seconds, 1),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors": sum(v for k, v in statuses.items() if k >= 500),
        "malformed_answers": len(problems), "examples": problems[:5],
        "steady_answers": len(steady.texts),
        "steady_equal_generate": sum(t == expected for t in steady.texts),
        "steady_errors": steady.errors[:5],
        "end_sequences": health.get("sequences"), "end_blocks_held": health.get("blocks_held"),
        "tracebacks_in_log": log.count("Traceback"),
    }, indent=2))


if __name__ == "__main__":
    main()
