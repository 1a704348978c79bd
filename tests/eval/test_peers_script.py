"""The kvpress peer's scripts (benchmarks/peers/): prompt format, scoring, and that they stay apart.

The peer itself runs in its own virtualenv (transformers<5.3); these tests need neither it nor kvpress.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
FIELDS = {"task", "context", "depth", "prompt", "question", "answer", "id"}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"peers_{name}", PEERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_prompts_follow_the_passkey_format(tmp_path):
    out = tmp_path / "prompts.jsonl"
    subprocess.run([sys.executable, str(PEERS / "make_smoke_prompts.py"), str(out)], check=True,
                   capture_output=True)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["depth"] for r in records] == [0.3, 0.7]
    for r in records:
        assert set(r) == FIELDS and r["task"] == "passkey" and r["context"] == 512
        assert len(r["answer"]) == 5 and r["answer"].isdigit()
        line = f"The pass key is {r['answer']}. Remember it. {r['answer']} is the pass key."
        assert r["prompt"].count(line) == 1 and r["prompt"].endswith("\n")
        assert r["question"] == "What is the pass key? The pass key is"
        where = r["prompt"].index(line) / len(r["prompt"])
        assert abs(where - r["depth"]) < 0.05
        words = len((r["prompt"] + r["question"]).split())
        assert 0.85 * 512 < words * _load("make_smoke_prompts").TOKENS_PER_WORD < 1.15 * 512


def test_passkey_depth_edges():
    smoke = _load("make_smoke_prompts")
    first = smoke.passkey_record(256, 0.0, "12345")["prompt"]
    last = smoke.passkey_record(256, 1.0, "12345")["prompt"]
    assert first.startswith("The pass key is 12345.")
    assert last.rstrip("\n").endswith("12345 is the pass key.")
    with pytest.raises(ValueError):
        smoke.passkey_record(256, 1.5, "12345")


def test_scoring_rules():
    run = _load("run_kvpress")
    passkey = {"task": "passkey", "answer": "12345", "id": "p"}
    assert run.score(passkey, " 12345. Remember it.")
    assert not run.score(passkey, " 123456")  # the exact key, not a longer number holding it
    assert not run.score(passkey, " the pass key.")
    needle = {"task": "needle", "answer": "eat a sandwich in Dolores Park", "id": "n"}
    assert run.score(needle, " Eat a Sandwich and sit in dolores park.")
    assert run.score(needle, " a sandwich in Dolores\n Park")
    assert not run.score(needle, " sit in Dolores Park")
    with pytest.raises(ValueError):
        run.score({"task": "other", "answer": "x", "id": "o"}, "x")


def test_summary_groups_by_press_ratio_task_context():
    run = _load("run_kvpress")
    rows = [
        {"press": "snapkv", "compression_ratio": 0.5, "task": "passkey", "context": 2048, "correct": c,
         "seconds": s, "measured_compression_ratio": 0.5}
        for c, s in ((True, 1.0), (False, 3.0), (True, 2.0))
    ]
    (summary,) = run.summarise(rows)
    assert summary["n"] == 3 and summary["accuracy"] == pytest.approx(2 / 3)
    assert summary["median_seconds"] == 2.0 and summary["peer"] == "kvpress"


def test_summary_pools_perplexity_and_keeps_accuracy_for_retrieval():
    run = _load("run_kvpress")
    common = {"press": "tova", "compression_ratio": 0.5, "context": 2048, "measured_compression_ratio": 0.5,
              "seconds": 1.0}
    ppl = [dict(common, task="ppl", nll=nll, scored_tokens=128) for nll in (256.0, 384.0)]
    passkey = [dict(common, task="passkey", correct=True)]
    by_task = {s["task"]: s for s in run.summarise(ppl + passkey)}
    assert by_task["ppl"]["ppl"] == pytest.approx(math.exp(640 / 256)) and "accuracy" not in by_task["ppl"]
    assert by_task["ppl"]["n"] == 2
    assert by_task["passkey"]["accuracy"] == 1.0 and "ppl" not in by_task["passkey"]


def test_rows_carry_the_records_id_and_sha256():
    run = _load("run_kvpress")
    assert run.identity_fields({"id": "a", "sha256": "f00d", "prompt": "p"}) == {"id": "a", "sha256": "f00d"}
    assert run.identity_fields({"id": "a"}) == {"id": "a"}


def test_timing_and_kept_fields():
    run = _load("run_kvpress")
    prefilled = run.Prefilled("snapkv", 0.5, None, None, 2.0, True, None)
    assert run.timing_fields(prefilled, 0.5) == {"seconds": 2.5, "prefill_s": 2.0, "answer_s": 0.5,
                                                 "prefill_shared": True}
    kept = run.kept_fields([64, 100, 136], 200)
    assert kept == {"kept_tokens_mean": 100.0, "kept_tokens_min": 64, "kept_tokens_max": 136,
                    "measured_compression_ratio": 0.5}


def test_peer_scripts_never_import_kvfactory():
    # The peer's venv has transformers<5.3; kvfactory needs 5.24.
    for path in PEERS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "kvfactory" for n in names), path


@pytest.mark.parametrize("script", ["setup_kvpress.sh", "run.sh"])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(PEERS / script)], check=True)


def test_pins_are_exact():
    lines = [line.strip() for line in (PEERS / "requirements-kvpress.txt").read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert pins["kvpress"] == "0.5.5" and pins["torch"] == "2.13.0"
    assert pins["transformers"].startswith("5.2.")


def test_kvfactory_eval_records_are_split_into_context_and_question():
    run = _load("run_kvpress")
    whole = {"task": "passkey", "context": 2048, "depth": 0.5, "sample": 3, "answer": "12345",
             "prompt": "Filler. The pass key is 12345.\nWhat is the pass key? The pass key is",
             "prompt_tokens": 20}
    record = run.normalise_record(whole)
    assert record["prompt"] == "Filler. The pass key is 12345.\n"
    assert record["question"] == "What is the pass key? The pass key is"
    assert record["id"] == "passkey-2048-d0.5-3"
    needle = dict(whole, task="needle", prompt="Hay . " + run.QUESTION_SUFFIXES["needle"])
    assert run.normalise_record(needle)["prompt"] == "Hay . "
    peers = {"task": "passkey", "context": 1, "depth": 0.1, "prompt": "p", "question": "q", "answer": "1",
             "id": "x"}
    assert run.normalise_record(peers) == peers
    with pytest.raises(SystemExit):
        run.normalise_record(dict(whole, prompt="no question here"))


def test_ppl_records_are_checked_and_get_an_id():
    run = _load("run_kvpress")
    window = {"task": "ppl", "context": 4, "sample": 2, "input_ids": [5, 6, 7, 8, 9, 10], "prefill": 4,
              "sha256": "abc"}
    record = run.normalise_record(window)
    assert record == dict(window, id="ppl-4-2")
    assert run.normalise_record(dict(window, id="mine"))["id"] == "mine"
    for bad in ({"prefill": 6}, {"prefill": 0}, {"input_ids": None}, {"prefill": "4"}):
        with pytest.raises(SystemExit):
            run.normalise_record(dict(window, **bad))


def test_question_suffixes_match_kvfactory_eval():
    data = pytest.importorskip("kvfactory.eval.data")
    run = _load("run_kvpress")
    assert run.QUESTION_SUFFIXES == {"passkey": data.PASSKEY_QUESTION, "needle": data.NEEDLE_QUESTION}


class _CharTokenizer:
    bos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids.reshape(-1).tolist())


def test_question_inside_is_compressed_with_the_context():
    run = _load("run_kvpress")
    record = {"prompt": "ab", "question": "c"}
    context, question, joined = run.tokenise(None, _CharTokenizer(), record, bos=True, question="inside")
    assert context.tolist() == [[1, 97, 98, 99]] and question.shape == (1, 0) and joined


def test_question_inside_answers_from_the_prefill_then_the_pipeline_decodes():
    torch = pytest.importorskip("torch")
    from transformers import DynamicCache

    run = _load("run_kvpress")
    calls = []

    class Pipe:
        tokenizer = _CharTokenizer()

        class model:  # noqa: N801 - stands in for the pipeline's model attribute
            class generation_config:  # noqa: N801
                eos_token_id = 2

            @staticmethod
            def lm_head(hidden):
                return hidden  # the "logits" are the hidden state: argmax picks its largest entry

        def generate_answer(self, question_ids, cache, context_length, max_new_tokens):
            calls.append((question_ids.tolist(), context_length, max_new_tokens))
            cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)  # the fed token + one more
            return "yz"

        def _remove_answer_from_cache(self, cache, lengths):
            cache.layers[0].keys = cache.layers[0].keys[:, :, :lengths[0]]

    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4), 0)  # 5 kept of the compressed prompt
    hidden = torch.zeros(1, 128)
    hidden[0, ord("x")] = 1.0
    answer = run.answer_inside(Pipe(), cache, hidden, context_length=9, max_new_tokens=3)
    assert answer.generated == "xyz" and calls == [([[ord("x")]], 9, 2)]
    assert answer.kept == [5] and answer.fed == 2 and cache.get_seq_length(0) == 5
    hidden[0, 2] = 9.0  # the first token is EOS: nothing more is decoded
    assert run.answer_inside(Pipe(), cache, hidden, context_length=9, max_new_tokens=3).fed == 0
    assert len(calls) == 1
