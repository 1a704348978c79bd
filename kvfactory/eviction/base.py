"""The policy interface: score stored tokens from what one attention call shows, keep the best.

A policy is a dataclass whose fields are its paper's hyperparameters (checked in
``__post_init__``), as kvpress's presses are. ``scores`` returns one score per stored token and KV
head, higher = kept; ``kvfactory.storage.eviction.EvictionStore`` keeps the same number of
top-scoring tokens in every head (so per-head choices free real memory) and never moves a token's
position: keys are stored after RoPE, so what stays keeps its rotation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfactory.errors import ConfigError

QUERY_CHUNK = 256  # queries per block when attention mass is summed over a long prefill


@dataclass
class Observation:
    """One layer's attention call as a policy sees it, after this step's tokens were stored.

    ``keys`` ``[B, Hkv, T, D]`` are everything stored, the step's ``q`` new tokens last;
    ``queries`` ``[B, Hq, q, D]`` are the step's queries (after RoPE, as attention used them);
    ``valid`` ``[B, Hkv, T]`` marks stored slots that hold real tokens (False: left padding, or a
    slot kept only to give every row the same length), None when all do. Attention weights are
    computed on demand for the queries a policy needs, a block of queries at a time, never as a
    full ``[q, T]`` matrix of a long prefill; invalid keys get no weight and padding queries none.
    """

    keys: torch.Tensor
    queries: torch.Tensor
    scaling: float
    layer_idx: int
    num_layers: int
    valid: torch.Tensor | None = None

    def row(self, b: int) -> Observation:
        """Batch row ``b`` alone."""
        valid = None if self.valid is None else self.valid[b:b + 1]
        return Observation(self.keys[b:b + 1], self.queries[b:b + 1], self.scaling, self.layer_idx,
                           self.num_layers, valid)

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.queries.shape[1] // self.keys.shape[1]

    def _probs(self, first: int, last: int) -> torch.Tensor:
        """Softmax weights of queries ``first:last`` over the stored keys ``[B, Hq, n, T]`` (causal)."""
        b, hkv, t, d = self.keys.shape
        q = self.queries.shape[2]
        queries = self.queries[:, :, first:last].reshape(b, hkv, -1, d)
        scores = (queries @ self.keys.transpose(-1, -2)).view(b, hkv * self.groups, last - first, t)
        visible = torch.arange(first, last, device=scores.device)[:, None] + (t - q)
        scores.mul_(self.scaling).masked_fill_(torch.arange(t, device=scores.device) > visible, float("-inf"))
        if self.valid is None:
            return scores.softmax(-1)
        keys_valid = self.valid.repeat_interleave(self.groups, dim=1)[:, :, None, :]
        probs = scores.masked_fill_(~keys_valid, float("-inf")).softmax(-1).nan_to_num_(0.0)
        return probs * keys_valid[:, :, 0, t - q + first:t - q + last, None]  # padding queries: no weight

    def attention(self, last: int) -> torch.Tensor:
        """Weights of the last ``last`` queries over every stored token: ``[B, Hq, last, T]``."""
        q = self.queries.shape[2]
        return self._probs(q - min(last, q), q)

    def attention_mass(self) -> torch.Tensor:
        """Attention each stored token received, summed over all the step's queries: ``[B, Hq, T]``."""
        q = self.queries.shape[2]
        return sum(self._probs(i, min(i + QUERY_CHUNK, q)).sum(2) for i in range(0, q, QUERY_CHUNK))

    def per_kv_head(self, per_query_head: torch.Tensor) -> torch.Tensor:
        """``[B, Hq, T]`` averaged over the query heads of each KV head: ``[B, Hkv, T]``."""
        b, _, t = per_query_head.shape
        return per_query_head.view(b, -1, self.groups, t).mean(2)


@dataclass
class Policy(ABC):
    """Which stored tokens an evicting cache keeps.

    ``decodes``: the policy can score during decode (one query per step), so a token ``budget``
    bounds the cache while generating; SnapKV and PyramidKV score with a window of prefill queries
    and compress prefills only. ``accumulates``: the policy scores with the attention mass each
    token received over all steps so far (H2O), which the store keeps alongside the tokens.
    """

    decodes: ClassVar[bool] = True
    accumulates: ClassVar[bool] = False

    @abstractmethod
    def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
        """``[B, Hkv, T]`` scores of the stored tokens, higher = kept; ``kept`` tokens will stay and
        ``accumulated`` ``[B, Hkv, T]`` is the attention mass received so far (``accumulates``)."""

    def check_budget(self, budget: int) -> None:  # noqa: B027 - an optional hook, not abstract
        """Refuse hyperparameters that cannot work within ``budget`` tokens kept per layer (the
        smallest of a per-layer list). Default: every budget >= 1 works."""

    def layer_budget(self, kept: int, stored: int, layer_idx: int, num_layers: int) -> int:
        """Tokens this layer keeps of ``stored`` when ``kept`` is the cache-wide target, at prefill
        and, for a policy that ``decodes``, against a decode budget (PyramidKV varies it with depth,
        K-norm's ``skip_layers`` keep everything)."""
        return kept


def protect_last(scores: torch.Tensor, n: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` with the last ``n`` real tokens (``valid`` slots) above every other (always kept)."""
    if n <= 0 or not scores.numel():
        return scores
    if valid is None:
        scores[..., -n:] = scores.max() + 1
        return scores
    from_end = valid.flip(-1).cumsum(-1).flip(-1)  # real tokens at or after each slot
    return scores.masked_fill(valid & (from_end <= n), float(scores.max()) + 1)


def check_positive(key: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(key, value, f"an integer >= {minimum}")
