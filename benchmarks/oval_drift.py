"""OVAL's query scorer under a domain shift: hit rate before, during and after a drift retraining.

The shipped scorer was trained on a novel (*Pride and Prejudice*). Here SmolLM2 (fp32) reads Python
source instead (the standard library's ``argparse.py``, as this Python ships it; PSF licence): a
``--context``-token prefill through a 16-token paged cache with ``oval`` at ``--budget`` (every layer
routed), then ``--steps`` tokens of the same file decoded teacher-forced, every step a sparse decode
step with shadow full attention in every layer (``shadow_every`` 1). A
``kvfactory.selectors.oval.drift.DriftRetrainer`` watches the cache with the alert at
``--threshold`` held for ``--duration`` seconds (the seed's rule is 0.82 for 180 s; shortened here
so the run stays short) and fine-tunes the scorer's query projections on the last ``--samples``
shadow samples (``--train-steps`` Adam steps of ``--batch`` samples) on a background thread while
decoding goes on. The same decode on a novel the
scorer was not trained on (*Frankenstein*) is the in-domain reference, and the same decode of the
code without a retrainer the control (the text changes as it goes, and so does the hit rate).
Prints JSON: the hit rate per
``--every`` steps, the step the alert fired and the step the retrained scorer was swapped in, and
the mean hit rate before the alert, while training and after the swap; ``--plot FILE`` draws it.

    python benchmarks/oval_drift.py [--context 4096] [--steps 480] [--budget 0.125]
        [--plot docs/oval_drift.png]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from kvfactory import KVCacheFactory
from kvfactory.models import load_model
from kvfactory.selectors.oval import load_router, router_path, router_slot
from kvfactory.selectors.oval.drift import DriftRetrainer

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg84_frankenstein.txt"


def code_text() -> str:
    return Path(argparse.__file__).read_text(encoding="utf-8")


@torch.no_grad()
def run(model: Any, ids: torch.Tensor, context: int, steps: int, budget: float,
        retrainer: DriftRetrainer | None) -> dict[str, Any]:
    config = {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16},
        {"name": "oval", "read_budget": budget, "dense_layers": 0, "shadow_every": 1,
         "layer_budgets": "uniform"}]}
    cache = KVCacheFactory(model.config, config).create_cache()
    hits: list[float] = []
    cache.routing.listeners.append(hits.append)
    if retrainer is not None:
        retrainer.attach(cache)
    model(ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
    layers = model.config.num_hidden_layers
    per_step, fired, swapped, started = [], None, None, time.monotonic()
    for t in range(context, context + steps):
        model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        step = t - context
        per_step.append(sum(hits[-layers:]) / layers)
        if retrainer is not None:
            if fired is None and retrainer.alert.fired:
                fired = step
            if swapped is None and retrainer.history:
                swapped = step
    return {"hit_rate_per_step": [round(h, 4) for h in per_step], "alert_step": fired, "swap_step": swapped,
            "seconds": round(time.monotonic() - started, 1)}


def phases(per_step: list[float], fired: int | None, swapped: int | None) -> dict[str, float | None]:
    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 4) if values else None
    end = len(per_step)
    return {"before_alert": mean(per_step[:fired if fired is not None else end]),
            "while_training": mean(per_step[fired:swapped]) if fired is not None else None,
            "after_swap": mean(per_step[swapped:]) if swapped is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--budget", type=float, default=0.125)
    parser.add_argument("--threshold", type=float, default=0.82)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds under the threshold")
    parser.add_argument("--samples", type=int, default=2048, help="shadow samples kept (layers x steps)")
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64, help="samples per fine-tuning step")
    parser.add_argument("--every", type=int, default=16, help="steps per point of the printed curve")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    shipped = load_router(str(router_path("embedded")))
    report: dict[str, Any] = {"benchmark": "oval_drift", "date": time.strftime("%Y-%m-%d"),
                              "budget": args.budget, "context": args.context, "steps": args.steps,
                              "threshold": args.threshold, "duration_s": args.duration, "texts": {}}
    runs = (("code (argparse.py)", code_text(), True), ("code, no retraining", code_text(), False),
            ("novel (Frankenstein)", BOOK.read_text(), True))
    for name, text, retraining in runs:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, 1000:1000 + args.context + args.steps]
        router_slot(str(router_path("embedded"))).module = shipped  # every text starts from the shipped one
        retrainer = DriftRetrainer(threshold=args.threshold, duration_s=args.duration, samples=args.samples,
                                   steps=args.train_steps, batch=args.batch) if retraining else None
        result = run(model, ids, args.context, args.steps, args.budget, retrainer)
        if retrainer is not None:
            retrainer.wait()
        curve = result.pop("hit_rate_per_step")
        report["texts"][name] = result | phases(curve, result["alert_step"], result["swap_step"]) | {
            "curve": [round(sum(curve[i:i + args.every]) / len(curve[i:i + args.every]), 4)
                      for i in range(0, len(curve), args.every)],
            "retraining": [] if retrainer is None else retrainer.history}
        summary = {k: v for k, v in report["texts"][name].items() if k != "curve"}
        print(json.dumps({name: summary}), flush=True)
    router_slot(str(router_path("embedded"))).module = shipped
    print(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot, args.every)


def plot(report: dict[str, Any], path: Path, every: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, result in report["texts"].items():
        steps = [every * i for i in range(len(result["curve"]))]
        line, = ax.plot(steps, result["curve"], marker=".", label=name)
        for key, style in (("alert_step", ":"), ("swap_step", "--")):
            if result[key] is not None:
                ax.axvline(result[key], color=line.get_color(), linestyle=style)
    ax.axhline(report["threshold"], color="grey", linewidth=0.8)
    ax.set_xlabel("decode step (dotted: alert fired; dashed: retrained scorer swapped in)")
    ax.set_ylabel(f"hit rate (mean of {every} steps, all layers)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
