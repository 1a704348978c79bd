"""``kvfactory eval`` end to end on the embedded SmolLM2: repeatable, lossless where it should be, and
a retrieval the trained model gets right; ``--prompts-only`` and ``kvfactory report``."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvfactory.cli import app

# the question fed after the context (kvpress's setting), so kvpress rows merge into these runs
ARGS = ["eval", "--cache", "dense", "--cache", "paged16", "--context", "384", "--depths", "0.5",
        "--samples", "1", "--ppl-tokens", "8", "--question", "after"]
QUALITY = ("ppl", "accuracy", "accuracy_by_depth")


def _eval(out, *extra: str) -> dict:
    """One run; its output, not a terminal here, has a line per unit and the results tables."""
    result = CliRunner().invoke(app, [*ARGS, "--out", str(out), *extra], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert re.search(r"^ppl @ 384: paged16$", result.output, re.M), result.output
    assert re.search(r"^\| paged16 \| 384 \| ", result.output, re.M), result.output
    return json.loads((out / "results.json").read_text())


def _report(out, peer):
    return CliRunner().invoke(app, ["report", str(out), "--peer-results", str(peer)], env={"COLUMNS": "300"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return [_eval(tmp_path_factory.mktemp(f"run{i}")) for i in range(2)]


def _quality(results: dict) -> list[tuple]:
    return [(r["context"], r["task"], r["config"], *(json.dumps(r.get(k)) for k in QUALITY))
            for r in results["rows"]]


@pytest.mark.slow
def test_the_same_run_twice_gives_the_same_quality(runs):
    first, second = runs
    assert _quality(first) == _quality(second)
    outputs = [[(i["config"], i.get("output"), i.get("replies"), i.get("nll")) for i in r["items"]]
               for r in runs]
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_lossless_configs_answer_as_dynamic_cache_and_the_model_finds_the_passkey(runs):
    rows = {(r["task"], r["config"]): r for r in runs[0]["rows"]}
    assert rows[("passkey", "DynamicCache")]["accuracy"] == 1.0  # 384 tokens: the trained model finds it
    for config in ("dense", "paged16"):
        assert abs(rows[("ppl", config)]["delta_ppl"]) < 1e-4 * rows[("ppl", "DynamicCache")]["ppl"]
        for task in ("passkey", "needle", "multiturn"):
            assert rows[(task, config)]["accuracy"] == rows[(task, "DynamicCache")]["accuracy"]
    items = runs[0]["items"]
    for task, field in (("passkey", "output"), ("needle", "output"), ("multiturn", "replies")):
        answers = {i["config"]: i[field] for i in items if i["task"] == task}
        assert answers["dense"] == answers["paged16"] == answers["DynamicCache"], (task, answers)


@pytest.mark.slow
def test_prompts_only_and_report_with_peer_rows(tmp_path, runs):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [*ARGS, "--out", str(out), "--prompts-only"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["prompts.jsonl"]
    lines = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == ["needle-384-d0.5-0", "passkey-384-d0.5-0"] + [
        f"ppl-384-{i}" for i in range(4)]  # four perplexity windows by default

    (out / "results.json").write_text(json.dumps(runs[0]))
    rows = [{"peer": "kvpress", "press": press, "compression_ratio": ratio, "task": line["task"],
             "context": 384, "id": line["id"], "sha256": line["sha256"], "kv_bytes": 1000 * (1 - ratio),
             "tokens_seen": 10, "measured_compression_ratio": ratio, "depth": line.get("depth"),
             "correct": True, "nll": 8.0, "scored_tokens": 8}
            for line in lines for press, ratio in (("none", 0.0), ("knorm", 0.5))]
    peer = tmp_path / "kvpress.jsonl"
    peer.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = _report(out, peer)
    assert result.exit_code == 0, result.output
    report = (out / "report.md").read_text()
    assert "| kvpress/knorm@0.5 | external |" in report and (out / "tradeoff_passkey.png").exists()

    peer.write_text(json.dumps(dict(rows[0], sha256="f" * 64)) + "\n")
    result = _report(out, peer)
    assert result.exit_code != 0 and "answers a different prompt text" in " ".join(result.output.split())
