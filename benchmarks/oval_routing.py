"""Which pages each method would read, on held-out text: OVAL's routers against Quest, recent pages,
random pages and the oracle, at several read budgets, from one teacher pass (no decoding).

The teacher (``kvfactory.selectors.teacher``) runs the frozen SmolLM2 with full attention over
``--chunks`` chunks of ``--chunk`` tokens of a text the shipped routers were not trained on
(``--text``: Frankenstein by default; they were trained on Pride and Prejudice; ``wikitext`` and
``alice`` name the evaluation texts) and records, at ``--positions`` query positions per chunk, the
attention mass per 16-token page. Each method then picks pages at each read budget as sparse decode
does (the sink and current page always read, counted in the budget: the read budget is the true
fraction of each layer's tokens); the hit rate and the attention-mass recall are means over
positions, the layers every router covers (``--layers``) and the KV heads. ``--router`` is
reported as ``router``, ``--others`` by their names. ``router_no_decay`` is the prefetch router's
ablation without the positional term; ``oracle_pooled`` the oracle free to move the budget between
the layers and KV heads of a position; ``--detail`` adds the tail of each method's recall and its
mean per layer, and the relative error of each query head's attention output over the pages a method
reads against full attention's (mean and per layer; full attention's inputs at every layer).
Prints JSON; ``--plot FILE`` also draws recall and hit rate against the read budget (``--replot
JSON`` redraws a saved run).

    python benchmarks/oval_routing.py [--budgets 0.25,0.125,0.0625] [--chunks 12] [--router embedded]
        [--others embedded-prefetch] [--text wikitext] [--plot docs/oval_routing.png] [--replot results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvfactory.eval.data import load_text
from kvfactory.models import load_model
from kvfactory.selectors import teacher
from kvfactory.selectors.oval import load_router, router_path
from kvfactory.selectors.oval import train as oval_train

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg84_frankenstein.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0.25,0.125,0.0625")
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--positions", type=int, default=32)
    parser.add_argument("--router", default="embedded")
    parser.add_argument("--others", default="", help="more routers to compare, comma-separated")
    parser.add_argument("--layers", default="2-29", help="FIRST-LAST model layers to measure")
    parser.add_argument("--text", default=str(BOOK), help="a file, or 'wikitext' / 'alice'")
    parser.add_argument("--detail", action="store_true",
                        help="also each method's recall tail (1st and 5th percentiles, share under 1/2), "
                             "mean per layer, and the attention output's relative error")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--replot", type=Path, help="a saved JSON output to draw instead of measuring")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return
    torch.set_num_threads(2)
    started = time.perf_counter()
    model, tokenizer = load_model()
    router = load_router(str(router_path(args.router)))
    others = {name: load_router(str(router_path(name))) for name in filter(None, args.others.split(","))}
    first, last = map(int, args.layers.split("-"))
    ids = teacher.cap(teacher.tokens_of(tokenizer, [load_text(args.text).text]), args.chunks, args.chunk)
    chunks = teacher.collect(model, ids, range(first, last + 1), args.positions, args.chunk, seed=1,
                             advance=lambda: print(".", end="", file=sys.stderr, flush=True), keys=True,
                             values=args.detail)
    results = {budget: oval_train.evaluate(router, chunks, budget, ablations=True, others=others,
                                              detail=args.detail)
               for budget in map(float, args.budgets.split(","))}
    report = {"benchmark": "oval_routing", "text": Path(args.text).name, "tokens": ids.numel(),
              "positions": args.positions * len(chunks), "router": args.router, "others": list(others),
              "layers": args.layers,
              "seconds": round(time.perf_counter() - started, 1), "results": results}
    print(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)


def plot(report: dict, path: Path) -> None:
    """Recall and hit rate against the read budget, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted(report["results"], key=float)
    methods = list(report["results"][budgets[0]])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("recall", "hit_rate"), strict=True):
        for method in methods:
            ax.plot([float(b) for b in budgets], [report["results"][b][method][metric] for b in budgets],
                    marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("read budget (fraction of pages)")
        ax.set_ylabel(metric.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"Pages read on held-out text ({report['text']}, {report['positions']} positions)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
