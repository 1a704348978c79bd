"""benchmarks/policy_agreement.py: kvfactory's policies paired with kvpress's presses, prompt by prompt."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "policy_agreement.py"


def _load():
    spec = importlib.util.spec_from_file_location("policy_agreement", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _item(config: str, depth: float, output: str, correct: bool) -> dict:
    return {"config": config, "task": "needle", "context": 2000, "depth": depth, "sample": 0,
            "output": output, "correct": correct}


def _row(press: str, ratio: float, depth: float, generated: str, correct: bool, **extra) -> dict:
    return {"peer": "kvpress", "press": press, "compression_ratio": ratio, "task": "needle", "context": 2000,
            "depth": depth, "id": f"needle-2000-d{depth:g}-0", "generated": generated, "correct": correct,
            **extra}


def _folder(tmp_path: Path, question: str, rows: list[dict], name: str = "kvpress.jsonl") -> Path:
    items = [_item("DynamicCache", 0.1, " eat a sandwich", True), _item("DynamicCache", 0.9, " eat", True),
             _item("knorm@0.5", 0.1, " eat a sandwich", True), _item("knorm@0.5", 0.9, " sleep", False),
             _item("h2o@0.5", 0.1, " walk", False), _item("tova@0.5", 0.1, " no peer", False)]
    (tmp_path / "results.json").write_text(json.dumps({"settings": {"question": question}, "items": items}))
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_pairs_policies_baseline_and_h2o_with_their_presses_prompt_by_prompt(tmp_path):
    run = _load()
    rows = [_row("none", 0.0, 0.1, " eat a sandwich", True, question="inside"),
            _row("none", 0.0, 0.9, " eat", True, question="inside"),
            _row("knorm", 0.5, 0.1, " eat a sandwich ", True, question="inside"),
            _row("knorm", 0.5, 0.9, " eat a sandwich", True, question="inside"),
            _row("observed_attention", 0.5, 0.1, " walk", False, question="inside")]
    pairs = run.agreement(_folder(tmp_path, "inside", rows))
    assert list(pairs) == ["DynamicCache", "h2o@0.5", "knorm@0.5"]  # the baseline first; tova has no row
    knorm = pairs["knorm@0.5"]
    assert knorm["kvpress"] == "knorm@0.5" and knorm["question"] == "inside"
    assert (knorm["answers"], knorm["same_answers"]) == (2, 1)
    assert (knorm["correct_kvfactory"], knorm["correct_kvpress"]) == (1, 2)
    assert knorm["prompts"][1] == {"prompt": "needle d0.9-0", "kvfactory": False, "kvpress": True,
                                   "same_text": False}
    assert pairs["h2o@0.5"]["kvpress"] == "observed_attention@0.5"
    assert pairs["DynamicCache"]["kvpress"] == "none@0" and pairs["DynamicCache"]["same_answers"] == 2
    table = run.markdown(pairs).splitlines()
    assert table[0].startswith("| kvfactory | kvpress | needle d0.1-0 | needle d0.9-0 |")
    assert table[-1] == "| knorm@0.5 | knorm@0.5 | 1/1 | 0/1* | 1 / 2 of 2 | 1 of 2 |"


def test_rows_of_another_file_are_read_too(tmp_path):
    run = _load()
    folder = _folder(tmp_path, "after", [_row("knorm", 0.5, 0.1, " eat a sandwich", True)])
    eager = _row("observed_attention", 0.5, 0.1, " walk", False)
    (folder / "kvpress_eager.jsonl").write_text(json.dumps(eager))
    assert set(run.agreement(folder)) == {"knorm@0.5", "h2o@0.5"}


def test_settings_must_match(tmp_path):
    run = _load()
    rows = [_row("knorm", 0.5, 0.1, " eat", True)]  # no "question" field: kvpress's own setting, after
    with pytest.raises(SystemExit, match="compare one setting at a time"):
        run.agreement(_folder(tmp_path, "inside", rows))
    assert "knorm@0.5" in run.agreement(_folder(tmp_path, "after", rows))
