"""The page sizes SmolLM2's prompts get from the dynamic-page sizer (``kvfactory.selectors.layout``).

Prefills the evaluation's prompts (passkey and needle, ``--context`` tokens, at ``--depths``)
through a Quest cache over dynamic pages and prints JSON: per prompt the pages, the mean page size
and the histogram, then all prompts together. ``--plot FILE`` draws the overall histogram, with the
storage's fixed page size marked. Recall, hit rate and passkey against fixed pages at the same read
budget come from the harness in the same run as DynamicCache (``docs/benchmarks.md``):

    kvfactory eval --context 6144 --tasks ppl,passkey,needle --depths 0.1,0.5,0.9 --samples 1 \\
        --ppl-tokens 128 --cache quest@0.125 --cache quest-dynamic@0.125
    python benchmarks/dynamic_pages.py --context 6144 --plot docs/dynamic_pages.png
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track

from kvfactory import KVCacheFactory
from kvfactory.eval import data
from kvfactory.models import load_model
from kvfactory.presets import policy_preset

STDERR = Console(stderr=True)  # progress apart from the JSON on stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=6144)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--cache", default="quest-dynamic@0.125", help="a SELECTOR-dynamic@BUDGET preset")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    model, tokenizer = load_model()
    depths = [float(d) for d in args.depths.split(",")]
    prompts = (data.passkey_prompts(tokenizer, args.context, depths)
               + data.needle_prompts(tokenizer, data.load_wikitext(), args.context, depths))
    config = policy_preset(args.cache)
    factory = KVCacheFactory(model.config, config)
    rows, total = [], Counter()
    for prompt in track(prompts, description=f"prefill {args.context}", console=STDERR):
        ids = tokenizer(prompt.prompt, return_tensors="pt").input_ids
        cache = factory.create_cache()
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        layout = cache.routing_context.shared["pages.layout"]
        histogram = layout.histogram()
        total.update(histogram)
        rows.append({"task": prompt.task, "depth": prompt.depth, "tokens": layout.length,
                     "pages": layout.pages, "mean_page_tokens": round(layout.mean_size(), 3),
                     "histogram": histogram})
    pages = sum(total.values())
    tokens = sum(size * count for size, count in total.items())
    result = {"model": "smollm2", "cache": config, "context": args.context, "prompts": rows,
              "all": {"pages": pages, "tokens": tokens, "mean_page_tokens": round(tokens / pages, 3),
                      "histogram": dict(sorted(total.items()))},
              "wall_s": round(time.perf_counter() - started, 1)}
    print(json.dumps(result, indent=1))
    if args.plot:
        plot(total, args.context, factory.config.storage.options.get("page_size", 16), args.plot)


def plot(histogram: Counter, context: int, page_size: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(histogram)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(sizes, [histogram[s] for s in sizes], color="tab:blue")
    ax.axvline(page_size, color="tab:red", linestyle="--", label=f"fixed pages ({page_size} tokens)")
    ax.set_xticks([1, 4, 8, 12, 16, 20, 24, 28, 32])
    ax.set_xlabel("tokens per page")
    ax.set_ylabel("pages")
    ax.set_title(f"Dynamic page sizes, SmolLM2, {context}-token prompts (entropy sizer)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
