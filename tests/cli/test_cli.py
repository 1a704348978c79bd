"""The ``kvfactory`` command line: ``size`` (fast) and one small real ``run`` (slow)."""

import importlib.util
import json
import re

import pytest
from transformers import LlamaConfig, MistralConfig
from typer.testing import CliRunner

import kvfactory
from kvfactory import models, run_configs
from kvfactory import run as run_job
from kvfactory.cli import app
from kvfactory.texts import shipped_text

WIDE = {"COLUMNS": "200"}  # rich wraps tables to the terminal width


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=WIDE)


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-shape")
    LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                hidden_size=576, max_position_embeddings=8192).save_pretrained(folder)
    return folder


def test_size_from_model_folder_and_config_file(smollm2_shape):
    for model in (smollm2_shape, smollm2_shape / "config.json"):
        result = invoke("size", "--model", str(model), "--context", "8192", "--memory", "8GiB")
        assert result.exit_code == 0, result.output
        assert "768 B" in result.output
        assert "23,040 B" in result.output
        assert "188,743,680 B" in result.output  # 23040 * 8192
        assert "372,827 tokens" in result.output
        assert "8,192" in result.output


def test_size_codec_batch_dtype(smollm2_shape):
    result = invoke("size", "--model", str(smollm2_shape), "--codec", "int4", "--batch", "4",
                    "--context", "1000", "--dtype", "fp32", "--memory", "512MiB")
    assert result.exit_code == 0, result.output
    assert "6,660 B" in result.output and f"{6660 * 1000 * 4:,} B" in result.output
    assert f"{512 * 2**20 // (6660 * 4):,} tokens" in result.output


def test_size_sliding_window_model(tmp_path):
    MistralConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  sliding_window=100).save_pretrained(tmp_path)
    result = invoke("size", "--model", str(tmp_path), "--memory", "1GiB")
    assert result.exit_code == 0, result.output
    assert "4 sliding" in result.output and "unbounded" in result.output


@pytest.mark.skipif(importlib.util.find_spec(models.GGUF_PACKAGE) is None, reason="no embedded model")
def test_size_embedded_model():
    result = invoke("size")
    assert result.exit_code == 0, result.output
    assert "23,040 B" in result.output and "372,827 tokens" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--memory", "8q"], "memory '8q'"),
    (["--memory", "0"], "at least 1 byte"),
    (["--model", "/no/such/config.json"], "is neither one of"),
    (["--codec", "int3"], "int3"),
    (["--dtype", "fp64"], "fp64"),
    (["--context", "0"], "--context"),
])
def test_size_bad_values(args, message, smollm2_shape):
    if "--model" not in args:
        args = ["--model", str(smollm2_shape), *args]
    result = invoke("size", *args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


@pytest.mark.parametrize(("config", "message"), [
    ("nope", "expected a preset (dense, paged16, paged256"),
    ('{"type": "paged", "page_size": 0}', "page_size"),
    ('{"type": "mystery"}', "mystery"),
])
def test_run_rejects_bad_configs_before_loading(config, message):
    result = invoke("run", "--configs", config)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


class _WordTokenizer:
    """Stands in for a tokenizer: one token per whitespace-separated word."""

    def __call__(self, text, return_offsets_mapping, add_special_tokens):
        return {"offset_mapping": [m.span() for m in re.finditer(r"\S+", text)]}


def test_build_prompt_holds_context_tokens_in_whole_sentences():
    text = shipped_text()
    assert text.startswith(" = Robert Boulter = ") and len(text) > 70_000
    prompt = run_job.build_prompt(_WordTokenizer(), 300)
    body = prompt.removesuffix(run_job.QUESTION)
    assert body != prompt and text.startswith(body)
    assert len(body.split()) >= 300
    assert body.endswith(" .") or body.endswith("\n")
    with pytest.raises(run_job.RunError, match="shipped text holds only"):
        run_job.build_prompt(_WordTokenizer(), len(text.split()) + 1)


@pytest.mark.slow
def test_run_small(tmp_path):
    out = tmp_path / "run.json"
    result = invoke("run", "--context", "256", "--new-tokens", "10", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert re.search(rf"^{run_job.BASELINE} .* ref$", result.output, re.M), result.output
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == [run_job.BASELINE, *run_configs.DEFAULT_CONFIGS]
    for r in report["results"][1:]:  # a row per config; lossless ones give DynamicCache's tokens
        lossy = run_job.lossy(r["config"])
        assert r["equal"] or lossy, r
        assert r["answer"] and r["same_prefix"] >= (1 if lossy else 10)
        assert [s["tokens"] for s in r["segments"]] == [3, 3, 3]
        cell = "yes" if r["equal"] else f"{r['same_prefix']}/10"
        row = rf"^{re.escape(r['name'])} .* {re.escape(cell)}$"
        assert re.search(row, result.output, re.M), result.output
    assert report["new_tokens"] == 10 and report["prompt_tokens"] > 256
    baseline = report["results"][0]
    assert baseline["bytes_per_token"] == 30 * 3 * 64 * 2 * 4  # fp32 DynamicCache holds exactly its tokens
    assert report["answer"].strip()


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"kvfactory {kvfactory.__version__}"


def test_help_starts_without_torch() -> None:
    """``kvfactory --help`` imports neither torch nor transformers (it starts in well under 2 s):
    commands import what they need when they run."""
    import subprocess
    import sys

    code = "import sys, kvfactory.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["eval", "serve", "run"])
def test_help_names_every_option_in_full_at_80_columns(command: str) -> None:
    import typer.main

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and "…" not in result.output
    click_command = typer.main.get_command(app).commands[command]
    for param in click_command.params:
        assert all(name in result.output for name in param.opts), (param.opts, result.output)
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_run_eval_and_serve_share_one_vocabulary() -> None:
    """Every name ``kvfactory run`` prints is a preset ``eval`` and ``serve`` take, and the other
    way round; a whole number after POLICY@ is the tokens kept."""
    from kvfactory.eval.runner import resolve_cache
    from kvfactory.presets import load_preset

    for name in run_configs.PRESETS:
        assert resolve_cache(name).config == run_job.parse_configs([name])[name] == load_preset(name)
    for name in ("fp8", "int2", "h2o@0.5", "recent@0.25"):
        assert run_job.parse_configs([name])[name] == load_preset(name)
    streaming = load_preset("streaming_llm@1024")["strategies"][1]
    assert (streaming["policy"], streaming["budget"]) == ("streaming_llm", 1024)
