"""The evaluation's PNG plots, each readable at a glance: at most ``MAX_SERIES`` series per chart, each
series its own colour, a family keeping its colour from chart to chart.

- ``heatmap_{task}_{config}.png``: retrieval accuracy by depth x context, one per task and config;
- ``ppl.png``: ΔPPL % against the baseline, a horizontal bar per config with its paired 95 % interval,
  a panel per context, coloured by family (kvfactory's lossless, quantized, evicting and sparse-read
  configs, transformers' caches, a merged peer's presses);
- ``tradeoff_{task}.png``: quality against KV bytes (a fraction of the baseline's) per context:
  configs as labelled points coloured by family; a merged peer's presses as one line per press in
  panels of their own, ``MAX_SERIES`` presses a panel.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kvfactory.config import parse_config
from kvfactory.eval.exchange import EXTERNAL

MAX_SERIES = 8
# tab10 without its grey and olive: eight colours told apart at a glance
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
FAMILIES = ("lossless", "quantization", "eviction", "sparse reads", "transformers", "peer presses")
FAMILY_COLOURS = dict(zip(FAMILIES, PALETTE, strict=False))
BASELINE_COLOUR = "black"
TITLES = {"ppl": "perplexity", "passkey": "passkey", "needle": "needle", "multiturn": "multi-turn recall"}


def slug(name: str) -> str:
    """A file-name-safe form of a config name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "config"


def label(name: str, width: int = 32) -> str:
    """A config's name as a chart shows it: inline configs are cut to ``width`` characters."""
    return name if len(name) <= width else name[:width - 1] + "…"


def family(config: dict[str, Any]) -> str | None:
    """The family a run's config belongs to (None for the baseline)."""
    if config["kind"] == "baseline":
        return None
    if config["kind"] == EXTERNAL:
        return "peer presses"
    if config["kind"] != "kvfactory":
        return "transformers"
    parsed = parse_config(config["config"])
    if parsed.eviction is not None:
        return "eviction"
    if parsed.selector is not None:
        return "sparse reads"
    return "quantization" if parsed.quantization is not None else "lossless"


def quality(row: dict[str, Any]) -> tuple[float, float | None, float | None]:
    """``(value, low, high)``: ΔPPL % with its interval for perplexity, else accuracy."""
    if row["task"] != "ppl":
        return row["accuracy"], None, None
    low, high = row.get("delta_ppl_pct_ci") or (None, None)
    value = row.get("delta_ppl_pct_mean")
    return (row["delta_ppl_pct"], None, None) if value is None else (value, low, high)


def ppl_figure(results: dict[str, Any]) -> Figure | None:
    families = {c["name"]: family(c) for c in results["configs"]}
    rows = [r for r in results["rows"] if r["task"] == "ppl" and families.get(r["config"])]
    if not rows:
        return None
    contexts = sorted({r["context"] for r in rows})
    most = max(sum(r["context"] == c for r in rows) for c in contexts)
    fig = Figure(figsize=(5.2 * len(contexts), 1.3 + 0.26 * most), layout="constrained")
    for ax, context in zip(fig.subplots(1, len(contexts), squeeze=False)[0], contexts, strict=True):
        here = sorted((r for r in rows if r["context"] == context), key=lambda r: quality(r)[0])
        values = [quality(r) for r in here]
        errors = [[0.0 if low is None else max(0.0, v - low) for v, low, _ in values],
                  [0.0 if high is None else max(0.0, high - v) for v, _, high in values]]
        ax.barh(range(len(here)), [v for v, _, _ in values], xerr=errors, capsize=2,
                color=[FAMILY_COLOURS[families[r["config"]]] for r in here])
        ax.set_yticks(range(len(here)), [label(r["config"]) for r in here], fontsize=7)
        ax.axvline(0, color=BASELINE_COLOUR, linewidth=0.8)
        _symlog_if_wide(ax.set_xscale, [v for v, _, _ in values])
        ax.set_xlabel("ΔPPL % against the baseline (95 % interval)")
        ax.set_title(f"perplexity @ {context} tokens", fontsize=9)
    present = [f for f in FAMILIES if f in {families[r["config"]] for r in rows}]
    fig.legend(handles=[Patch(color=FAMILY_COLOURS[f], label=f) for f in present], loc="outside lower center",
               ncols=min(len(present), 4), fontsize=7)
    return fig


def tradeoff_figure(results: dict[str, Any], task: str) -> Figure | None:
    families = {c["name"]: family(c) for c in results["configs"]}
    rows = [r for r in results["rows"] if r["task"] == task and r["config"] in families]
    points = [r for r in rows if families[r["config"]] not in (None, "peer presses")]
    presses: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if families[r["config"]] == "peer presses":
            presses.setdefault(r["config"].split("@")[0], []).append(r)
    if not points and not presses:
        return None
    base = next((rs for press, rs in presses.items() if press.endswith("/none")), [])
    lines = sorted(press for press in presses if not press.endswith("/none"))
    groups = [lines[i:i + MAX_SERIES] for i in range(0, len(lines), MAX_SERIES)]
    contexts = sorted({r["context"] for r in rows})
    fig = Figure(figsize=(4.8 * len(contexts), 3.8 * (1 + len(groups))), layout="constrained")
    axes = fig.subplots(1 + len(groups), len(contexts), squeeze=False, sharey="col")
    y_label = "ΔPPL % against the baseline" if task == "ppl" else "accuracy"
    for column, context in enumerate(contexts):
        ax = axes[0][column]
        for name in FAMILIES[:-1]:
            here = [r for r in points if r["context"] == context and families[r["config"]] == name]
            if here:
                ax.scatter([r["bytes_per_token_ratio"] for r in here], [quality(r)[0] for r in here], s=28,
                           color=FAMILY_COLOURS[name], label=name, zorder=3)
        _label_points(ax, [(r["bytes_per_token_ratio"], quality(r)[0], label(r["config"]))
                           for r in points if r["context"] == context])
        baseline = [r for r in rows if r["context"] == context and families[r["config"]] is None]
        if baseline:
            ax.scatter([1.0], [0.0 if task == "ppl" else baseline[0]["accuracy"]], marker="*", s=80,
                       color=BASELINE_COLOUR, label=baseline[0]["config"], zorder=4)
        ax.set_title(f"{TITLES.get(task, task)} @ {context}: configs", fontsize=9)
        for row, group in enumerate(groups, start=1):
            ax = axes[row][column]
            for colour, press in zip(PALETTE, group, strict=False):
                pts = sorted((r["bytes_per_token_ratio"], quality(r)[0])
                             for r in base + presses[press] if r["context"] == context)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colour, label=press)
            ax.set_title(f"{TITLES.get(task, task)} @ {context}: presses", fontsize=9)
    for ax in (ax for line in axes for ax in line):
        ax.set_xlabel("KV bytes, fraction of the baseline's")
        ax.set_ylabel(y_label)
        if task == "ppl":
            _symlog_if_wide(ax.set_yscale, [y for line in ax.get_lines() for y in line.get_ydata()]
                            + [y for c in ax.collections for _, y in c.get_offsets()])
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    return fig


def _label_points(ax: Any, points: list[tuple[float, float, str]]) -> None:
    """One label per point, stacked where points share a quality value and sit close in bytes (a
    label per line, so none writes over another)."""
    placed: list[tuple[float, float, int]] = []
    for x, y, text in sorted(points):
        stacked = sum(1 for px, py, _ in placed if py == y and abs(px - x) < 0.25)
        placed.append((x, y, stacked))
        ax.annotate(text, (x, y), fontsize=6, xytext=(3, 3 - 8 * stacked), textcoords="offset points")


def _symlog_if_wide(set_scale: Any, values: list[float]) -> None:
    """A symmetric log scale when the values span more than two decades (int2 beside int8)."""
    finite = [abs(v) for v in values if not math.isnan(v)]
    if finite and max(finite) > 100 * max(1.0, min(finite)):
        set_scale("symlog", linthresh=1.0)


def heatmap_figure(results: dict[str, Any], task: str, config: str) -> Figure | None:
    settings = results["settings"]
    contexts, depths = list(settings["contexts"]), [f"{d:g}" for d in settings["depths"]]
    cells = {r["context"]: r["accuracy_by_depth"] for r in results["rows"]
             if r["task"] == task and r["config"] == config}
    if not cells:
        return None
    grid = [[cells.get(c, {}).get(d, float("nan")) for c in contexts] for d in depths]
    fig = Figure(figsize=(1.6 + 1.2 * len(contexts), 1.2 + 0.5 * len(depths)), layout="tight")
    ax = fig.subplots()
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(contexts)), [str(c) for c in contexts])
    ax.set_yticks(range(len(depths)), depths)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("depth")
    ax.set_title(f"{task}: {config}", fontsize=9)
    for y, line in enumerate(grid):
        for x, value in enumerate(line):
            if not math.isnan(value):
                ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax)
    return fig


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """Write every plot of ``results`` into ``out``; return their paths."""
    figures: list[tuple[str, Figure | None]] = [
        (f"heatmap_{task}_{slug(c['name'])}", heatmap_figure(results, task, c["name"]))
        for task in ("passkey", "needle") for c in results["configs"] if c["kind"] != EXTERNAL]
    figures.append(("ppl", ppl_figure(results)))
    figures += [(f"tradeoff_{task}", tradeoff_figure(results, task)) for task in results["settings"]["tasks"]]
    paths = []
    for name, fig in figures:
        if fig is not None:
            path = Path(out) / f"{name}.png"
            fig.savefig(path, dpi=100)
            paths.append(path)
    return paths
