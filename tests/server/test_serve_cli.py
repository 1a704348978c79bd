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


@pytest.mark.slow
def test_retraining_on_drift_attaches_to_the_engine(monkeypatch) -> None:
    from kvfactory.selectors.oval.drift import DriftRetrainer
    from kvfactory.server import serve as serve_app

    served = []
    monkeypatch.setattr(serve_app, "run", lambda application, *args: served.append(application))
    args = ["serve", "--cache", "oval@0.125", "--retrain-on-drift", "0.7", "--drift-seconds", "60"]
    result = CliRunner().invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    [hook] = served[0].state.runner.engine.memory.cache_hooks
    retrainer = hook.__self__
    assert isinstance(retrainer, DriftRetrainer)
    assert (retrainer.alert.threshold, retrainer.alert.duration_s) == (0.7, 60.0)


@pytest.mark.slow
def test_retraining_on_drift_needs_a_query_scorer(monkeypatch) -> None:
    from kvfactory.server import serve as serve_app

    monkeypatch.setattr(serve_app, "run", lambda application, *args: pytest.fail("served"))
    args = ["serve", "--cache", "quest@0.125", "--retrain-on-drift", "0.7"]
    result = CliRunner().invoke(app, args, env=WIDE)
    assert result.exit_code == 2 and "'quest'" in result.output
