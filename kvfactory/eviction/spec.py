"""What a config asks of eviction: the policy, its hyperparameters and the budget.

In a composite config: ``{"name": "eviction", "policy": "snapkv", "compression_ratio": 0.75}``
or ``{"name": "eviction", "policy": "h2o", "budget": 1024}``, plus the policy's own
hyperparameters (``window_size``, ``n_sink``, ...) under their names.

- ``compression_ratio`` (kvpress's definition: the fraction evicted) compresses prefills: after a
  multi-token forward each layer keeps ``int(seen * (1 - ratio))`` tokens. It stops at the first
  decode step, or at ``cache.end_prefill()`` (a question fed after the compressed context is not
  compressed, as in kvpress's pipeline); decode then grows the cache.
- ``budget`` (tokens kept per layer; a list gives one per layer) is a hard bound: prefills and
  prefill chunks are compressed to it, and with a policy that scores single steps (all but SnapKV
  and PyramidKV) decode evicts back to it whenever ``slack`` more tokens have arrived (default: one
  page for paged storage, 16 tokens for dense), so a long generation runs in constant memory.
  ``slack: 0`` evicts one token per step, as the H2O and TOVA papers do; a larger slack evicts
  that many at once by the current scores and amortises the compaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfactory.errors import ConfigError
from kvfactory.eviction import POLICIES, Policy
from kvfactory.options import options_of, parse_spec

EVICTION = "eviction"  # the composite entry's name
DENSE_SLACK = 16


@dataclass(frozen=True)
class EvictionSpec:
    """A validated ``eviction`` entry; ``build_policy()`` makes a fresh policy for one layer."""

    policy: str
    compression_ratio: float | None = None
    budget: int | tuple[int, ...] | None = None
    slack: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.compression_ratio is None) == (self.budget is None):
            raise ConfigError("compression_ratio", self.compression_ratio,
                              "exactly one of compression_ratio (fraction evicted) and budget (tokens kept)")
        if self.compression_ratio is not None and not 0.0 <= self.compression_ratio < 1.0:
            raise ConfigError("compression_ratio", self.compression_ratio, "a fraction in [0, 1)")
        budgets = self.budget if isinstance(self.budget, tuple) else (self.budget,)
        if self.budget is not None and not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                               for b in budgets):
            raise ConfigError("budget", self.budget,
                              "tokens kept per layer: an integer >= 1 or a list of them")
        if self.slack is not None and (not isinstance(self.slack, int) or self.slack < 0):
            raise ConfigError("slack", self.slack, "an integer >= 0 (tokens decoded between evictions)")
        policy = self.build_policy()
        if self.budget is not None:
            policy.check_budget(min(budgets))

    @classmethod
    def parse(cls, options: dict[str, Any], where: str = "") -> EvictionSpec:
        options = dict(options)
        name = options.pop("policy", None)
        if name not in POLICIES:
            raise ConfigError(f"{where}policy", name, f"one of {sorted(POLICIES)}")
        if isinstance(options.get("budget"), list):
            options["budget"] = tuple(options["budget"])
        return parse_spec(cls, name, options, dict.fromkeys(("compression_ratio", "budget", "slack")),
                          options_of(POLICIES[name]), where, "eviction", "policy")

    def build_policy(self) -> Policy:
        return POLICIES[self.policy](**self.options)

    def slack_for(self, page_size: int | None) -> int:
        """Tokens decoded between evictions: ``slack``, else one page of plain paged storage
        (``page_size``), else ``DENSE_SLACK``."""
        if self.slack is not None:
            return self.slack
        return page_size if page_size is not None else DENSE_SLACK

    def layer_target(self, layer_idx: int, num_layers: int) -> int | None:
        """This layer's token budget (None: compression by ratio)."""
        if isinstance(self.budget, tuple):
            if len(self.budget) != num_layers:
                raise ConfigError("budget", list(self.budget), f"one budget per layer: {num_layers} integers")
            return self.budget[layer_idx]
        return self.budget
