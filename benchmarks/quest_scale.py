"""Variants of Quest's ranking, offline on held-out books: ranges scaled, heads joined by softmax.

Quest (``kvfactory.selectors.quest``) ranks a page by its bound ``q · centre + |q| · half-width``
per key channel and joins a KV head's query heads by the best score, as the paper. This measures,
without decoding, variants the package does not ship: ranges scaled by s about their centres
(``q · centre + s |q| · half-width``, s = 1 the bound) and query heads joined by their summed
softmax over the pages (``softmax``) instead of the best score (``max``), on text the evaluation
never uses: one ``--context``-token window of each Gutenberg book in ``shared/data`` goes through
the frozen SmolLM2 once with full attention (``kvfactory.selectors.teacher``), and at
``--positions`` query positions every routed layer's pages are ranked with each s and aggregate
at each read budget as sparse decode does (the sink and current page always read). Prints JSON:
recall and hit rate per book, budget, aggregate and s, plus the oracle (the pages with the most
mass, per layer and KV head) and ``oracle_pooled`` (the oracle free to move the budget between
layers and KV heads), which bound what any page selector can read.

``--bound-tokens`` also ranks with key bounds kept per 8 or 4 tokens instead of per page (keys
``quest_{aggregate}_{s}_b{tokens}``): tighter bounds, but a step then reads ``summary_fraction`` of
the full K/V in bounds (float16 bounds of float32 K/V), against 1/32 per 16 tokens, so compare
them with 16-token bounds at the budget that reads the same bytes in all.

    python benchmarks/quest_scale.py [--context 6144] [--positions 48] [--scales 0,0.25,0.4,0.5,0.6,0.75,1]
        [--aggregates softmax,max] [--budgets 0.25,0.125,0.0625] [--bound-tokens 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kvfactory.models import load_model
from kvfactory.selectors import teacher
from kvfactory.selectors.oval import load_router, router_path
from kvfactory.selectors.oval import train as oval_train

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
BOOKS = {"pg84_frankenstein.txt": 30000, "pg1342_pride_and_prejudice.txt": 60000}  # book: first token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=6144)
    parser.add_argument("--positions", type=int, default=48)
    parser.add_argument("--scales", default="0,0.25,0.4,0.5,0.6,0.75,1")
    parser.add_argument("--aggregates", default="softmax,max")
    parser.add_argument("--budgets", default="0.25,0.125,0.0625")
    parser.add_argument("--bound-tokens", default="16")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    tokens = [int(t) for t in args.bound_tokens.split(",")]
    variants = [teacher.QuestVariant(float(s), a, t) for t in tokens for a in args.aggregates.split(",")
                for s in args.scales.split(",")]
    model, tokenizer = load_model()
    router = load_router(str(router_path("embedded")))
    results = {}
    for book, first in BOOKS.items():
        ids = teacher.tokens_of(tokenizer, [(DATA / book).read_text()])[first:first + args.context]
        chunks = teacher.collect(model, ids, router.shape.layers, args.positions, args.context, seed=1,
                                 variants=variants)
        results[book] = {}
        for budget in map(float, args.budgets.split(",")):
            row, oracles = {}, {}
            for variant in variants:  # the ablations (for the pooled oracle) once per budget
                ranked = [dataclasses.replace(c, quest=c.quest_at[variant]) for c in chunks]
                report = oval_train.evaluate(router, ranked, budget, ablations=not oracles)
                finer = "" if variant.bound_tokens == teacher.PAGE else f"_b{variant.bound_tokens}"
                row[f"quest_{variant.aggregate}_{variant.scale:g}{finer}"] = report["quest"]
                oracles = oracles or {name: report[name] for name in ("oracle", "oracle_pooled")}
            results[book][budget] = row | oracles
    print(json.dumps({"benchmark": "quest_scale", "context": args.context, "positions": args.positions,
                      "summary_fraction": {t: 1 / (2 * t) for t in tokens},
                      "seconds": round(time.perf_counter() - started, 1), "results": results}, indent=2))


if __name__ == "__main__":
    main()
