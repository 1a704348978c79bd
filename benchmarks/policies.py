"""Bounded memory with eviction policies: a long generation under a token budget, and a chunked prefill.

Two measurements on SmolLM2 (fp32, CPU, 1 thread, paged storage with 16-token pages), printed as JSON:

- ``decode``: greedy generation of ``--new-tokens`` tokens after a WikiText prompt with a
  ``--budget`` of tokens per layer, per decode-capable policy. Reports the KV bytes held after
  generation against the budget's bytes plus one page per layer (the bound: evictions come a page
  at a time), and tokens/s per segment of ``--segment`` tokens; DynamicCache, whose cache grows,
  is measured in the same run as the baseline (``speed_last_over_first`` is the last segment's
  speed over the first).
- ``prefill``: a ``--prompt``-token WikiText prompt fed in ``--chunk``-token chunks into a cache
  with the same budget; reports the peak KV bytes (``peak_allocated``, the most each layer held
  before an eviction) against (budget + chunk) tokens plus one page per layer, and against the
  whole prompt's bytes.

    python benchmarks/policies.py [--part decode,prefill] [--new-tokens 8192] [--budget 1024]
        [--policies streaming_llm,window,h2o,tova,knorm] [--prompt 6144] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import torch
from decode import DATA
from rich.console import Console
from rich.progress import Progress
from transformers import DynamicCache

from kvfactory import KVCacheFactory
from kvfactory.models import load_model
from kvfactory.prefill import prefill_in_chunks

PAGE = 16


def config(policy: str, budget: int) -> dict[str, Any]:
    return {"type": "composite", "strategies": [{"name": "paged", "page_size": PAGE},
                                                {"name": "eviction", "policy": policy, "budget": budget}]}


def token_bytes(model) -> int:
    """fp32 K+V bytes of one token in one layer."""
    cfg = model.config
    return 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4


def kv_bytes(cache) -> int:
    if hasattr(cache, "memory_report"):
        return int(cache.memory_report()["allocated"])
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@torch.inference_mode()
def generate_timed(model, prompt: torch.Tensor, cache, new_tokens: int, segment: int, progress,
                   task) -> list[float]:
    """Greedy decode; tokens/s of each ``segment`` of generated tokens."""
    token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
    speeds, start = [], time.perf_counter()
    for step in range(1, new_tokens + 1):
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        progress.advance(task)
        if step % segment == 0:
            now = time.perf_counter()
            speeds.append(round(segment / (now - start), 3))
            start = now
    return speeds


def bounded_decode(model, tokenizer, args) -> dict[str, Any]:
    prompt = tokenizer(DATA.read_text(), return_tensors="pt").input_ids[:, :args.decode_prompt]
    per_token, layers = token_bytes(model), model.config.num_hidden_layers
    bound = (args.budget + PAGE) * per_token * layers
    rows: dict[str, Any] = {"budget_tokens": args.budget, "new_tokens": args.new_tokens,
                            "prompt_tokens": prompt.shape[1], "bound_bytes": bound}
    makers = {"dynamic": lambda: DynamicCache(config=model.config)}
    makers |= {p: KVCacheFactory(model.config, config(p, args.budget)).create_cache for p in args.policies}
    with Progress(console=Console(stderr=True)) as progress:  # stdout carries the JSON
        for name, make in makers.items():
            task = progress.add_task(f"decode {name}", total=args.new_tokens)
            cache = make()
            speeds = generate_timed(model, prompt, cache, args.new_tokens, args.segment, progress, task)
            held = kv_bytes(cache)
            rows[name] = {"kv_bytes": held, "within_bound": held <= bound, "tokens_per_s_by_segment": speeds,
                          "speed_last_over_first": round(speeds[-1] / speeds[0], 3) if speeds else None}
    return rows


def chunked_prefill(model, tokenizer, args) -> dict[str, Any]:
    prompt = tokenizer(DATA.read_text(), return_tensors="pt").input_ids[:, :args.prompt]
    per_token, layers = token_bytes(model), model.config.num_hidden_layers
    rows: dict[str, Any] = {"prompt_tokens": prompt.shape[1], "budget_tokens": args.budget,
                            "chunk": args.chunk,
                            "bound_bytes": (args.budget + args.chunk + PAGE) * per_token * layers,
                            "whole_prompt_bytes": prompt.shape[1] * per_token * layers}
    for policy in args.prefill_policies:
        cache = KVCacheFactory(model.config, config(policy, args.budget)).create_cache()
        start = time.perf_counter()
        prefill_in_chunks(model, prompt, cache, chunk_size=args.chunk)
        report = cache.memory_report()
        peak = report["peak_allocated"]
        rows[policy] = {"peak_bytes": int(peak), "bytes_after": int(report["allocated"]),
                        "within_bound": peak <= rows["bound_bytes"],
                        "peak_over_whole_prompt": round(peak / rows["whole_prompt_bytes"], 4),
                        "seconds": round(time.perf_counter() - start, 1)}
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="decode,prefill")
    parser.add_argument("--new-tokens", type=int, default=8192)
    parser.add_argument("--segment", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--decode-prompt", type=int, default=1024)
    parser.add_argument("--policies", default="streaming_llm,window,h2o,tova,knorm")
    parser.add_argument("--prefill-policies", default="snapkv,streaming_llm,h2o")
    parser.add_argument("--prompt", type=int, default=6144)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    args.prefill_policies = [p for p in args.prefill_policies.split(",") if p]
    torch.set_num_threads(1)
    model, tokenizer = load_model(attention="kvfactory")
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": 1}
    parts = args.part.split(",")
    if "prefill" in parts:
        result["prefill"] = chunked_prefill(model, tokenizer, args)
    if "decode" in parts:
        result["decode"] = bounded_decode(model, tokenizer, args)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
