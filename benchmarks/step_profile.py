"""Where an engine step's time goes: linear layers, the attention kernel, the rest.

``--sequences`` prompts of ``--tokens`` tokens each (the shipped WikiText excerpt), prefilled first,
then ``--steps`` decode steps of all of them at once over the preset ``--config``, profiled with
``torch.profiler`` on one thread, with the engine's packed weights (``Engine(pack_weights=True)``, the
default) and without them, and with ``--compiled`` the compiled step too (``Engine(compile_step=True)``).
Linear layers are the time in ``aten::mm``, oneDNN's linear and the engine's panels (``panel_linear``);
the attention kernel is the engine's ``paged_decode`` / ``quantized_decode`` calls (both wrapped in a
``record_function`` here) or the compiled step's ``kvfactory::paged_decode_step`` or
``kvfactory::quantized_decode_step`` op (with its write); the rest is the model's other operations and
the engine's Python. Also prints the bytes a step must read (weights and K/V as the pool stores them)
and the rate that implies. With ``--prefill`` the prefill steps (512-token chunks) are profiled
instead: the attention kernel is then ``kvfactory.attention.causal_chunk`` (eager) or the compiled
step's ``kvfactory::paged_prefill_step``, and the FLOP rates of the step, its linear layers and its
attention are printed beside the machine's GEMM rate over 512 rows (``kvfactory.roofline``): medians
of ``--runs`` prefills per engine, the engines taking turns. Prints JSON.

    python benchmarks/step_profile.py [--sequences 8] [--tokens 2048] [--steps 10] [--config paged16]
        [--compiled] [--prefill [--runs 3]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvfactory import attention, roofline
from kvfactory.engine import Engine, SamplingParams, batch, weights
from kvfactory.measure import cpu_model
from kvfactory.models import load_model
from kvfactory.presets import load_preset
from kvfactory.texts import shipped_text

LINEAR_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "panel_linear",
              "kvfactory::panel_linear")
KERNEL_OPS = ("paged_decode", "quantized_decode", "kvfactory::paged_decode_step",
              "kvfactory::quantized_decode_step")  # the last two: compiled
PREFILL_KERNEL_OPS = ("causal_chunk", "kvfactory::paged_prefill_step")  # eager, compiled


def _recorded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)
    return wrapped


def _engine(model: Any, tokenizer: Any, config: dict, sequences: int, pack_weights: bool,
            compile_step: bool) -> Engine:
    return Engine(model, tokenizer, config, max_num_batched_tokens=512, max_num_seqs=sequences,
                  prefill_first=True, prefix_caching=False, pack_weights=pack_weights,
                  compile_step=compile_step)


def profile_prefill(engine: Engine, prompts: list[list[int]], flops: int, linear_flops: int,
                    gemm: float) -> dict[str, float]:
    """``prompts`` prefilled by ``engine`` in 512-token steps, profiled: per-step times and FLOP rates
    (``flops``: the prefill's, ``linear_flops`` of them in linear layers; ``gemm``: the machine's GEMM
    rate, GFLOP/s)."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        seconds = time.perf_counter() - start
    events = {e.key: e for e in prof.key_averages()}
    linear = sum(events[k].self_cpu_time_total for k in LINEAR_OPS if k in events) / 1e6
    kernel = sum(events[k].cpu_time_total for k in PREFILL_KERNEL_OPS if k in events) / 1e6
    return {"step_ms": seconds / steps * 1e3, "linear_ms": linear / steps * 1e3,
            "attention_kernel_ms": kernel / steps * 1e3,
            "tokens_per_s": sum(len(p) for p in prompts) / seconds,
            "gflop_s": flops / seconds / 1e9, "vs_gemm": flops / seconds / 1e9 / gemm,
            "linear_gflop_s": linear_flops / linear / 1e9,
            "attention_gflop_s": (flops - linear_flops) / kernel / 1e9}


def prefill_runs(model: Any, tokenizer: Any, config: dict, prompts: list[list[int]], compiled: bool,
                 runs: int) -> dict[str, Any]:
    """``profile_prefill`` of engines with the model's weights, packed weights and (``compiled``) the
    compiled steps, taking turns ``runs`` times after an unprofiled prefill each; each one's medians."""
    kinds = {"model_weights": (False, False), "packed_weights": (True, False)}
    if compiled:
        kinds["compiled_step"] = (True, True)
    engines = {name: _engine(model, tokenizer, config, len(prompts), *kind) for name, kind in kinds.items()}
    for engine in engines.values():
        engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    gemm = roofline.gemm_rate(model)
    cost = roofline.model_cost(model)
    flops = sum(cost.prefill_flops(0, len(prompt)) for prompt in prompts)
    linear_flops = cost.linear_flops * sum(len(prompt) for prompt in prompts)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for _ in range(runs):
        for name, engine in engines.items():
            results[name].append(profile_prefill(engine, prompts, flops, linear_flops, gemm))
    return {"gemm_gflop_s_512_rows": round(gemm, 1), "runs": runs,
            **{name: {key: round(statistics.median(r[key] for r in rows), 3 if key == "vs_gemm" else 1)
                      for key in rows[0]} for name, rows in results.items()}}


def profile_steps(model: Any, tokenizer: Any, config: dict, prompts: list[list[int]], steps: int,
                  weight_bytes: int, pack_weights: bool, compile_step: bool = False) -> dict[str, float]:
    engine = _engine(model, tokenizer, config, len(prompts), pack_weights, compile_step)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while any(not request.decoding for request in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    kv = engine.manager.pool.memory_report().used  # the K/V a step reads: every sequence's, as stored
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step = (time.perf_counter() - start) / steps
    events = {e.key: e for e in prof.key_averages()}
    linear = sum(events[k].self_cpu_time_total for k in LINEAR_OPS if k in events) / 1e3 / steps
    kernel = sum(events[k].cpu_time_total for k in KERNEL_OPS if k in events)
    return {"step_ms": round(step * 1e3, 1), "linear_ms": round(linear, 1),
            "attention_kernel_ms": round(kernel / 1e3 / steps, 1),
            "profiled_step_ms": round(sum(e.self_cpu_time_total for e in events.values()) / 1e3 / steps, 1),
            "kv_mb_per_step": round(kv / 1e6, 1), "read_gb_per_s": round((weight_bytes + kv) / step / 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--config", default="paged16")
    parser.add_argument("--compiled", action="store_true", help="also the compiled step (compile_step)")
    parser.add_argument("--prefill", action="store_true", help="profile the prefill steps instead")
    parser.add_argument("--runs", type=int, default=3, help="--prefill: profiled prefills per engine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    attention.causal_chunk = _recorded("causal_chunk", attention.causal_chunk)
    batch.paged_decode = _recorded("paged_decode", batch.paged_decode)
    batch.quantized_decode = _recorded("quantized_decode", batch.quantized_decode)
    weights.panel_linear = _recorded("panel_linear", weights.panel_linear)
    model, tokenizer = load_model()
    ids = tokenizer(shipped_text())["input_ids"]
    n, length = args.sequences, args.tokens
    if n * length > len(ids):
        raise SystemExit(f"the shipped text holds {len(ids)} tokens, fewer than {n} x {length}")
    prompts = [ids[i * length:(i + 1) * length] for i in range(n)]
    config = load_preset(args.config)
    weight_bytes = sum(p.nbytes for p in model.parameters())  # what a step reads of the model's own weights
    if args.prefill:
        runs = prefill_runs(model, tokenizer, config, prompts, args.compiled, args.runs)
    else:
        run = (model, tokenizer, config, prompts, args.steps, weight_bytes)
        runs = {"model_weights": profile_steps(*run, False), "packed_weights": profile_steps(*run, True)}
        if args.compiled:
            runs["compiled_step"] = profile_steps(*run, True, True)
    print(json.dumps({"cpu": cpu_model(), "threads": 1, "sequences": n, "tokens": length,
                      "config": args.config, "weights_mb": round(weight_bytes / 1e6, 1), **runs}, indent=1))


if __name__ == "__main__":
    main()
