"""``kvfactory eval`` output: results.json, report.md and the PNG plots from the tiny pipeline."""

from __future__ import annotations

import copy
import json

from eval_pipeline import CONTEXTS, TASKS, pipeline_results

from kvfactory.eval.plots import slug
from kvfactory.eval.report import TASK_TITLES, write_report


def test_report_files(tmp_path) -> None:
    results = {k: v for k, v in pipeline_results().items() if k != "_units"}
    paths = write_report(results, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(saved) >= {"command", "wall_s", "configs", "settings", "rows", "items"}
    assert len(saved["rows"]) == len(results["rows"])
    text = (tmp_path / "out" / "report.md").read_text()
    assert "kvfactory eval (test)" in text and "Total wall time: 1.5 s" in text
    for config in results["configs"]:
        assert config["name"] in text
    for task in TASKS:
        assert f"## {TASK_TITLES[task]}" in text
    for column in ("ΔPPL", "bytes/token", "compression", "read budget", "prefill s", "decode tok/s"):
        assert column in text
    for context in CONTEXTS:
        assert f"| {context} |" in text
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    names = [slug(c["name"]) for c in results["configs"]]
    expected = {f"heatmap_{t}_{n}.png" for t in ("passkey", "needle") for n in names}
    assert set(pngs) == expected | {"ppl.png"} | {f"tradeoff_{task}.png" for task in TASKS}
    for name in pngs:
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
        assert f"({name})" in text
    assert paths["report"].name == "report.md"
    assert "## Quantization error" in text  # the int8 config's sampled relative MSE
    int8 = [r for r in results["rows"] if "int8" in r["config"]]
    assert int8 and all(0 < r["key_rel_mse"] < 1e-3 and 0 < r["value_rel_mse"] < 1e-3 for r in int8)
    assert not any("key_rel_mse" in r for r in results["rows"] if "int8" not in r["config"])
    assert "## Page routing" in text  # the Quest config's bytes read, hit rate and recall
    quest = [r for r in results["rows"] if "quest" in r["config"]]
    assert quest and all(r["read_budget"] < 0.7 and 0 < r["recall"] <= 1 + 1e-6 for r in quest)
    for r in quest:  # the tokens read and their split, as the table shows them
        parts = [r[f"{p}_read_fraction"] for p in ("always", "selected", "whole")]
        assert abs(sum(parts) - r["token_read_fraction"]) < 1e-9 and 0 < r["token_read_fraction"] < 1
        assert " + ".join(f"{p:.3f}" for p in parts) in text
    others = [r for r in results["rows"] if "quest" not in r["config"]]
    assert all(r["read_budget"] == 1.0 and "recall" not in r for r in others)


def test_the_routing_table_shows_the_tokens_read_without_shadow_samples(tmp_path) -> None:
    """A run too short for a shadow step has no recall, yet the tokens read and their split show."""
    results = copy.deepcopy({k: v for k, v in pipeline_results().items() if k != "_units"})
    for row in results["rows"]:
        for name in ("recall", "hit_rate", "oracle_recall"):
            row.pop(name, None)
    write_report(results, tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    quest = [r for r in results["rows"] if "quest" in r["config"]]
    assert quest and "## Page routing" in text
    assert all(f"{r['always_read_fraction']:.3f} + {r['selected_read_fraction']:.3f}" in text for r in quest)


def test_report_shows_the_paired_ci_and_the_windows(tmp_path) -> None:
    results = {k: v for k, v in pipeline_results().items() if k != "_units"}
    write_report(results, tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "mean ΔPPL % [95 % CI]" in text and "paired t-based 95 % confidence interval" in text
    assert "4 window(s) spread over the text" in text
    for row in (r for r in saved["rows"] if r["task"] == "ppl"):
        assert len(row["window_ppl"]) == len(row["window_delta_ppl_pct"]) == len(row["window_offsets"]) == 4
        low, high = row["delta_ppl_pct_ci"]
        assert low <= row["delta_ppl_pct_mean"] <= high
        cell = f"{row['delta_ppl_pct_mean']:+.2f} [{low:+.2f}, {high:+.2f}]"
        assert f"| {row['delta_ppl_pct']:+.2f} | {cell} |" in text  # the pooled ΔPPL %, then the CI
        if row["config"] != "DynamicCache":
            assert "| " + " | ".join(f"{v:+.2f} %" for v in row["window_delta_ppl_pct"]) + " |" in text
    for context in CONTEXTS:
        offsets = next(r["window_offsets"] for r in saved["rows"]
                       if r["task"] == "ppl" and r["context"] == context)
        assert f"Per window at {context}" in text and ", ".join(map(str, offsets)) in text
