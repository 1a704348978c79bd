"""``kvfactory run`` on a tiny random Llama (fast): rows printed as each config finishes, the
80-column layout, decode segments interleaved with the baseline and their medians, and ``--all``."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import statistics

import pytest
import torch
from helpers import attn_implementation
from rich.cells import cell_len
from rich.console import Console
from tiny_models import tiny_model
from tiny_tokenizer import VOCAB, tiny_tokenizer
from typer.testing import CliRunner

from kvfactory import run as run_job
from kvfactory.cli import app
from kvfactory.measure import timed_continue, timed_generate
from kvfactory.run_configs import DEFAULT_CONFIGS, PRESETS

CONTEXT, NEW_TOKENS = 64, 10  # 3 segments of 3 decode tokens after the prefill's token
SIZES = [3, 3, 3]
# compact JSON names are the config's name: this one is wider than the name column at 80 columns
LONG = '{"type":"paged","page_size":8,"pool_tokens":4096}'
CONFIGS = ["paged16", "int4", "snapkv@0.75", "quest@0.125", LONG]
NAMES = [run_job.BASELINE, *CONFIGS]
LOSSLESS = {"paged16", LONG}


def _model() -> torch.nn.Module:
    return tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=1024)


class FakeClock:
    """Stands in for the run's timing calls: runs them for real and logs each (kind, which cache,
    prompt length given, output printed so far), and scripts every decode segment's speed so the
    medians the run reports are known."""

    def __init__(self, out: io.StringIO) -> None:
        self.out, self.calls, self.caches = out, [], []

    def _cache(self, cache) -> int:
        if not any(c is cache for c in self.caches):
            self.caches.append(cache)
        return next(i for i, c in enumerate(self.caches) if c is cache)

    def generate(self, model, inputs, cache, max_new_tokens, **kwargs):
        self.calls.append(("prefill", self._cache(cache), inputs["input_ids"].shape[1], self.out.getvalue()))
        return timed_generate(model, inputs, cache, max_new_tokens, **kwargs)

    def continue_(self, model, sequences, cache, max_new_tokens, **kwargs):
        timing = timed_continue(model, sequences, cache, max_new_tokens, **kwargs)
        self.calls.append(("decode", self._cache(cache), sequences.shape[1], self.out.getvalue()))
        speed = self.speed(len(self.calls) - 1)
        return dataclasses.replace(timing, decode_s=(timing.new_tokens - 1) / speed)

    @staticmethod
    def speed(call: int) -> float:
        return 5.0 + (call * 7) % 11  # tokens/s, not monotonic in the call order


@pytest.fixture(scope="module")
def tiny_run():
    """One ``compare`` of the configs on the tiny Llama, printed to an 80-column console."""
    out = io.StringIO()
    clock = FakeClock(out)
    with pytest.MonkeyPatch.context() as patch, attn_implementation(_model(), "kvfactory") as model:
        patch.setattr(run_job, "timed_generate", clock.generate)
        patch.setattr(run_job, "timed_continue", clock.continue_)
        report = run_job.compare(model, tiny_tokenizer(), run_job.parse_configs(CONFIGS), CONTEXT, NEW_TOKENS,
                                 Console(file=out, width=80))
    warm_up = 2 * len(NAMES)  # a prefill and one continuation per config first
    return report, out.getvalue(), clock, warm_up


def test_every_name_in_full_at_80_columns(tiny_run):
    report, out, _, _ = tiny_run
    assert all(cell_len(line) <= 80 for line in out.splitlines()), out  # the tiny model writes control bytes
    for result in report["results"]:
        name = re.escape(result["name"])
        # the name starts its line; the numbers follow on it, or on the next line for a long name
        separator = r"\n +" if result["name"] == LONG else " +"
        assert re.search(rf"^{name}{separator}[\d.]+ (B|KiB|MiB) ", out, re.M), (result["name"], out)
    answers = [line for line in out.splitlines() if line.startswith("  → ")]
    assert len(answers) == len(NAMES)


def _rows(out: str) -> dict[str, str]:
    """Printed rows so far: each config's name and its numbers (the line after a long name)."""
    rows, lines = {}, out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  → "):  # a row's answer: the name starts the last unindented line above
            name_line = lines[i - 1] if not lines[i - 1].startswith(" ") else lines[i - 2]
            rows[name_line.split()[0]] = lines[i - 1]
    return rows


def test_same_tokens_column(tiny_run):
    report, out, _, _ = tiny_run
    rows = _rows(out)
    assert list(rows) == NAMES
    assert rows[run_job.BASELINE].endswith(" ref")
    for result in report["results"][1:]:
        if result["name"] in LOSSLESS:
            assert result["equal"], result
        assert result["equal"] or run_job.lossy(result["config"]), result
        cell = "yes" if result["equal"] else f"{result['same_prefix']}/{NEW_TOKENS}"
        assert rows[result["name"]].endswith(f" {cell}"), (result["name"], out)


def test_each_row_is_printed_before_the_next_config_starts(tiny_run):
    _, out, clock, warm_up = tiny_run
    prefills = [call for call in clock.calls[warm_up:] if call[0] == "prefill"]
    assert len(prefills) == len(NAMES)
    for i, (_, _, _, printed) in enumerate(prefills):
        assert list(_rows(printed)) == NAMES[:i]  # every earlier config's row, and no other
    assert list(_rows(out)) == NAMES


def test_segments_interleave_with_the_baseline_from_the_prompt(tiny_run):
    report, _, clock, warm_up = tiny_run
    calls = [(kind, cache) for kind, cache, _, _ in clock.calls[warm_up:]]
    base = calls[0][1]
    assert calls[:4] == [("prefill", base)] + [("decode", base)] * 3
    blocks = [calls[4 + 7 * i:4 + 7 * (i + 1)] for i in range(len(CONFIGS))]
    assert len(calls) == 4 + 7 * len(CONFIGS)
    for block in blocks:  # the config's prefill, then the baseline (a copy of its prompt cache) and it
        (kind, cache), rewound = block[0], block[1][1]
        assert kind == "prefill" and rewound not in (base, cache)
        assert block[1:] == [("decode", rewound), ("decode", cache)] * 3
    prompt = report["prompt_tokens"]
    for i, (kind, _, length, _) in enumerate(clock.calls[warm_up:]):
        if kind == "decode" and calls[i - 1][0] == "prefill":  # a pass's first segment starts at the prompt
            assert length == prompt + 1
    assert report["decode_segments"] == SIZES


def test_speeds_are_medians_of_paired_segments(tiny_run):
    report, _, clock, warm_up = tiny_run
    decodes = {}  # cache -> call indices of its segments (the order is checked above)
    for i, (kind, cache, _, _) in enumerate(clock.calls[warm_up:], start=warm_up):
        if kind == "decode":
            decodes.setdefault(cache, []).append(i)
    base = clock.calls[warm_up][1]
    own = [clock.speed(i) for i in decodes[base][:3]]  # the baseline's own run, then a pass per config
    pairs = {run_job.BASELINE: list(zip(own, own, strict=True))}
    configs = range(base + 1, base + 2 * len(CONFIGS), 2)  # each followed by its baseline's copy
    for name, cache in zip(CONFIGS, configs, strict=True):
        pairs[name] = [(clock.speed(i), clock.speed(i - 1)) for i in decodes[cache]]  # after the baseline's
    for result in report["results"]:
        segments, expected = result["segments"], pairs[result["name"]]
        ratios = [c / b for c, b in expected]
        assert [s["tokens"] for s in segments] == SIZES
        assert [s["tokens_per_s"] for s in segments] == pytest.approx([c for c, _ in expected])
        assert [s["baseline_tokens_per_s"] for s in segments] == pytest.approx([b for _, b in expected])
        assert [s["ratio"] for s in segments] == pytest.approx(ratios)
        assert result["decode_tokens_per_s"] == pytest.approx(statistics.median(c for c, _ in expected))
        assert result["speed_ratio"] == pytest.approx(statistics.median(ratios))
    assert len({r["speed_ratio"] for r in report["results"]}) > 2  # the scripted speeds differ


def test_medians_are_of_the_paired_ratios():
    segments = [run_job.Segment(3, c, b, c / b) for c, b in [(30.0, 10.0), (10.0, 20.0), (20.0, 30.0)]]
    assert run_job.medians(segments) == (20.0, pytest.approx(2 / 3))  # not 20 / 20: pairs, not medians


@pytest.mark.parametrize("config", [None, {"type": "paged", "page_size": 16}])
def test_segmented_greedy_decode_gives_one_generate_call_s_tokens(config):
    model = _model()
    inputs = tiny_tokenizer()(run_job.build_prompt(tiny_tokenizer(), CONTEXT), return_tensors="pt")
    whole = timed_generate(model, inputs, run_job._new_cache(model, config), NEW_TOKENS).sequences
    decode, _ = run_job._prefill(model, inputs, config)
    run_job.decode_interleaved(model, [decode], run_job.segment_sizes(NEW_TOKENS - 1))
    assert torch.equal(decode.sequences, whole)


def test_segment_sizes():
    assert run_job.segment_sizes(63) == [21, 21, 21]
    assert run_job.segment_sizes(8) == [3, 3, 2]


def _cli(monkeypatch, *args):
    """``kvfactory run ARGS`` at 80 columns with the tiny model in place of the embedded one."""
    monkeypatch.setattr(run_job, "load_model", lambda name: (_model(), tiny_tokenizer()))
    return CliRunner().invoke(app, ["run", *args], env={"COLUMNS": "80"})


def test_cli_json_and_80_columns(monkeypatch, tmp_path):
    out = tmp_path / "run.json"
    result = _cli(monkeypatch, "--context", str(CONTEXT), "--new-tokens", str(NEW_TOKENS),
                  "--configs", "paged16", "--configs", LONG, "--json", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == [run_job.BASELINE, "paged16", LONG]
    assert all(r["equal"] and len(r["segments"]) == 3 for r in report["results"])
    for name in (run_job.BASELINE, "paged16", LONG):
        assert re.search(rf"^{re.escape(name)}( |\n)", result.output, re.M), result.output


@pytest.mark.parametrize(("args", "names"), [
    ([], list(DEFAULT_CONFIGS)),
    (["--all"], list(PRESETS)),
    (["--configs", "int8"], ["int8"]),
])
def test_cli_config_sets(monkeypatch, args, names):
    chosen = []
    monkeypatch.setattr(run_job, "compare", lambda _model, _tok, configs, *_: chosen.append(list(configs)))
    result = _cli(monkeypatch, *args)
    assert result.exit_code == 0, result.output
    assert chosen == [names]


def test_cli_all_and_configs_conflict(monkeypatch):
    result = _cli(monkeypatch, "--all", "--configs", "int8")
    assert result.exit_code == 2
    assert "--all runs every preset" in " ".join(result.output.split())


def test_a_model_with_sliding_window_layers_runs_every_row() -> None:
    """A sliding layer of ``DynamicCache`` cannot be cropped back to the prompt: the baseline's
    segments restart from a copy of its cache after the prefill, past the window here."""
    model = tiny_model("mistral-sw8", vocab_size=VOCAB, max_position_embeddings=1024)
    with attn_implementation(model, "kvfactory") as model:
        report = run_job.compare(model, tiny_tokenizer(), run_job.parse_configs(["paged16"]), CONTEXT,
                                 NEW_TOKENS, Console(file=io.StringIO(), width=80))
    assert report["prompt_tokens"] > 8 and [r["equal"] for r in report["results"]] == [True, True]


def test_a_row_above_the_baseline_s_bytes_says_why() -> None:
    from kvfactory.presets import load_preset

    assert "save reads, not memory" in run_job.more_bytes_reason(load_preset("quest@0.125"))
    assert "unquantized" in run_job.more_bytes_reason(load_preset("int4"))
    assert "partly empty" in run_job.more_bytes_reason(load_preset("paged16"))
