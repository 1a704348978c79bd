"""Bad input gets a specific error at the earliest point, naming the value: config time where the
config alone can tell, the manager's calls, the command line (no tracebacks)."""

from __future__ import annotations

import pytest
from tiny_models import tiny_config, tiny_model
from tiny_tokenizer import VOCAB, tiny_tokenizer
from typer.testing import CliRunner

from kvfactory import ConfigError, KVCacheFactory, KVCacheManager, SequenceStateError, UnknownSequenceError
from kvfactory import run as run_job
from kvfactory.cli import app
from kvfactory.config import load_yaml

PAGED = {"type": "paged", "page_size": 4}


@pytest.mark.parametrize(("config", "key"), [
    ({"type": "paged", "page_size": 10**9}, "page_size"),
    ({"type": "paged", "pool_tokens": 10**15}, "pool_tokens"),
    ({"type": "paged", "pool_blocks": 10**14}, "pool_blocks"),
    ({"type": "paged", "pool_bytes": 10}, "pool_bytes"),
    ({"type": "dense", "growth": float("nan")}, "growth"),
    ({"type": "dense", "growth": float("inf")}, "growth"),
    ({"type": ["paged"]}, "type"),
    ({"type": "composite", "strategies": [{"name": ["paged"]}]}, "strategies[0]"),
    ({"type": "dense", "quantization": {"codec": "int8", "layers": ["int8"]}}, "layers"),
])
def test_impossible_configs_fail_when_the_factory_is_made(config: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        KVCacheFactory(tiny_config("llama"), config)
    assert err.value.key == key


def test_a_yaml_file_that_is_not_utf8_is_a_config_error(tmp_path) -> None:
    path = tmp_path / "cache.yaml"
    path.write_bytes(b"type: paged\npage_size: \xff\xfe\n")
    with pytest.raises(ConfigError, match="cache.yaml"):
        load_yaml(path)


@pytest.mark.parametrize("host_bytes", ["abc", -1, 1.5, True])
def test_host_bytes_is_checked(host_bytes) -> None:
    with pytest.raises(ConfigError, match="host_bytes"):
        KVCacheManager(tiny_config("llama"), PAGED, host_bytes=host_bytes)


def test_unknown_shared_prefixes_and_closed_managers_are_named() -> None:
    manager = KVCacheManager(tiny_config("llama"), PAGED)
    with pytest.raises(UnknownSequenceError, match="nope"):
        manager.release_shared("nope")
    manager.create("a")
    manager.close()
    manager.close()  # twice is fine
    for call in (lambda: manager.create("b"), lambda: manager.get("a"), lambda: manager.swap_out(1),
                 lambda: manager.pin_prefix([1, 2, 3, 4])):
        with pytest.raises(SequenceStateError, match="closed"):
            call()


def cli(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_eval_with_a_missing_model_folder_says_so() -> None:
    result = cli("eval", "--model", "/nonexistent/model", "--tasks", "ppl")
    assert result.exit_code == 2 and "no such model folder" in result.output
    assert "Traceback" not in result.output


def test_a_ratio_out_of_range_is_named() -> None:
    result = cli("eval", "--cache", "snapkv@1.5", "--tasks", "ppl")
    assert result.exit_code == 2 and "compression_ratio=1.5" in result.output


def test_run_with_a_pool_too_small_prints_the_error_not_a_traceback(monkeypatch) -> None:
    model, tokenizer = tiny_model("llama", vocab_size=VOCAB), tiny_tokenizer()
    monkeypatch.setattr(run_job, "load_model", lambda name: (model, tokenizer))
    result = cli("run", "--context", "40", "--new-tokens", "8", "--configs",
                 '{"type": "paged", "page_size": 4, "pool_tokens": 16}')
    assert result.exit_code == 2, result.output
    assert "CacheFullError" in result.output and "pool exhausted" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
