"""Per-layer read budgets against one budget for every layer, on held-out books (teacher pass).

The shipped profile (``kvfactory/selectors/smollm2_layer_budgets.json``, from ``kvfactory selectors
calibrate`` on the first 4 x 6144 tokens of *Pride and Prejudice*) splits a read budget between
SmolLM2's routed layers (``layer_budgets: "auto"``). This runs the teacher pass
(``kvfactory.selectors.teacher``) over one 6144-token window of *Frankenstein* and a later window
of *Pride and Prejudice*, measures each layer's recall of Quest's best pages at every budget
``u/64`` (``calibrate.recall_curves``) and prints JSON: the mean recall at each ``--budgets`` with
one budget per layer (``uniform``) and with the shipped split (``split``), for Quest and for the
oracle (the pages with the most mass),
which bounds what any page ranking could reach with these budgets.

    python benchmarks/layer_budgets.py [--context 6144] [--positions 48] [--budgets 0.25,0.125,0.0625]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kvfactory.models import load_model
from kvfactory.selectors import calibrate, teacher
from kvfactory.selectors.layer_budgets import LayerProfile, embedded_profile_path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TEXTS = {"pg84_frankenstein.txt": 30000, "pg1342_pride_and_prejudice.txt": 60000}  # book: first token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=6144)
    parser.add_argument("--positions", type=int, default=48)
    parser.add_argument("--budgets", default="0.25,0.125,0.0625")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    model, tokenizer = load_model()
    shipped = LayerProfile.load(embedded_profile_path())
    layers = list(shipped.layers)
    results = {}
    for name, first in TEXTS.items():
        ids = teacher.tokens_of(tokenizer, [(DATA / name).read_text(encoding="utf-8")])
        chunks = teacher.collect(model, ids[first:first + args.context], layers, args.positions,
                                 args.context, seed=1)
        curves = {"quest": calibrate.recall_curves(chunks),
                  "oracle": calibrate.recall_curves([dataclasses.replace(c, quest=c.mass) for c in chunks])}
        measured = {ranking: dataclasses.replace(shipped, recall=tuple(map(tuple, curve.tolist())))
                    for ranking, curve in curves.items()}
        results[name] = {}
        for budget in map(float, args.budgets.split(",")):
            splits = {"uniform": dict.fromkeys(layers, budget), "split": shipped.allocate(budget, layers)}
            results[name][budget] = {f"{ranking}_{how}": round(profile.mean_recall(budgets), 4)
                                     for ranking, profile in measured.items()
                                     for how, budgets in splits.items()}
    print(json.dumps({"benchmark": "layer_budgets", "context": args.context, "positions": args.positions,
                      "profile": shipped.source, "seconds": round(time.perf_counter() - started, 1),
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
