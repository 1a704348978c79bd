"""Peers in another process: the prompts file a run writes, and merging a peer's rows into the report."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from eval_pipeline import CONTEXTS, SETTINGS, TASKS, corpus, pipeline_results
from tiny_tokenizer import tiny_tokenizer

from kvfactory.eval import exchange
from kvfactory.eval.report import write_report
from kvfactory.eval.runner import build_prompts


@pytest.fixture(scope="module")
def prompt_sets():
    return build_prompts(tiny_tokenizer(), TASKS, SETTINGS, corpus())


@pytest.fixture
def prompts_file(tmp_path, prompt_sets):
    return exchange.write_prompts(prompt_sets, tmp_path / exchange.PROMPTS_FILE)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prompts_file_holds_the_peer_tasks_with_stable_ids_and_hashes(prompts_file, prompt_sets):
    lines = _lines(prompts_file)
    assert {line["task"] for line in lines} == set(exchange.PEER_TASKS)  # no multi-turn
    assert len({line["id"] for line in lines}) == len(lines)
    assert len(lines) == sum(len(v) for (task, _), v in prompt_sets.items() if task in exchange.PEER_TASKS)
    again = build_prompts(tiny_tokenizer(), TASKS, SETTINGS, corpus())  # seeded: the same prompts
    assert exchange.write_prompts(again, prompts_file.with_name("again.jsonl")).read_text() == \
        prompts_file.read_text()
    passkey = next(line for line in lines if line["task"] == "passkey")
    assert passkey["id"] == f"passkey-{CONTEXTS[0]}-d0.2-0" and passkey["max_new_tokens"] == 10
    assert passkey["prompt"].endswith("What is the pass key? The pass key is")
    ppl = next(line for line in lines if line["task"] == "ppl")
    assert len(ppl["input_ids"]) == ppl["prefill"] + SETTINGS.ppl_continuation
    record = prompt_sets[("passkey", CONTEXTS[0])][0]
    assert exchange.record_line(record)["sha256"] == passkey["sha256"]
    assert exchange.record_line(dataclasses.replace(record, answer="00000"))["sha256"] != passkey["sha256"]


def _peer_rows(prompts_file) -> list[dict]:
    """kvpress-like rows with known numbers: the no-press run gets everything right, snapkv@0.5 only
    depth 0.2, at half the bytes; perplexity e^2 without a press, e^2.5 with it."""
    rows = []
    for line in _lines(prompts_file):
        for press, ratio, per_token in (("none", 0.0, 100), ("snapkv", 0.5, 50)):
            seen = line["prefill"] + SETTINGS.ppl_continuation - 1 if line["task"] == "ppl" else 300
            row = {"peer": "kvpress", "press": press, "compression_ratio": ratio, "task": line["task"],
                   "context": line["context"], "id": line["id"], "sha256": line["sha256"],
                   "kv_bytes": seen * per_token, "tokens_seen": seen, "measured_compression_ratio": ratio,
                   "press_params": {"compression_ratio": ratio} if press != "none" else {}}
            if line["task"] == "ppl":
                scored = SETTINGS.ppl_continuation
                row |= {"nll": (2.0 if press == "none" else 2.5) * scored, "scored_tokens": scored}
            else:
                row |= {"depth": line["depth"], "correct": press == "none" or line["depth"] == 0.2}
            rows.append(row)
    return rows


def _drop_baseline(rows: list[dict]) -> None:
    rows[:] = [r for r in rows if r["press"] != "none"]


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def after_results() -> dict:
    """A run scored with the question fed after the compressed context, as kvpress scores."""
    results = {k: v for k, v in pipeline_results().items() if k != "_units"}
    return results | {"settings": results["settings"] | {"question": "after"}}


def test_kvpress_rows_merge_only_into_a_question_after_run(tmp_path, prompts_file):
    peer = tmp_path / "kvpress.jsonl"
    _write(peer, _peer_rows(prompts_file))
    inside = {k: v for k, v in pipeline_results().items() if k != "_units"}
    with pytest.raises(exchange.PeerResultsError, match="--question after"):
        exchange.merge_peer_rows(inside, peer, prompts_file)


def test_merge_aggregates_peer_rows_against_their_own_baseline(tmp_path, prompts_file):
    peer = tmp_path / "kvpress.jsonl"
    _write(peer, _peer_rows(prompts_file))
    results = after_results()
    merged = exchange.merge_peer_rows(results, peer, prompts_file)
    assert results["rows"] is not merged["rows"] and "peer_results" not in results  # a new dict
    names = [c["name"] for c in merged["configs"]]
    assert names[:len(results["configs"])] == [c["name"] for c in results["configs"]]
    assert names[len(results["configs"]):] == ["kvpress/none", "kvpress/snapkv@0.5"]
    by = {(r["context"], r["task"], r["config"]): r for r in merged["rows"]}
    for context in CONTEXTS:
        snap, none = by[(context, "ppl", "kvpress/snapkv@0.5")], by[(context, "ppl", "kvpress/none")]
        assert math.isclose(none["ppl"], math.exp(2.0)) and math.isclose(snap["ppl"], math.exp(2.5))
        assert math.isclose(snap["delta_ppl"], math.exp(2.5) - math.exp(2.0)) and none["delta_ppl"] == 0.0
        delta = 100 * (math.exp(0.5) - 1)  # every window 0.5 nats a token over kvpress/none's
        assert snap["window_delta_ppl_pct"] == pytest.approx([delta] * len(snap["window_nll"]))
        assert snap["delta_ppl_pct"] == pytest.approx(delta)
        assert snap["delta_ppl_pct_ci"] == pytest.approx([delta, delta])
        for task in ("passkey", "needle"):
            snap, none = by[(context, task, "kvpress/snapkv@0.5")], by[(context, task, "kvpress/none")]
            assert none["accuracy"] == 1.0 and snap["accuracy"] == 0.5
            assert snap["accuracy_by_depth"] == {"0.2": 1.0, "0.8": 0.0}
            assert math.isclose(snap["compression_ratio"], 0.5) and none["compression_ratio"] == 0.0
            assert math.isclose(snap["kv_bytes_ratio"], 0.5) and snap["decode_tokens_per_s"] is None
        assert (context, "multiturn", "kvpress/none") not in by
    again = exchange.merge_peer_rows(merged, peer, prompts_file)  # the same peer twice: replaced
    assert len(again["rows"]) == len(merged["rows"]) and again["configs"] == merged["configs"]

    paths = write_report(merged, tmp_path / "out")
    text = paths["report"].read_text()
    assert "| kvpress/snapkv@0.5 | external |" in text and "kvpress.jsonl" in text
    assert "heatmap_passkey_kvpress_none" not in text  # heat maps only for the run's own configs
    for task in ("ppl", "passkey", "needle", "multiturn"):  # multi-turn: the run's own configs alone
        assert paths[f"tradeoff_{task}"].read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(("change", "message"), [
    (lambda rows: rows[0].update(id="passkey-9999-d0.5-0"), "answers no prompt of this run"),
    (lambda rows: rows[0].update(sha256="0" * 64), "answers a different prompt text"),
    (lambda rows: rows[0].pop("sha256"), "answers a different prompt text"),
    (lambda rows: rows[0].pop("press"), "lacks press"),
    (lambda rows: _drop_baseline(rows), "no kvpress/none rows"),
])
def test_merge_rejects_rows_that_do_not_answer_this_run(tmp_path, prompts_file, change, message):
    rows = _peer_rows(prompts_file)
    change(rows)
    peer = tmp_path / "kvpress.jsonl"
    _write(peer, rows)
    results = after_results()
    with pytest.raises(exchange.PeerResultsError, match=message):
        exchange.merge_peer_rows(results, peer, prompts_file)


def test_unreadable_peer_files(tmp_path, prompts_file):
    results = {"configs": [], "rows": [], "settings": {"question": "after"}}
    with pytest.raises(exchange.PeerResultsError, match="cannot read peer results"):
        exchange.merge_peer_rows(results, tmp_path / "missing.jsonl", prompts_file)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"peer": "kvpress"}\n{not json\n')
    with pytest.raises(exchange.PeerResultsError, match=r"bad.jsonl:2: not JSON"):
        exchange.merge_peer_rows(results, bad, prompts_file)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(exchange.PeerResultsError, match="no rows"):
        exchange.merge_peer_rows(results, empty, prompts_file)
