"""Evaluation settings: the protocol's numbers, the budgeted defaults and their checks."""

from __future__ import annotations

import pytest

from kvfactory.eval.settings import DEFAULT, PROTOCOL, EvalSettings


def test_protocol_and_defaults() -> None:
    assert PROTOCOL.depths == (0.1, 0.3, 0.5, 0.7, 0.9) and PROTOCOL.keys_per_depth == 5
    assert PROTOCOL.contexts == (2048, 6144) and PROTOCOL.task_contexts("ppl") == (2048, 6144)
    assert PROTOCOL.ppl_windows >= 4 and PROTOCOL.ppl_continuation >= 512  # the protocol: at least 4 x 512
    assert DEFAULT.ppl_windows >= 4 and DEFAULT.ppl_continuation >= 512  # perplexity follows the protocol
    assert DEFAULT.task_contexts("ppl") == (2048,) and DEFAULT.task_contexts("needle") == (2048, 6144)
    assert DEFAULT.all_contexts(["ppl"]) == (2048,)
    assert DEFAULT.all_contexts(["passkey", "ppl"]) == (2048, 6144)
    assert EvalSettings(contexts=(400,)).task_contexts("ppl") == (400,)
    assert set(DEFAULT.depths) <= set(PROTOCOL.depths)  # the defaults are a subset of the protocol's depths
    assert len(DEFAULT.depths) * DEFAULT.keys_per_depth == 2  # the size settings.py's budget is computed for


@pytest.mark.parametrize("kwargs", [{"depths": (1.5,)}, {"depths": ()}, {"keys_per_depth": 0},
                                    {"contexts": (0,)}, {"facts": 0}, {"question": "before"},
                                    {"ppl_contexts": ()}, {"ppl_windows": 0}])
def test_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        EvalSettings(**kwargs)


def test_command_line_contexts() -> None:
    from kvfactory.eval.command import settings_from_options

    default = settings_from_options(None, None, None, None)
    assert default == DEFAULT and default.task_contexts("ppl") == (2048,)
    given = settings_from_options((6144,), None, None, None)  # --context: ppl there too
    assert given.task_contexts("ppl") == (6144,) and given.task_contexts("passkey") == (6144,)
    both = settings_from_options((6144,), None, None, 256, ppl_windows=6, ppl_contexts=(1024,))
    assert both.task_contexts("ppl") == (1024,) and (both.ppl_windows, both.ppl_continuation) == (6, 256)
    assert default.seed == 0 and settings_from_options(None, None, None, None, seed=1).seed == 1  # --seed
