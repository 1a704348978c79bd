"""Decode speed of kvfactory dense and paged caches against DynamicCache, in the same run.

Protocol (DESIGN.md): SmolLM2-135M, fp32, CPU, ``torch.set_num_threads(1)``, greedy, prompts of
L in {2048, 6144} WikiText-2 tokens, 64 new tokens, batch 1 and 8, decode tokens/s excluding
prefill, median of >= 3 runs, ratio to DynamicCache measured in the same run.

Each batch row is a different WikiText window. The prompt is prefilled once through the model
(DynamicCache) and its keys/values are copied into every cache under test, so all configs decode
from identical states; runs of the configs are interleaved so machine noise hits them alike.
Prints JSON; also checks every config generates the same tokens as DynamicCache.

    python benchmarks/decode.py [--lengths 2048,6144] [--batches 1,8] [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvfactory import KVCacheFactory
from kvfactory.models import load_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2_test.txt"
CONFIGS = {
    "dense": {"type": "dense"},
    "paged16": {"type": "paged", "page_size": 16},
    "paged256": {"type": "paged", "page_size": 256},
}


def prompt_rows(tokenizer, length: int, batch: int) -> torch.Tensor:
    """``batch`` disjoint windows of ``length`` WikiText-2 tokens."""
    ids = tokenizer(DATA.read_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < length * batch:
        sys.exit(f"WikiText has {ids.numel()} tokens, {length * batch} needed")
    return ids[: length * batch].view(batch, length)


@torch.inference_mode()
def prefill(model, rows: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Keys/values per layer ``[batch, heads, L, dim]`` and the first greedy token of each row."""
    per_row, first = [], []
    for row in rows:
        cache = DynamicCache(config=model.config)
        out = model(row[None], past_key_values=cache, use_cache=True)
        per_row.append([(layer.keys, layer.values) for layer in cache.layers])
        first.append(out.logits[:, -1].argmax(-1))
    layers = [(torch.cat([r[i][0] for r in per_row]), torch.cat([r[i][1] for r in per_row]))
              for i in range(len(per_row[0]))]
    return layers, torch.stack(first)


def filled_cache(name: str, model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    cache = DynamicCache(config=model.config) if name == "dynamic" else \
        KVCacheFactory(model.config, CONFIGS[name]).create_cache()
    for layer_idx, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), layer_idx)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,6144")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    model, tokenizer = load_model()
    results = []
    for length in map(int, args.lengths.split(",")):
        for batch in map(int, args.batches.split(",")):
            torch.set_num_threads(2)  # the one-off prefill is not what is measured
            kv, first = prefill(model, prompt_rows(tokenizer, length, batch))
            torch.set_num_threads(1)
            names = ["dynamic", *CONFIGS]
            speeds: dict[str, list[float]] = {n: [] for n in names}
            tokens: dict[str, torch.Tensor] = {}
            for _ in range(args.runs):
                for name in names:
                    cache = filled_cache(name, model, kv)
                    speed, tokens[name] = decode(model, cache, first, args.new_tokens)
                    speeds[name].append(speed)
                    del cache
            base = statistics.median(speeds["dynamic"])
            row = {"prompt_tokens": length, "batch": batch, "new_tokens": args.new_tokens,
                   "runs": args.runs, "dynamic_tokens_per_s": round(base, 3)}
            for name in CONFIGS:
                med = statistics.median(speeds[name])
                row[name] = {"tokens_per_s": round(med, 3), "ratio_to_dynamic": round(med / base, 3),
                             "same_tokens": bool(torch.equal(tokens[name], tokens["dynamic"]))}
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    report = {"benchmark": "decode", "model": "SmolLM2-135M-Instruct (fp32, CPU)", "threads": 1,
              "torch": torch.__version__, "machine": platform.machine(), "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
