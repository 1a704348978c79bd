"""Evaluation settings: the protocol's numbers, the budgeted defaults and their checks."""

from __future__ import annotations

import pytest

from kvfactory.eval.settings import DEFAULT, PROTOCOL, EvalSettings


def test_protocol_and_defaults() -> None:
    assert PROTOCOL.depths == (0.1, 0.3, 0.5, 0.7, 0.9) and PROTOCOL.keys_per_depth == 5
    assert PROTOCOL.ppl_continuation == 2048 and PROTOCOL.contexts == (2048, 6144)
    assert set(DEFAULT.depths) <= set(PROTOCOL.depths)  # the defaults are a subset of the protocol's depths
    assert len(DEFAULT.depths) * DEFAULT.keys_per_depth == 2  # the size settings.py's budget is computed for


@pytest.mark.parametrize("kwargs", [{"depths": (1.5,)}, {"depths": ()}, {"keys_per_depth": 0},
                                    {"contexts": (0,)}, {"facts": 0}, {"question": "before"}])
def test_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        EvalSettings(**kwargs)
