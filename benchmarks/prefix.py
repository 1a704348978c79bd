"""Prefix sharing with KVCacheManager: many sequences behind one system prompt (SmolLM2, fp32, CPU,
1 thread, 16-token pages), printed as JSON.

``--sequences`` prompts, each a ``--system``-token WikiText system prompt followed by its own
``--question``-token WikiText question, are run twice: alone (a manager without prefix caching:
every sequence prefills its whole prompt) and shared (one manager with prefix caching: the first
prompt fills the cache, the others start from its blocks and prefill only their question). Reports

- ``kv_bytes``: pool blocks in use after every prompt is prefilled (all but its last token, which
  ``generate`` feeds), against the bytes of one system prompt plus every question (the ideal,
  ``ratio_to_ideal``) and against the unshared run;
- ``prefill``: median seconds of a cold prefill (whole prompt) and of a hit (question only) over
  the sequences after the first, and their ratio;
- ``identical``: whether each sequence's ``--new-tokens`` greedy tokens are the same shared as alone,
  and the largest logit difference.

    python benchmarks/prefix.py [--sequences 16] [--system 1024] [--question 64] [--new-tokens 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from decode import DATA
from rich.console import Console
from rich.progress import track

from kvfactory import KVCacheManager
from kvfactory.models import load_model

PAGE = 16
STDERR = Console(stderr=True)  # progress apart from the JSON on stdout


def prompts(tokenizer, sequences: int, system: int, question: int) -> list[torch.Tensor]:
    ids = tokenizer(DATA.read_text()[:400_000], return_tensors="pt").input_ids[0]
    head = ids[:system]
    return [torch.cat([head, ids[system + i * question:system + (i + 1) * question]])[None]
            for i in range(sequences)]


@torch.inference_mode()
def run(model, batch: list[torch.Tensor], shared: bool, new_tokens: int, label: str) -> dict:
    manager = KVCacheManager(model.config, {"type": "paged", "page_size": PAGE}, prefix_caching=shared)
    prefill_s, cached = [], []
    for i, ids in enumerate(track(batch, description=label, console=STDERR)):
        cache = manager.create(f"s{i}", prompt=ids[0])
        start = manager.cached_tokens(f"s{i}")
        began = time.perf_counter()  # all but the last token: generate() feeds that one
        model(input_ids=ids[:, start:-1], past_key_values=cache, use_cache=True)
        prefill_s.append(time.perf_counter() - began)
        cached.append(start)
    used = manager.pool.memory_report().used
    generated = []
    for i, ids in enumerate(batch):  # greedy continuation of each prompt through its cache
        out = model.generate(ids, past_key_values=manager.get(f"s{i}"), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        generated.append(out)
    stats = manager.stats()
    manager.close()
    return {"prefill_s": prefill_s, "cached_tokens": cached, "kv_bytes": used,
            "generated": generated, "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--system", type=int, default=1024)
    parser.add_argument("--question", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    batch = prompts(tokenizer, args.sequences, args.system, args.question)
    alone = run(model, batch, False, args.new_tokens, "alone (no prefix caching)")
    shared = run(model, batch, True, args.new_tokens, "shared (prefix caching)")
    cfg = model.config
    token_bytes = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    ideal = (args.system + args.sequences * (args.question - 1)) * token_bytes * cfg.num_hidden_layers
    cold = statistics.median(alone["prefill_s"][1:])
    hit = statistics.median(shared["prefill_s"][1:])
    same = [torch.equal(a.sequences, b.sequences) for a, b in zip(alone["generated"], shared["generated"],
                                                                  strict=True)]
    pairs = zip(alone["generated"], shared["generated"], strict=True)
    diff = max((x - y).abs().max().item() for a, b in pairs for x, y in zip(a.logits, b.logits, strict=True))
    print(json.dumps({
        "model": "smollm2", "threads": 1, "machine": platform.machine(), "page_size": PAGE,
        "sequences": args.sequences, "system_tokens": args.system, "question_tokens": args.question,
        "kv_bytes": {"shared": shared["kv_bytes"], "alone": alone["kv_bytes"], "ideal": ideal,
                     "ratio_to_ideal": round(shared["kv_bytes"] / ideal, 4),
                     "ratio_to_alone": round(shared["kv_bytes"] / alone["kv_bytes"], 4)},
        "prefill": {"cold_median_s": round(cold, 4), "hit_median_s": round(hit, 4),
                    "speedup": round(cold / hit, 2), "cached_tokens": shared["cached_tokens"]},
        "identical": {"tokens": all(same), "sequences_identical": sum(same), "max_logit_diff": diff},
        "prefix_stats": {k: v for k, v in shared["stats"].items() if k.startswith("prefix")},
    }, indent=1))


if __name__ == "__main__":
    main()
