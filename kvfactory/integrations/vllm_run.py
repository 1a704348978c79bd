"""One vLLM process (offline ``LLM``, CPU build) serving a list of token prompts, with or without
kvfactory's connector: what the connector's tests and ``benchmarks/connector.py`` start twice, so
the second process reuses what the first stored. Runs in vLLM's virtualenv (``make vllm-venv``).

    python -m kvfactory.integrations.vllm_run SPEC.json   # prints one JSON line

``launch`` runs it from another interpreter (kvfactory's own virtualenv) and returns the result.

SPEC: ``model`` (a folder), ``prompts`` (token id lists), ``max_tokens``, ``connector`` (the
``kv_connector_extra_config``, or null for none), ``warmup`` (token ids served alone with one new
token first, so that start-up costs are out of what is timed), ``ttft`` (prompts timed alone with one
new token before the batch, whose saved chunks are written before it; default all), ``generate``
(the prompts then generated with ``max_tokens``; default all), ``prefix_caching`` (vLLM's own;
default off), ``kill_pid_after`` (``[pid, n]``: SIGKILL ``pid``, a Redis server, after ``n``
prompts), ``one_by_one`` (generate each prompt alone, in order).

Prints ``ttft_s`` per timed prompt, ``outputs`` (token ids per prompt), ``wall_s`` and the
connector's totals (``stats``: each tier's counters; ``metrics``: the connector's Prometheus
samples).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULT = '{"ttft_s"'  # how the result line starts among vLLM's log lines


def launch(python: Path, spec: dict[str, Any], log: Path, timeout: float = 900.0,
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one vLLM process with interpreter ``python`` (vLLM's virtualenv) on ``spec``, with
    ``env`` added to this process's environment; its log, and the spec beside it, stay at ``log``.
    Returns the process's result."""
    path = log.with_suffix(".json")
    path.write_text(json.dumps(spec))
    with log.open("w") as out:
        done = subprocess.run([str(python), "-m", "kvfactory.integrations.vllm_run", str(path)], stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout, env=os.environ | (env or {}))
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        raise RuntimeError(f"vLLM process on {path} failed (rc {done.returncode}); see {log}")
    return json.loads(lines[-1])


def main(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # a connector reserves a core otherwise
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its stats here
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec.get("connector") is not None:
        transfer = {"kv_connector": "KVFactoryConnector",
                    "kv_connector_module_path": "kvfactory.integrations.vllm", "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": spec["connector"]}
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec.get("max_model_len", 4096),
              enable_prefix_caching=spec.get("prefix_caching", False), kv_transfer_config=transfer, seed=0,
              max_num_seqs=spec.get("max_num_seqs", 16), disable_log_stats=False,
              enforce_eager=spec.get("enforce_eager", False))
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    if spec.get("warmup"):
        llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], first, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    ttft = []
    for i in spec.get("ttft", range(len(prompts))):
        began = time.perf_counter()
        llm.generate([prompts[i]], first, use_tqdm=False)
        ttft.append(time.perf_counter() - began)
    if transfer is not None:  # the timed prompts' chunks, saved off the steps, are in the tiers now
        from kvfactory.integrations.vllm import flush_writes

        flush_writes(timeout=300)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [prompts[i] for i in spec.get("generate", range(len(prompts)))]
    began = time.perf_counter()
    kill = spec.get("kill_pid_after")
    if spec.get("one_by_one") or kill:
        outputs = []
        for i, prompt in enumerate(prompts):
            if kill and i == kill[1]:
                os.kill(kill[0], signal.SIGKILL)
            outputs += llm.generate([prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
    wall = time.perf_counter() - began
    return {"ttft_s": ttft, "wall_s": wall, "outputs": [list(o.outputs[0].token_ids) for o in outputs],
            "stats": _connector_totals(), "metrics": _prometheus("vllm:kvfactory_"),
            "kvfactory_modules": sorted(name for name in sys.modules if name.startswith("kvfactory"))}


def _connector_totals() -> dict[str, Any] | None:
    """The tier chain's counters in this process (vLLM's CPU engine runs its worker in-process)."""
    from kvfactory.integrations import vllm as connector

    connector.flush_writes(timeout=300)  # saves are written off the steps: count them all
    chains = list(connector._CHAINS.values())
    return {tier.name: tier.stats.as_dict() for tier in chains[0].tiers} if chains else None


def _prometheus(prefix: str) -> dict[str, float]:
    """The samples named ``prefix...`` that vLLM's Prometheus logger exposes (on ``/metrics`` when
    served), summed over engines: ``name`` or, for per-tier and per-stage ones,
    ``name{stat="...",tier="..."}`` and ``name{stage="..."}``."""
    from prometheus_client import REGISTRY

    samples: dict[str, float] = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name.startswith(prefix):
                labels = sorted(sample.labels.items())
                kept = ",".join(f'{k}="{v}"' for k, v in labels if k in ("stage", "stat", "tier"))
                name = f"{sample.name}{{{kept}}}" if kept else sample.name
                samples[name] = samples.get(name, 0.0) + sample.value
    return samples


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(main(json.load(f))), flush=True)
