"""Writing an evaluation: ``results.json``, a Markdown report (``report.md``) and PNG plots.

One table per task; retrieval tasks also get accuracy per depth x context. The plots are drawn by
``kvfactory.eval.plots``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvfactory.eval.exchange import EXTERNAL
from kvfactory.eval.plots import plot
from kvfactory.sizing import format_bytes

TASK_TITLES = {"ppl": "Perplexity through the cache", "passkey": "Passkey retrieval",
               "needle": "Needle in a haystack", "multiturn": "Multi-turn recall"}


def write_results(results: dict[str, Any], out: Path) -> Path:
    path = Path(out) / "results.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def _f(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def _split(row: dict[str, Any]) -> str:
    """The tokens read, split: always read + selected + read whole."""
    return " + ".join(_f(row.get(f"{part}_read_fraction"), ".3f") for part in ("always", "selected", "whole"))


def _table(headers: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return out + ["| " + " | ".join(cells) + " |" for cells in lines]


def _cost_cells(r: dict[str, Any]) -> list[str]:
    return [format_bytes(r["kv_bytes"]), _f(r["kv_bytes_ratio"], ".2f"), _f(r["bytes_per_token"], ",.0f"),
            _f(r["bytes_per_token_ratio"], ".2f"), _f(r["compression_ratio"], ".3f"),
            _f(r["read_budget"], ".2f"), _f(r["prefill_s"], ".2f"), _f(r["prefill_ratio"], ".2f"),
            _f(r["decode_tokens_per_s"], ".1f"), _f(r["decode_ratio"], ".2f")]


COST_HEADERS = ["KV bytes", "× base", "bytes/token", "× base", "compression", "read budget", "prefill s",
                "× base", "decode tok/s", "× base"]


def _sizes(s: dict[str, Any]) -> str:
    """The run's sample sizes, for the tasks it ran."""
    parts = [f"Contexts {', '.join(map(str, s['contexts']))}"]
    if {"passkey", "needle"} & set(s["tasks"]):
        parts.append(f"depths {', '.join(map(str, s['depths']))}")
        where = s.get("question", "inside")
        parts.append("the question inside the prompt each cache compresses" if where == "inside" else
                     "the question fed after the context was compressed (kvpress's pipeline)")
    if "passkey" in s["tasks"]:
        parts.append(f"{s['keys_per_depth']} passkey key(s) per depth")
    if "needle" in s["tasks"]:
        parts.append(f"{s['needles_per_depth']} needle haystack(s) per depth")
    if "multiturn" in s["tasks"]:
        parts.append(f"{s['conversations']} conversation(s) of {s['facts']} facts")
    if "ppl" in s["tasks"]:
        at = s.get("ppl_contexts") or s["contexts"]
        parts.append(f"perplexity over {s.get('ppl_windows', 1)} window(s) spread over the text, each "
                     f"{s['ppl_continuation']} teacher-forced token(s) after a prefill of "
                     f"{' or '.join(map(str, at))} tokens")
    return "; ".join(parts) + "."


PPL_NOTE = ("ΔPPL is pooled over all scored tokens (absolute, and % = ratio of the perplexities − 1). "
            "Mean ΔPPL % [95 % CI] is the mean over windows of each window's ΔPPL % (PPL of the window "
            "/ DynamicCache's PPL of the same window − 1), with a paired t-based 95 % confidence "
            "interval (mean ± t(0.975, n − 1) · sd / √n, n windows). An interval that holds 0 does not "
            "tell the config from DynamicCache.")


def _ci(r: dict[str, Any]) -> str:
    low, high = r.get("delta_ppl_pct_ci") or (None, None)
    if r.get("delta_ppl_pct_mean") is None:
        return "–"
    return f"{_f(r['delta_ppl_pct_mean'], '+.2f')} [{_f(low, '+.2f')}, {_f(high, '+.2f')}]"


def _ppl_windows(task_rows: list[dict[str, Any]]) -> list[str]:
    """Per-window perplexities of the baseline and per-window ΔPPL % of every config, per context."""
    lines: list[str] = []
    for context in dict.fromkeys(r["context"] for r in task_rows):
        here = [r for r in task_rows if r["context"] == context and r.get("window_ppl")]
        if not here:
            continue
        n = max(len(r["window_ppl"]) for r in here)
        offsets = next((r["window_offsets"] for r in here if r.get("window_offsets")), None)
        lines += ["", f"Per window at {context} (PPL, and ΔPPL % against DynamicCache's PPL of the same "
                  "window" + ("; window i starts at token " + ", ".join(map(str, offsets)) + " of the text"
                              if offsets else "") + "):", ""]
        cells = []
        for r in here:
            if r["config"] == "DynamicCache" or r["config"].endswith("/none") or not r.get(
                    "window_delta_ppl_pct"):
                cells.append([r["config"] + " (PPL)"] + [_f(v, ".3f") for v in r["window_ppl"]])
            else:
                cells.append([r["config"]] + [_f(v, "+.2f") + " %" for v in r["window_delta_ppl_pct"]])
        lines += _table(["config"] + [f"window {i}" for i in range(n)], cells)
    return lines



def summary(results: dict[str, Any]) -> str:
    """Each task's results table, as the report shows them (what ``kvfactory eval`` prints)."""
    return "\n".join(_task_sections(results)).strip() + "\n"


def _task_sections(results: dict[str, Any]) -> list[str]:
    rows, s = results["rows"], results["settings"]
    lines: list[str] = []
    for task in s["tasks"]:
        task_rows = [r for r in rows if r["task"] == task]
        lines += ["", f"## {TASK_TITLES.get(task, task)}", ""]
        if task == "ppl":
            head = ["config", "context", "windows", "PPL", "ΔPPL", "ΔPPL %", "mean ΔPPL % [95 % CI]"]
            quality = [[r["config"], str(r["context"]), str(r["items"]), _f(r["ppl"], ".3f"),
                        _f(r["delta_ppl"], "+.3f"), _f(r.get("delta_ppl_pct"), "+.2f"), _ci(r)]
                       for r in task_rows]
            lines += [PPL_NOTE, ""]
        else:
            head = ["config", "context", "accuracy"]
            quality = [[r["config"], str(r["context"]), _f(r["accuracy"], ".2f")] for r in task_rows]
        lines += _table(head + COST_HEADERS, [q + _cost_cells(r) for q, r in zip(quality, task_rows,
                                                                                   strict=True)])
        if task == "ppl":
            lines += _ppl_windows(task_rows)
        if task in ("passkey", "needle"):
            depths = [f"{d:g}" for d in s["depths"]]
            lines += ["", f"Accuracy per depth × context ({task}):", ""]
            lines += _table(["config", "context"] + [f"depth {d}" for d in depths],
                            [[r["config"], str(r["context"])]
                             + [_f(r["accuracy_by_depth"].get(d), ".2f") for d in depths] for r in task_rows])
    return lines


def markdown(results: dict[str, Any], plots: list[Path]) -> str:
    """The report as Markdown (plots linked by file name)."""
    rows = results["rows"]
    s = results["settings"]
    lines = [f"# kvfactory eval: {results.get('model', 'model')}", "",
             f"Command: `{results.get('command', '')}`", "",
             f"Total wall time: {results.get('wall_s', float('nan')):.1f} s"
             f" (started {results.get('started', '?')}). Corpus: {results.get('corpus', '?')}.", "",
             _sizes(s) + " Ratios (× base) are to DynamicCache in this run; compression ratio = "
             "1 − kept / seen tokens; read budget = tokens read per step / tokens stored.", "",
             "## Configs", ""]
    lines += _table(["config", "kind", "source", "config"],
                    [[c["name"], c["kind"], c["source"],
                      f"`{json.dumps(c['config'])}`" if c["config"] else "–"] for c in results["configs"]])
    if results.get("peer_results"):
        lines += ["", f"Rows of kind `{EXTERNAL}` come from {', '.join(results['peer_results'])}: a peer "
                  "run in another process on this run's `prompts.jsonl` (NVIDIA kvpress: "
                  "`benchmarks/peers/run.sh`). Their ΔPPL, KV bytes and compression are against the peer's "
                  "own no-press run (`/none`) from the same process; their speed is not compared across "
                  "processes."]
    lines += _task_sections(results)
    quantized = [r for r in rows if "key_rel_mse" in r]
    if quantized:
        lines += ["", "## Quantization error", "",
                  "Relative MSE of the keys and values quantized caches stored (sampled writes, mean over "
                  "quantized layers and prompts):", ""]
        lines += _table(["config", "task", "context", "keys", "values"],
                        [[r["config"], r["task"], str(r["context"]), _f(r["key_rel_mse"], ".2e"),
                          _f(r["value_rel_mse"], ".2e")] for r in quantized])
    routed = [r for r in rows if "token_read_fraction" in r]
    if routed:
        lines += ["", "## Page routing", "",
                  "Sparse decode (page selectors): KV bytes read per decode step over all stored (page "
                  "summaries included), and on shadow steps (full attention every `shadow_every` steps) the "
                  "hit rate (pages read among the same number with the most attention mass) and the "
                  "attention-mass recall, mean over sparse layers, KV heads and prompts, beside the "
                  "oracle's (as many pages chosen by full attention: the most any selector reads); the "
                  "router's p99 seconds choosing pages per decode step (all layers); the tokens a decode "
                  "step read over those stored (the read budget as Quest counts it), split into always "
                  "read (sink, local and new-token pages), selected, and read whole (dense layers):", ""]
        lines += _table(["config", "task", "context", "read", "hit rate", "recall", "oracle recall",
                         "router p99 ms/step", "tokens read", "always + selected + whole"],
                        [[r["config"], r["task"], str(r["context"]), _f(r["read_budget"], ".3f"),
                          _f(r.get("hit_rate"), ".3f"), _f(r.get("recall"), ".3f"),
                          _f(r.get("oracle_recall"), ".3f"), _f(r.get("router_p99_ms"), ".2f"),
                          _f(r.get("token_read_fraction"), ".3f"), _split(r)]
                         for r in routed])
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(results: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """Write ``results.json``, the plots and ``report.md`` into ``out`` (created); return their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot(results, out)
    report = out / "report.md"
    report.write_text(markdown(results, plots), encoding="utf-8")
    return {"results": write_results(results, out), "report": report,
            **{p.stem: p for p in plots}}
