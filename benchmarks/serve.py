"""Serving throughput and latency: kvfactory's engine against sequential ``model.generate`` and
transformers' ``generate_batch``, on the same machine in the same run.

Workloads (token counts from WikiText-2 test, SmolLM2-135M fp32, CPU, one torch thread, greedy, EOS
ignored so every request generates its full ``max_tokens``):

- ``a``: 16 chats sharing a 1,024-token system prompt, each with its own 64-token question, 64 new
  tokens (prefix caching: the system prompt is prefilled once);
- ``b``: 8 prompts of 2,048 tokens, 64 new tokens;
- ``c``: 8 prompts of 6,144 tokens, 64 new tokens (``--new-tokens 256`` for the long-decode run);
- ``d``: 24 prompts of 128 to 4,096 tokens arriving at Poisson times (0.5/s), 8 in flight, 64 new
  tokens: through a server (``http:CONFIG`` for ``kvfactory serve``, ``http-compiled:CONFIG`` for it with
  ``--compile-step``, ``vllm``) or ``sequential``
  (each request starts at its arrival or when the one before it ends; TTFT from its arrival);
- ``e``: 32 prompts of 6,144 tokens, 128 new tokens, every system given the same 2 GiB of KV memory
  (the engine's ``pool_bytes``, vLLM's ``VLLM_CPU_KVCACHE_SPACE``): memory-bound, so plain pages and
  vLLM queue or preempt where int4 pages hold far more sequences at once.

Systems: ``engine:CONFIG`` (a kvfactory preset: ``paged16``, ``int4``, ``quest@0.125``, or a YAML config
file such as ``benchmarks/configs/oval_true_8.yaml``; mixed steps, the default) and
``engine-prefill-first:CONFIG`` (the engine's ``prefill_first`` scheduling: steps that prefill carry no
decode tokens, so decodes run as one batch), either with ``-no-prefix-cache`` after the kind
(``engine-prefill-first-no-prefix-cache:paged16``: every prompt token computed, as sequential computes them),
and either with ``-compiled`` last (the engine's ``compile_step``, compiled before the clock starts),
``sequential`` (``model.generate`` with ``DynamicCache``, one request after another) and
``generate_batch`` (transformers' continuous batching). Each reports wall time, throughput
(generated tokens / wall), time to first token p50/p99 (all requests arrive at t=0), inter-token
latency p50/p99, prefill tokens/s (prompt tokens over the time of steps that prefilled), decode
tokens/s (tokens generated in decode-only steps over their time: prefill excluded) and peak KV
bytes. Engine and sequential rows add the roofline (``kvfactory.roofline``, measured at the start of the
run on this core: the model's linear layers over a 512-token chunk, a streamed read of 1 GiB): the prefill
steps' FLOP rate and its ratio to that GEMM rate (``prefill_vs_gemm``), and for the engine the decode steps'
time at the read rate (the weights and the K/V the pool holds) over their time (``decode_vs_read_roofline``),
and at the slower of the read and the GEMM rate (``decode_vs_roofline``: a step of many sequences computes
as much as it reads).
``--scale`` shrinks every length for a quick look. ``--generate-batch-limit S`` runs
``generate_batch`` in a child process stopped after ``S`` seconds (then reported as ``wall_over_s``: a
lower bound, for a workload it would take an hour to finish). ``--repeat N`` runs every system N times
in alternating order (after an untimed run of the first, since a process's first engine run is slower)
and reports each system's run of median wall time with every run's wall and its ratio to the first
system's in the same round. Prints JSON (``--out FILE`` also writes it).

    python benchmarks/serve.py --workloads a,b --systems engine:paged16,engine:int4,sequential
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig

from kvfactory.cache import dynamic_cache_bytes
from kvfactory.engine import Engine, SamplingParams
from kvfactory.eval.runner import resolve_cache
from kvfactory.measure import cpu_model
from kvfactory.models import load_model
from kvfactory.roofline import ModelCost, gemm_rate, model_cost, read_rate

sys.path.insert(0, str(Path(__file__).parent))  # serve_http.py beside this file
HTTP_KINDS = ("http:", "http-compiled:")  # kvfactory serve: eager, --compile-step
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2_test.txt"
WORKLOADS = {"a": dict(system=1024, own=64, requests=16, new=64),
             "b": dict(system=0, own=2048, requests=8, new=64),
             "c": dict(system=0, own=6144, requests=8, new=64),
             "d": dict(system=0, own=(128, 4096), requests=24, new=64, concurrency=8, rate=0.5),
             "e": dict(system=0, own=6144, requests=32, new=128, kv_gib=2)}


def prompts_for(name: str, tokens: list[int], scale: float, new_tokens: int | None
                ) -> tuple[list[list[int]], int]:
    spec = WORKLOADS[name]
    rng = random.Random(0)
    system = int(spec["system"] * scale)
    prompts, at = [], system
    for _ in range(spec["requests"]):
        own = spec["own"]
        length = max(1, int((rng.randint(*own) if isinstance(own, tuple) else own) * scale))
        prompts.append(tokens[:system] + tokens[at:at + length])
        at += length
    return prompts, new_tokens or spec["new"]


def quantiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def summary(wall: float, generated: int, ttft: list[float], itl: list[float], prefill: tuple[int, float],
            decode: tuple[int, float], peak: int | None, roofline: Roofline | None = None,
            prefill_flops: float = 0.0, decode_bounds: tuple[float, float] = (0.0, 0.0)) -> dict[str, Any]:
    """A run's row; with ``roofline``, the prefill steps' FLOP rate over the measured GEMM rate, and the
    decode steps' time at the measured read rate, and at the slower of it and the GEMM rate
    (``decode_bounds``, seconds), over their time."""
    t50, t99 = quantiles(ttft)
    i50, i99 = quantiles(itl)
    row = {"wall_s": round(wall, 2), "throughput_tok_s": round(generated / wall, 2),
           "ttft_p50_s": round(t50, 3), "ttft_p99_s": round(t99, 3),
           "itl_p50_ms": round(i50 * 1e3, 1), "itl_p99_ms": round(i99 * 1e3, 1),
           "prefill_tok_s": round(prefill[0] / prefill[1], 1) if prefill[1] else None,
           "decode_tok_s": round(decode[0] / decode[1], 2) if decode[1] else None,
           "peak_kv_bytes": peak}
    if roofline is not None and prefill[1] and prefill_flops:
        rate = prefill_flops / prefill[1] / 1e9
        row |= {"prefill_gflop_s": round(rate, 1), "prefill_vs_gemm": round(rate / roofline.gemm_gflop_s, 3)}
    if roofline is not None and decode[1] and decode_bounds[0]:
        row |= {"decode_vs_read_roofline": round(decode_bounds[0] / decode[1], 3),
                "decode_vs_roofline": round(decode_bounds[1] / decode[1], 3)}
    return row


@dataclass(frozen=True)
class Roofline:
    """This core's measured ceilings (``kvfactory.roofline``) and the model's costs, for one run."""

    cost: ModelCost
    gemm_gflop_s: float  # the model's linear layers over a 512-token prefill chunk
    read_gb_s: float

    def step_flops(self, engine: Engine) -> float:
        """What the engine's last step computed: its tokens through the model, its logits."""
        return sum(self.cost.prefill_flops(*span) for span in engine.computed_spans) \
            + engine.logit_rows * self.cost.head_flops

    def decode_bounds(self, kv_bytes: int, flops: float) -> tuple[float, float]:
        """Seconds a decode step takes reading the weights and ``kv_bytes`` of K/V at the read rate, and
        at the slower of that and computing ``flops`` at the GEMM rate."""
        read = (self.cost.weight_bytes + kv_bytes) / self.read_gb_s / 1e9
        return read, max(read, flops / self.gemm_gflop_s / 1e9)


def run_engine(model: Any, tokenizer: Any, config: str, prompts: list[list[int]], new: int,
               prefill_first: bool = False, prefix_caching: bool | None = None,
               kv_gib: int | None = None, compile_step: bool = False, roofline: Roofline | None = None
               ) -> dict[str, Any]:
    """The engine over every prompt at t=0: a pool of ``kv_gib`` GiB, else one that holds them all.
    ``compile_step``: the compiled decode and prefill steps, compiled when the engine is made, before
    the clock starts (as vLLM compiles and warms up before it serves). A decode step must read the
    weights and the K/V the pool holds (a shared prompt's blocks once)."""
    spec = resolve_cache(config)
    if spec.config is None:
        raise SystemExit(f"engine:{config}: the engine takes a kvfactory config, not {spec.source}")
    total = sum(len(p) for p in prompts) + len(prompts) * new
    size = {"pool_tokens": total + 64 * len(prompts)} if kv_gib is None else {"pool_bytes": kv_gib * 2**30}
    engine = Engine(model, tokenizer, spec.config, **size,
                    max_num_batched_tokens=512, max_num_seqs=len(prompts), prefill_first=prefill_first,
                    prefix_caching=prefix_caching, compile_step=compile_step)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    prefill, decode, peak, used = [0, 0.0], [0, 0.0], 0, 0
    ttft, itl, last = [], [], {}
    generated, flops, bounds = 0, 0.0, [0.0, 0.0]
    while engine.has_unfinished():
        before = engine.metrics.prompt_tokens._value.get()
        began = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - began
        fed = engine.metrics.prompt_tokens._value.get() - before
        if fed:
            prefill[0] += fed
            prefill[1] += took
            if roofline is not None:
                flops += roofline.step_flops(engine)
        else:
            decode[0] += len(outputs)
            decode[1] += took
            if roofline is not None:
                read, bound = roofline.decode_bounds(used, roofline.step_flops(engine))
                bounds[0] += read
                bounds[1] += bound
        now = time.perf_counter()
        for output in outputs:
            generated += len(output.new_token_ids)
            if output.request_id in last:
                itl.append(now - last[output.request_id])
            else:
                ttft.append(now - start)
            last[output.request_id] = now
        used = engine.manager.pool.memory_report().used
        peak = max(peak, used)
    wall = time.perf_counter() - start
    result = summary(wall, generated, ttft, itl, (prefill[0], prefill[1]), (decode[0], decode[1]), peak,
                     roofline, flops, (bounds[0], bounds[1]))
    stats = engine.stats()
    result |= {"prompt_tokens_computed": int(engine.metrics.prompt_tokens._value.get()),
               "prefix_hit_tokens": int(engine.metrics.prefix_hits._value.get()),
               "preemptions": stats["preemptions"]}
    return result


class _Clock:
    """A ``generate`` streamer that timestamps each new token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def run_sequential(model: Any, prompts: list[list[int]], new: int, rate: float | None = None,
                   roofline: Roofline | None = None) -> dict[str, Any]:
    """One request after another; with ``rate``, each starts at its Poisson arrival or when the one
    before it ends, and its time to first token counts from its arrival."""
    from serve_http import arrival_times

    start = time.perf_counter()
    ttft, itl, prefill, decode, peak, generated = [], [], [0, 0.0], [0, 0.0], 0, 0
    for prompt, arrival in zip(prompts, arrival_times(len(prompts), rate), strict=True):
        time.sleep(max(0.0, start + arrival - time.perf_counter()))
        ids = torch.tensor([prompt])
        cache, clock = DynamicCache(config=model.config), _Clock()
        began = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, cache=cache, streamer=clock)
        ttft.append(clock.times[0] - start - arrival)
        itl += [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
        prefill[0] += len(prompt)
        prefill[1] += clock.times[0] - began
        decode[0] += len(clock.times) - 1
        decode[1] += clock.times[-1] - clock.times[0]
        generated += len(clock.times)
        peak = max(peak, dynamic_cache_bytes(cache))
    wall = time.perf_counter() - start
    flops = 0.0 if roofline is None else sum(roofline.cost.prefill_flops(0, len(p)) + roofline.cost.head_flops
                                             for p in prompts)
    return summary(wall, generated, ttft, itl, (prefill[0], prefill[1]), (decode[0], decode[1]), peak,
                   roofline, flops)


def run_generate_batch(prompts: list[list[int]], new: int) -> dict[str, Any]:
    model, _ = load_model(attention="sdpa")  # its own copy: generate_batch switches the attention
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config, record_timestamps=True)
    wall = time.perf_counter() - start
    generated = sum(len(r.generated_tokens) for r in results.values())
    return summary(wall, generated, [], [], (0, 0.0), (0, 0.0), None)


def run_generate_batch_limited(name: str, scale: float, new_tokens: int | None, limit: float
                                ) -> dict[str, Any]:
    """``generate_batch`` on workload ``name`` in a child run of this script, killed after ``limit``
    seconds: its row, or ``wall_over_s`` when it had not finished."""
    command = [sys.executable, __file__, "--workloads", name, "--systems", "generate_batch",
               "--scale", str(scale)]
    if new_tokens:
        command += ["--new-tokens", str(new_tokens)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, check=True)
    except subprocess.TimeoutExpired:
        return {"wall_s": None, "wall_over_s": limit}
    row = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"workload"')))
    return {key: value for key, value in row.items() if key not in ("workload", "system")}


def run_http(system: str, prompts: list[list[int]], new: int, spec: dict[str, Any]) -> dict[str, Any]:
    """``http:PRESET`` (``kvfactory serve``; ``http-compiled:PRESET`` with ``--compile-step``) or ``vllm``
    (its CPU build), all requests at t=0 or at
    the workload's Poisson rate, streamed; the server's own log goes to a temporary file."""
    from serve_http import run_clients, start_kvfactory, start_vllm

    from kvfactory.models import converted_model_dir

    concurrency = spec.get("concurrency", len(prompts))
    log = Path(tempfile.mkdtemp()) / "server.log"
    if system == "vllm":
        server = start_vllm(converted_model_dir(), log, concurrency, kv_gib=spec.get("kv_gib", 4))
    else:
        pool = sum(len(p) for p in prompts) + len(prompts) * (new + 64)
        kind, preset = system.split(":", 1)
        server = start_kvfactory(preset, pool, concurrency, log, compile_step=kind == "http-compiled")
    try:
        run = run_clients(server.url, prompts, new, concurrency, spec.get("rate"))
    finally:
        server.stop()
    return summary(run["wall"], run["generated"], run["ttft"], run["itl"], (0, 0.0), run["decode"], None)


def run_system(system: str, name: str, prompts: list[list[int]], new: int, args: argparse.Namespace,
               model: Any, tokenizer: Any, roofline: Roofline | None) -> dict[str, Any] | None:
    """One run of ``system`` on workload ``name``; None where the workload does not apply to it."""
    timed = system.startswith(HTTP_KINDS) or system in ("vllm", "sequential")
    if "rate" in WORKLOADS[name] and not timed and system != "generate_batch":
        return None  # arrivals over time: through a server, or one by one as they arrive
        # (generate_batch has no arrivals: it gets every prompt at t=0, which favours it)
    if system.startswith("engine"):
        kind, config = system.split(":", 1)
        base = kind.removesuffix("-compiled").removesuffix("-no-prefix-cache")
        if base not in ("engine", "engine-prefill-first"):
            raise SystemExit(f"unknown system {system!r}")
        return run_engine(model, tokenizer, config, prompts, new,
                          prefill_first=base == "engine-prefill-first",
                          prefix_caching=False if "-no-prefix-cache" in kind else None,
                          kv_gib=WORKLOADS[name].get("kv_gib"), compile_step=kind.endswith("-compiled"),
                          roofline=roofline)
    if system == "sequential":
        return run_sequential(model, prompts, new, WORKLOADS[name].get("rate"), roofline)
    if system == "generate_batch" and args.generate_batch_limit:
        return run_generate_batch_limited(name, args.scale, args.new_tokens, args.generate_batch_limit)
    if system == "generate_batch":
        return run_generate_batch(prompts, new)
    if system.startswith(HTTP_KINDS) or system == "vllm":
        return run_http(system, prompts, new, WORKLOADS[name])
    raise SystemExit(f"unknown system {system!r}")


def median_run(results: list[dict[str, Any]], first: list[dict[str, Any]]) -> dict[str, Any]:
    """A system's runs as one row: the run of median wall time (the lower of the middle two), with every
    run's wall time and, for several runs, each run's wall over the first system's in the same round
    and their median (``wall_vs_first``)."""
    if len(results) == 1 or any(r["wall_s"] is None for r in results):
        return results[0]
    walls = [r["wall_s"] for r in results]
    row = {**sorted(results, key=lambda r: r["wall_s"])[(len(results) - 1) // 2], "wall_runs_s": walls}
    if len(first) == len(results) and all(r["wall_s"] for r in first):
        ratios = [round(w / r["wall_s"], 3) for w, r in zip(walls, first, strict=True)]
        row["wall_vs_first"] = {"runs": ratios, "median": statistics.median(ratios)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="a,b,c")
    parser.add_argument("--systems",
                        default="engine:paged16,engine:int4,engine:quest@0.125,sequential,generate_batch")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length")
    parser.add_argument("--new-tokens", type=int, default=None, help="override each workload's new tokens")
    parser.add_argument("--generate-batch-limit", type=float, default=None,
                        help="seconds before a generate_batch run (in a child process) is stopped")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of every system, in alternating order after an untimed run of the first")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    tokens = tokenizer(DATA.read_text()[:1_000_000])["input_ids"]  # (e) takes 196,608 of them
    report: dict[str, Any] = {"benchmark": "serve", "date": time.strftime("%Y-%m-%d"), "threads": 1,
                              "cpu": cpu_model(), "scale": args.scale,
                              "workloads": {}}
    systems = args.systems.split(",")
    roofline = None
    if any(system.startswith("engine") or system == "sequential" for system in systems):
        roofline = Roofline(model_cost(model), gemm_rate(model, rows=512), read_rate())
        report["roofline"] = {"gemm_gflop_s_512_rows": round(roofline.gemm_gflop_s, 1),
                              "read_gb_s": round(roofline.read_gb_s, 2),
                              "weights_mb": round(roofline.cost.weight_bytes / 1e6, 1)}
    for name in args.workloads.split(","):
        prompts, new = prompts_for(name, tokens, args.scale, args.new_tokens)
        rows = report["workloads"][name] = {"requests": len(prompts), "prompt_tokens": len(prompts[0]),
                                            "new_tokens": new, "systems": {}}
        runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
        with torch.inference_mode():
            if args.repeat > 1:  # untimed: a process's first engine run is slower than later ones
                run_system(systems[0], name, prompts, new, args, model, tokenizer, roofline)
            for round_ in range(args.repeat):  # alternating order, so no system always runs first
                for system in systems if round_ % 2 == 0 else systems[::-1]:
                    result = run_system(system, name, prompts, new, args, model, tokenizer, roofline)
                    if result is not None:
                        runs[system].append(result)
                        print(json.dumps({"workload": name, "system": system, **result}), flush=True)
        for system, results in runs.items():
            first = runs[systems[0]] if system != systems[0] else []
            if results:
                rows["systems"][system] = median_run(results, first)
        base = rows["systems"].get("sequential")
        if base:
            for result in rows["systems"].values():
                if result["wall_s"] is None:
                    continue
                result["wall_vs_sequential"] = round(result["wall_s"] / base["wall_s"], 3)
                if result["decode_tok_s"] and base["decode_tok_s"]:
                    result["decode_vs_sequential"] = round(result["decode_tok_s"] / base["decode_tok_s"], 2)
                if result["prefill_tok_s"] and base["prefill_tok_s"]:
                    ratio = result["prefill_tok_s"] / base["prefill_tok_s"]
                    result["prefill_vs_sequential"] = round(ratio, 2)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
