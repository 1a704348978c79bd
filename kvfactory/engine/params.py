"""What a request asks of generation: ``SamplingParams``, checked when it is made.

Greedy decoding is ``temperature=0`` (the default). With ``temperature > 0`` the next token is drawn
from the softmax of the logits divided by the temperature, restricted to the ``top_k`` most likely
tokens and then to the smallest set whose probability reaches ``top_p`` (nucleus sampling, Holtzman
et al. 2020); a ``seed`` makes one request's draws reproducible whatever else shares its batch.

Every value is checked against what the sampler can represent, so a request that passes cannot
fail a step: the sampler works in float32, so a temperature must be 0 or a normal float32 (at least
``MIN_TEMPERATURE``; the sampler subtracts each row's largest logit before dividing, so any such
temperature keeps the softmax finite), and a seed must fit ``torch.Generator``'s 64 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.errors import ConfigError

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny  # the smallest normal float32: smaller ones flush to 0
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
MAX_STOP = 16  # stop strings a request may give (each is searched for after every token)
MAX_STOP_CHARS = 1024


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
        _integer("max_tokens", self.max_tokens, 1, None, "an integer >= 1 (tokens to generate)")
        _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE,
                f"0 (greedy) or a number in [{MIN_TEMPERATURE:.4g}, {MAX_TEMPERATURE:g}]")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError("temperature", self.temperature,
                              f"0 (greedy) or at least {MIN_TEMPERATURE:.4g}, the smallest normal float32 "
                              "(smaller ones are 0 where the sampler computes)")
        _number("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1]")
        if self.top_p <= 0:
            raise ConfigError("top_p", self.top_p, "a number in (0, 1]")
        _integer("top_k", self.top_k, 0, None, "an integer >= 0 (0: no limit)")
        if self.seed is not None:
            _integer("seed", self.seed, 0, MAX_SEED, f"an integer in [0, 2**64 - 1 = {MAX_SEED}] or None")
        if len(self.stop) > MAX_STOP:
            raise ConfigError("stop", f"{len(self.stop)} strings", f"at most {MAX_STOP} stop strings")
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise ConfigError("stop", self.stop, f"non-empty strings of at most {MAX_STOP_CHARS} characters")
        for token in self.stop_token_ids:
            _integer("stop_token_ids", token, 0, None, "token ids (integers >= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _integer(name: str, value: object, low: int, high: int | None, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low \
            or (high is not None and value > high):
        raise ConfigError(name, value, allowed)


def _number(name: str, value: object, low: float, high: float | None, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < low \
            or (high is not None and value > high):
        raise ConfigError(name, value, allowed)
