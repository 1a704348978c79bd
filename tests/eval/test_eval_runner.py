"""``kvfactory eval`` orchestration: the tiny pipeline's rows, ``--cache`` resolution and errors."""

from __future__ import annotations

import json
import math

import pytest
from eval_pipeline import CACHES, CONTEXTS, TASKS, pipeline_results
from typer.testing import CliRunner

from kvfactory import ConfigError
from kvfactory.cli import app
from kvfactory.eval import peers
from kvfactory.eval.runner import BASELINE, EvalError, parse_tasks, resolve_cache, resolve_caches
from kvfactory.presets import load_preset, preset_names


def test_results_structure_and_baseline_ratios() -> None:
    results = pipeline_results()
    names = [c["name"] for c in results["configs"]]
    assert names[0] == BASELINE and len(names) == len(CACHES) + 1
    rows = results["rows"]
    assert len(rows) == len(CONTEXTS) * len(TASKS) * len(names)
    assert {(r["context"], r["task"], r["config"]) for r in rows} == {
        (c, t, n) for c in CONTEXTS for t in TASKS for n in names}
    done = [u for u, finished in results["_units"] if finished]
    assert done == [(r["context"], r["task"], r["config"]) for r in rows]
    for row in rows:
        sparse = "quest" in row["config"]
        assert (row["read_budget"] < 1.0 if sparse else row["read_budget"] == 1.0)
        assert row["kv_bytes"] > 0 and row["items"] >= 1
        for key in ("kv_bytes_ratio", "bytes_per_token_ratio", "prefill_ratio", "decode_ratio",
                    "compression_ratio", "prefill_s", "decode_tokens_per_s"):
            assert math.isfinite(row[key]), (key, row)
        if row["config"] == BASELINE:
            assert row["kv_bytes_ratio"] == row["prefill_ratio"] == row["decode_ratio"] == 1.0
            assert row["bytes_per_token_ratio"] == 1.0 and row["compression_ratio"] == 0.0
        if row["task"] == "ppl":
            assert row["ppl"] > 1 and (row["delta_ppl"] == 0.0 if row["config"] == BASELINE else True)
        else:
            assert 0.0 <= row["accuracy"] <= 1.0
        if row["task"] in ("passkey", "needle"):
            assert set(row["accuracy_by_depth"]) == {"0.2", "0.8"}
    by = {(r["context"], r["task"], r["config"]): r for r in rows}
    for context in CONTEXTS:
        dense = by[(context, "ppl", "dense")]
        assert abs(dense["delta_ppl"]) < 1e-3  # exact storage, same numbers
        sliding = by[(context, "ppl", "transformers/sliding-window-64")]
        assert sliding["compression_ratio"] > 0.5 and sliding["kv_bytes_ratio"] < 0.5
        for quantized in ("transformers/quanto-int4", "transformers/hqq-int2"):
            if (context, "ppl", quantized) in by:
                row = by[(context, "ppl", quantized)]
                assert row["kv_bytes_ratio"] < 0.5 and row["compression_ratio"] == 0.0
    json.dumps({k: v for k, v in results.items() if k != "_units"})  # JSON-ready


def test_presets_load() -> None:
    assert {"dense", "paged16", "paged256"} <= set(preset_names())
    assert load_preset("paged16") == {"type": "paged", "page_size": 16}
    spec = resolve_cache("paged16")
    assert (spec.name, spec.kind, spec.config) == ("paged16", "kvfactory", {"type": "paged", "page_size": 16})
    snap = resolve_cache("snapkv@0.75").config["strategies"]
    assert snap == [{"name": "paged", "page_size": 16},
                    {"name": "eviction", "policy": "snapkv", "compression_ratio": 0.75}]
    quest = resolve_cache("quest@0.125").config["strategies"]
    assert quest == [{"name": "paged", "page_size": 16}, {"name": "quest", "read_budget": 0.125}]
    assert resolve_cache("quest@1").config["strategies"][1]["read_budget"] == 1.0
    with pytest.raises(ConfigError, match="dynamic pages were removed"):
        resolve_cache("quest-dynamic@0.125")
    with pytest.raises(EvalError):
        resolve_cache("snapkv-dynamic@0.75")  # pages are a selector's: no dynamic eviction policy


def test_cache_values(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("type: paged\npage_size: 32\n")
    assert resolve_cache(str(path)).config == {"type": "paged", "page_size": 32}
    assert resolve_cache(str(path)).name == "mine"
    assert resolve_cache('{"type": "dense"}').config == {"type": "dense"}
    assert resolve_cache("{type: paged, page_size: 8}").config == {"type": "paged", "page_size": 8}
    assert resolve_cache("transformers/sliding-window-128").kind == "peer"
    names = [s.name for s in resolve_caches(["dense", "dense", BASELINE])]
    assert names == [BASELINE, "dense"]


@pytest.mark.parametrize(("value", "message"), [
    ("nonsense", "expected a preset"),
    ("nopolicy@0.5", "expected a preset"),
    ("snapkv@1.5", "compression_ratio=1.5"),
    ("quest@2", "read_budget=2"),
    ('{"type": "bogus"}', "invalid cache config"),
    ("{type: paged, page_size: -1}", "page_size"),
    ("missing.yaml", "no such YAML file"),
    ("transformers/foo", "unknown peer"),
    ("transformers/sliding-window-0", "unknown peer"),
])
def test_bad_cache_values(value: str, message: str) -> None:
    with pytest.raises(EvalError, match=message):
        resolve_cache(value)


def test_missing_backend_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(peers, "_missing", lambda module: True)
    with pytest.raises(EvalError, match=r"kvfactory\[peers\]"):
        resolve_cache("transformers/hqq-int4")


def test_bad_tasks() -> None:
    assert parse_tasks("ppl, passkey,ppl") == ("ppl", "passkey")
    with pytest.raises(EvalError, match="subset of ppl,passkey,needle,multiturn"):
        parse_tasks("ppl,bogus")


@pytest.mark.parametrize(("args", "message"), [
    (["--cache", "nonsense"], "expected a preset"),
    (["--tasks", "bogus"], "subset of"),
    (["--context", "abc"], "comma-separated ints"),
    (["--depths", "1.5"], "depths"),
    (["--text", "no-such-book"], "expected one of wikitext, alice"),
    (["--ppl-context", "x"], "comma-separated ints"),
])
def test_cli_rejects_bad_options_before_loading(args: list[str], message: str, tmp_path) -> None:
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path), *args], env={"COLUMNS": "300"})
    assert result.exit_code != 0
    assert message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "results.json").exists()
