"""Fragmentation of paged KV storage under a mixed-length workload, printed as JSON.

``--sequences`` sequences with prompt lengths drawn uniformly from ``--min``..``--max`` tokens
(seeded) are written into one ``KVCacheManager`` pool (16-token pages, SmolLM2's K/V shapes, fp32).
The waste is the allocated KV bytes no token uses, from ``memory_report()`` (``allocated - used``),
as a share of allocated bytes; the baseline is a contiguous cache preallocated at ``--max`` tokens
per sequence (what a static cache reserves). ``pool_allocated`` is the whole pool, free blocks
included (a growable pool grows by a quarter; a sized one is set with ``pool_tokens``). The share is
the same in every layer, so ``--layers`` of SmolLM2's 30 are written (memory stays small).

    python benchmarks/fragmentation.py [--sequences 64] [--min 32] [--max 4096] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import random

import torch
from rich.console import Console
from rich.progress import track

from kvfactory import KVCacheManager
from kvfactory.models import load_config

PAGE = 16
STDERR = Console(stderr=True)  # progress apart from the JSON on stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--min", type=int, default=32)
    parser.add_argument("--max", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = load_config()
    config.num_hidden_layers = args.layers
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    lengths = [random.Random(f"{args.seed}/{i}").randint(args.min, args.max) for i in range(args.sequences)]
    manager = KVCacheManager(config, {"type": "paged", "page_size": PAGE})
    allocated = used = 0
    for i, length in enumerate(track(lengths, description="writing sequences", console=STDERR)):
        cache = manager.create(f"s{i}")
        for layer in range(args.layers):
            cache.append(layer, torch.zeros(1, heads, length, dim), torch.zeros(1, heads, length, dim))
        report = cache.memory_report()
        allocated, used = allocated + report["allocated"], used + report["used"]
    token_bytes = 2 * heads * dim * 4 * args.layers
    contiguous = args.sequences * args.max * token_bytes
    print(json.dumps({
        "sequences": args.sequences, "prompt_tokens": {"min": min(lengths), "max": max(lengths),
                                                        "mean": sum(lengths) / len(lengths)},
        "page_size": PAGE, "layers_written": args.layers,
        "paged": {"allocated": allocated, "used": used,
                  "waste_share": round((allocated - used) / allocated, 5)},
        "contiguous_max_length": {"allocated": contiguous, "used": used,
                                  "waste_share": round((contiguous - used) / contiguous, 5)},
        "pool_blocks_used": manager.stats()["pool_blocks_used"],
        "pool_allocated": manager.pool.memory_report().allocated,  # with free blocks a growable pool keeps
    }, indent=1))
    manager.close()


if __name__ == "__main__":
    main()
