"""``SamplingParams`` take exactly what the sampler can represent: whatever passes its checks draws
a token from any finite logits, and what cannot be drawn is refused naming the field."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfactory.engine.params import MAX_SEED, MIN_TEMPERATURE, SamplingParams
from kvfactory.engine.request import Request
from kvfactory.engine.sampler import Sampler
from kvfactory.errors import ConfigError

VOCAB = 64


@pytest.mark.parametrize("field, value", [
    ("temperature", 1e-320), ("temperature", MIN_TEMPERATURE / 2), ("temperature", math.inf),
    ("temperature", math.nan), ("temperature", 2.5), ("temperature", -1.0), ("seed", 2**64), ("seed", -1),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_k", -2), ("max_tokens", 0),
    ("stop", ["x"] * 17), ("stop", ["x" * 1025]), ("stop", [""]), ("stop_token_ids", [-1])])
def test_values_the_sampler_cannot_take_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        SamplingParams(**{field: value})
    assert err.value.key == field


def test_the_edges_are_accepted() -> None:
    SamplingParams(temperature=MIN_TEMPERATURE, seed=MAX_SEED, top_p=5e-324, stop=["x"] * 16)
    SamplingParams(temperature=2, top_k=10**30)


numbers = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-2**70, 2**70)


@settings(max_examples=300, deadline=None)
@given(temperature=numbers, top_p=numbers, top_k=st.integers(-5, 2**70),
       seed=st.none() | st.integers(-5, 2**70), scale=st.floats(1e-3, 1e4))
def test_whatever_passes_the_checks_draws_a_token(temperature, top_p, top_k, seed, scale) -> None:
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except ConfigError:
        return
    logits = torch.randn(2, VOCAB) * scale
    requests = [Request("a", [1], params), Request("b", [1], SamplingParams())]
    draws = Sampler()(logits, requests)
    assert draws.failures == {}
    assert all(0 <= token < VOCAB for token in draws.tokens)
    assert draws.tokens[1] == int(logits[1].argmax())


def test_rows_without_finite_logits_fail_alone() -> None:
    logits = torch.randn(3, VOCAB)
    logits[1, 5] = math.nan
    requests = [Request(name, [1], SamplingParams(temperature=t, seed=0)) for name, t in
                (("a", 0.0), ("b", 0.7), ("c", 0.7))]
    draws = Sampler()(logits, requests)
    assert list(draws.failures) == [1] and draws.tokens[1] is None
    assert draws.tokens[0] == int(logits[0].argmax()) and draws.tokens[2] is not None
