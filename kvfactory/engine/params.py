"""What a request asks of generation: ``SamplingParams``, checked when it is made.

Greedy decoding is ``temperature=0`` (the default). With ``temperature > 0`` the next token is drawn
from the softmax of the logits divided by the temperature, restricted to the ``top_k`` most likely
tokens and then to the smallest set whose probability reaches ``top_p`` (nucleus sampling, Holtzman
et al. 2020); a ``seed`` makes one request's draws reproducible whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfactory.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates; every value is checked here (``ConfigError`` naming the field)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings
    stop_token_ids: tuple[int, ...] = ()  # ... or after one of these tokens (the model's EOS always)
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token (benchmarks)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _integer("max_tokens", self.max_tokens, 1, "an integer >= 1 (tokens to generate)")
        _number("temperature", self.temperature, 0.0, None, "a number >= 0 (0: greedy)")
        _number("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1]")
        if self.top_p <= 0:
            raise ConfigError("top_p", self.top_p, "a number in (0, 1]")
        _integer("top_k", self.top_k, 0, "an integer >= 0 (0: no limit)")
        if self.seed is not None:
            _integer("seed", self.seed, 0, "an integer >= 0 or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError("stop", self.stop, "non-empty strings")
        for token in self.stop_token_ids:
            _integer("stop_token_ids", token, 0, "token ids (integers >= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _integer(name: str, value: object, low: int, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(name, value, allowed)


def _number(name: str, value: object, low: float, high: float | None, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < low \
            or (high is not None and value > high):
        raise ConfigError(name, value, allowed)
