"""``kvfactory serve``'s refusals: configs the engine cannot serve end before anything listens."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvfactory.cli import app

WIDE = {"COLUMNS": "200"}


@pytest.mark.parametrize(("cache", "says"), [("transformers/quanto-int4", "kvfactory's paged configs"),
                                             ("DynamicCache", "kvfactory's paged configs"),
                                             ("no-such-preset", "--cache")])
def test_caches_the_engine_cannot_serve_are_usage_errors(cache: str, says: str) -> None:
    result = CliRunner().invoke(app, ["serve", "--cache", cache], env=WIDE)
    assert result.exit_code == 2
    assert says in result.output


@pytest.mark.slow
def test_a_dense_config_fails_before_serving() -> None:
    result = CliRunner().invoke(app, ["serve", "--cache", "dense", "--port", "1"], env=WIDE)
    assert result.exit_code == 2
    assert "error: ConfigError" in result.output and "KVCacheManager" in result.output


@pytest.mark.slow
@pytest.mark.parametrize(("flag", "prefill_first"), [([], False), (["--prefill-first"], True),
                                                     (["--mixed-steps"], False)])
def test_scheduling_options_reach_the_engine(monkeypatch, flag: list[str], prefill_first: bool) -> None:
    from kvfactory.server import serve as serve_app

    served = []
    monkeypatch.setattr(serve_app, "run", lambda application, *args: served.append(application))
    result = CliRunner().invoke(app, ["serve", "--preemption", "recompute", *flag], env=WIDE)
    assert result.exit_code == 0, result.output
    engine = served[0].state.runner.engine
    assert engine.scheduler.prefill_first is prefill_first and engine.memory.preemption == "recompute"
