"""Page metadata a sparse-read cache holds beside its K/V, per page and KV head, against Quest's.

Each config's cache takes a prompt of ``--tokens`` random K/V then ``--steps`` decode steps through
``KVCache.update`` (the bytes do not depend on the values, so no forward runs); its metadata is
``memory_report()["allocated"]`` less that of the same 16-token paged storage read whole, over the
routed layers' pages times KV heads. Growth headroom is included, as the report counts it. The target
(docs/sparse-reads.md): a learned router holds at most half of Quest's bytes.

    python benchmarks/page_metadata.py [--model smollm2|gemma3-270m] [--tokens 6144] [CONFIG.yaml ...]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import yaml

from kvfactory import KVCacheFactory
from kvfactory.measure import cpu_model
from kvfactory.models import load_config

CONFIGS = Path(__file__).resolve().parent / "configs"
PLAIN = {"type": "composite", "strategies": [{"name": "paged", "page_size": 16}]}


def allocated(model_config: object, cache_config: dict, tokens: int, steps: int) -> tuple[int, int, int]:
    """Bytes the cache holds after the prompt and the steps; its layers and the routed ones."""
    cache = KVCacheFactory(model_config, cache_config).create_cache()
    text = model_config.get_text_config(decoder=True)
    heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    for n in [tokens] + [1] * steps:
        for i in range(len(cache.layers)):
            k, v = (torch.randn(1, heads, n, head_dim, generator=generator) for _ in range(2))
            cache.update(k, v, i)
    routed = sum(bool(getattr(layer.store, "routed", False)) for layer in cache.layers)
    return cache.memory_report()["allocated"], routed, heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", type=Path, default=[CONFIGS / f"{name}_true_8.yaml" for name in
                                                                   ("quest", "oval", "oval_gate")])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    model_config = load_config(args.model)
    plain, _, _ = allocated(model_config, PLAIN, args.tokens, args.steps)
    pages = math.ceil((args.tokens + args.steps) / 16)
    rows = {}
    for path in args.configs:
        config = yaml.safe_load(path.read_text())
        held, routed, heads = allocated(model_config, config, args.tokens, args.steps)
        rows[path.stem] = {"metadata_bytes": held - plain, "routed_layers": routed,
                           "bytes_per_page_and_kv_head": round((held - plain) / (routed * pages * heads), 1)}
    quest = next((row for name, row in rows.items() if name.startswith("quest")), None)
    for row in rows.values():
        if quest is not None:
            row["x_quest"] = round(row["metadata_bytes"] / quest["metadata_bytes"], 3)
    print(json.dumps({"benchmark": "page_metadata", "model": args.model, "tokens": args.tokens,
                      "steps": args.steps, "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"),
                      "configs": rows}, indent=1))


if __name__ == "__main__":
    main()
