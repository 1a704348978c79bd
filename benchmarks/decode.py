"""Decode speed of kvfactory dense and paged caches against DynamicCache, in the same run.

Protocol (docs/evaluation.md): SmolLM2-135M, fp32, CPU, ``torch.set_num_threads(1)``, greedy, prompts of
L in {2048, 6144} WikiText-2 tokens, 64 new tokens, batch 1 and 8, decode tokens/s excluding
prefill, median of >= 3 runs, ratio to DynamicCache measured in the same run.

Each batch row is a different WikiText window. The prompt is prefilled once through the model
(DynamicCache) and its keys/values are copied into every cache under test, so all configs decode
from identical states; runs of the configs are interleaved so machine noise hits them alike.
Prints JSON; also reports whether every config generates the same tokens as DynamicCache (and for
how many leading tokens), and the KV bytes each holds after decoding. ``no_kv_floor`` is the same
decode from a DynamicCache holding only 16 tokens: the model's own cost per step, which bounds
what any cache can reach. ``benchmarks/quant.py`` runs the same measurement on quantized configs
and transformers' ``QuantizedCache``.

    python benchmarks/decode.py [--lengths 2048,6144] [--batches 1,8] [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvfactory import KVCacheFactory
from kvfactory.eval.peers import is_peer, peer_footprint, peer_maker
from kvfactory.measure import cpu_model
from kvfactory.models import EMBEDDED, load_model
from kvfactory.sizing import kv_bytes

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2_test.txt"
CONFIGS = {
    "dense": {"type": "dense"},
    "paged16": {"type": "paged", "page_size": 16},
    "paged256": {"type": "paged", "page_size": 256},
}


@dataclass(frozen=True)
class WithAttention:
    """A config decoded with another ``attn_implementation`` than SDPA (e.g. ``"kvfactory"``)."""

    config: dict[str, Any] | str
    attention: str


Config = dict[str, Any] | str | WithAttention


FLOOR_TOKENS = 16  # ``no_kv_floor``: DynamicCache holding this many tokens, the speed no cache can beat
WARMUP_STEPS = 4  # untimed decode steps per config first (torch.compile builds kvfactory's kernels)


def prompt_rows(tokenizer, length: int, batch: int) -> torch.Tensor:
    """``batch`` disjoint windows of ``length`` WikiText-2 tokens."""
    ids = tokenizer(DATA.read_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < length * batch:
        sys.exit(f"WikiText has {ids.numel()} tokens, {length * batch} needed")
    return ids[: length * batch].view(batch, length)


@dataclass
class Prefilled:
    """The prompt's keys/values per layer ``[batch, heads, L, dim]``, the first greedy token of each
    row and the decoder's last hidden state ``[batch, hidden]`` (what OVAL routes the first step from)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    first: torch.Tensor
    hidden: torch.Tensor


@torch.inference_mode()
def prefill(model, rows: torch.Tensor) -> Prefilled:
    per_row, first, hidden = [], [], []
    def keep_last(module, args, out) -> None:
        hidden.append(out.last_hidden_state[:, -1].clone())

    hook = model.get_decoder().register_forward_hook(keep_last)
    try:
        for row in rows:
            # every layer keeps every token; a sliding layer filled from it keeps its window
            cache = DynamicCache()
            out = model(row[None], past_key_values=cache, use_cache=True)
            per_row.append([(layer.keys, layer.values) for layer in cache.layers])
            first.append(out.logits[:, -1].argmax(-1))
    finally:
        hook.remove()
    layers = [(torch.cat([r[i][0] for r in per_row]), torch.cat([r[i][1] for r in per_row]))
              for i in range(len(per_row[0]))]
    return Prefilled(layers, torch.stack(first), torch.cat(hidden))


def cache_maker(model, config: Config) -> Callable[[], Any]:
    """Fresh caches of a kvfactory config, or of a transformers peer named as in ``kvfactory eval``."""
    if isinstance(config, WithAttention):
        config = config.config
    if isinstance(config, str) and is_peer(config):
        return peer_maker(config, model)
    return KVCacheFactory(model.config, config).create_cache


def held_bytes(cache) -> dict[str, float]:
    """KV bytes a cache holds; for kvfactory caches also the full-precision residual window."""
    if not hasattr(cache, "memory_report"):
        return {"bytes": peer_footprint(cache).bytes}
    report = cache.memory_report()
    held = {"bytes": report["allocated"]}
    if "residual" in report:
        held |= {"residual_bytes": report["residual"], "residual_tokens": report["residual_tokens"],
                 "tokens_stored": report["tokens_stored"], "workspace_bytes": report["workspace"]}
    if getattr(cache, "routing", None) is not None:  # page selectors: what decode read, router cost
        routing = cache.routing_metrics()
        split = ("token", "always", "selected", "whole")  # tokens read, and its parts
        held |= {f"{part}_read_fraction": routing[f"{part}_read_fraction"] for part in split}
        held |= {"read_fraction": routing["read_fraction"], "recall": routing["recall"],
                 "index_bytes_per_step": routing["index_bytes_read_per_step"],
                 "router_p50_ms": routing["router_latency_p50_ms"],
                 "router_p99_ms": routing["router_latency_p99_ms"]}
    return held


def filled_cache(make_cache: Callable[[], Any], kv: list[tuple[torch.Tensor, torch.Tensor]],
                 hidden: torch.Tensor | None = None):
    cache = make_cache()
    for layer_idx, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), layer_idx)
    if getattr(cache, "routing_context", None) is not None:  # as if the prompt had run through it
        cache.routing_context.hidden = hidden
    return cache


@torch.inference_mode()
def decode(model, cache, first: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """Greedy decode ``steps`` tokens; returns (tokens/s over all rows, generated tokens)."""
    token, out = first, [first]
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(token, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        out.append(token)
    elapsed = time.perf_counter() - start
    return steps * first.shape[0] / elapsed, torch.cat(out, dim=1)


def same_prefix(tokens: torch.Tensor, reference: torch.Tensor) -> int:
    """Leading generated tokens equal to the reference's in every row."""
    differs = (tokens != reference).any(0).nonzero()
    return int(differs[0, 0]) if differs.numel() else tokens.shape[1]


def measure(model, tokenizer, configs: dict[str, Config], length: int, batch: int, runs: int,
            new_tokens: int) -> dict[str, Any]:
    """One (length, batch) point: every config's decode speed, ratio to DynamicCache, tokens and bytes."""
    torch.set_num_threads(2)  # the one-off prefill is not what is measured
    prefilled = prefill(model, prompt_rows(tokenizer, length, batch))
    kv, first = prefilled.kv, prefilled.first
    torch.set_num_threads(1)
    makers = {"dynamic": lambda: DynamicCache(config=model.config)}
    makers |= {name: cache_maker(model, config) for name, config in configs.items()}
    makers["no_kv_floor"] = makers["dynamic"]  # the model's own cost: a cache of FLOOR_TOKENS tokens
    speeds: dict[str, list[float]] = {n: [] for n in makers}
    tokens: dict[str, torch.Tensor] = {}
    held: dict[str, dict[str, float]] = {}
    attentions = {n: c.attention if isinstance(c, WithAttention) else "sdpa" for n, c in configs.items()}
    for name, make in makers.items():  # warm-up: compiled kernels build here, not in a timed run
        model.set_attn_implementation(attentions.get(name, "sdpa"))
        decode(model, filled_cache(make, kv, prefilled.hidden), first, WARMUP_STEPS)
    for _ in range(runs):
        for name, make in makers.items():
            model.set_attn_implementation(attentions.get(name, "sdpa"))
            cache = filled_cache(make, kv if name != "no_kv_floor" else
                                 [(k[:, :, -FLOOR_TOKENS:], v[:, :, -FLOOR_TOKENS:]) for k, v in kv],
                                 prefilled.hidden)
            speed, tokens[name] = decode(model, cache, first, new_tokens)
            speeds[name].append(speed)
            held[name] = held_bytes(cache)
            del cache
    model.set_attn_implementation("sdpa")
    base = statistics.median(speeds["dynamic"])
    cached = batch * (length + new_tokens)
    row = {"prompt_tokens": length, "batch": batch, "new_tokens": new_tokens, "runs": runs,
           "dynamic_tokens_per_s": round(base, 3), "dynamic_bytes": held["dynamic"]["bytes"],
           "fp16_dense_bytes": kv_bytes(model.config, cached, dtype="fp16"),
           "no_kv_floor_tokens_per_s": round(statistics.median(speeds["no_kv_floor"]), 3),
           "no_kv_floor_ratio_to_dynamic": round(statistics.median(speeds["no_kv_floor"]) / base, 3)}
    for name in configs:
        med = statistics.median(speeds[name])
        row[name] = {"tokens_per_s": round(med, 3), "ratio_to_dynamic": round(med / base, 3),
                     "same_tokens": bool(torch.equal(tokens[name], tokens["dynamic"])),
                     "same_prefix": same_prefix(tokens[name], tokens["dynamic"]),
                     "bytes_ratio_to_fp16": round(held[name]["bytes"] / row["fp16_dense_bytes"], 4),
                     **held[name]}
        if "router_p99_ms" in held[name]:  # the router's p50 / p99 against one decode step (all rows)
            step_s = batch / med
            for q in ("p50", "p99"):
                row[name][f"router_{q}_share_of_step"] = round(held[name][f"router_{q}_ms"] / 1e3 / step_s, 4)
    return row


def run(configs: dict[str, Config], name: str, argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the command line, measure every (length, batch) point, print and return the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,6144")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--configs", help=f"comma-separated subset of {','.join(configs)}")
    parser.add_argument("--model", default=EMBEDDED, help="a packaged model's short name (smollm2, "
                        "gemma3-270m) or a local folder / hub id")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.configs:
        unknown = set(args.configs.split(",")) - set(configs)
        if unknown:
            sys.exit(f"--configs: unknown {sorted(unknown)}; choose from {','.join(configs)}")
        configs = {n: configs[n] for n in args.configs.split(",")}

    model, tokenizer = load_model(args.model)
    results = []
    for length in map(int, args.lengths.split(",")):
        for batch in map(int, args.batches.split(",")):
            results.append(measure(model, tokenizer, configs, length, batch, args.runs, args.new_tokens))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    report = {"benchmark": name, "model": f"{args.model} (fp32, CPU)", "threads": 1,
              "torch": torch.__version__, "machine": platform.machine(), "cpu": cpu_model(),
              "configs": {n: vars(c) if isinstance(c, WithAttention) else c for n, c in configs.items()},
              "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    run(CONFIGS, "decode")
