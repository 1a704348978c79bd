"""The ``selective`` strategy: a layer store that evicts what its policy scores lowest.

``SelectiveStore`` wraps the config's storage (dense, paged, quantized) and decides after each
attention call of its layer (kvfactory's attention function calls ``observe`` once the layer's
output is computed, so eviction never changes what this step attends to). It keeps the same number
of tokens in every KV head, chosen per row and head, through the inner store's ``keep``: dense
storage copies the kept tokens into a smaller buffer, paged storage compacts each row's blocks and
gives emptied blocks back to the pool, so evicted memory is really freed.
"""

from __future__ import annotations

from typing import Any

import torch

from kvfactory.errors import ShapeError
from kvfactory.policies.base import Observation, Policy
from kvfactory.policies.spec import DENSE_SLACK, SelectiveSpec
from kvfactory.storage.base import LayerStore, MemoryReport, take_tokens
from kvfactory.storage.dense import DenseStore
from kvfactory.storage.paged import PagedStore


class PaddedBatchError(ShapeError):
    """A left-padded batch reached a selective cache, which does not handle padding yet."""


class SelectiveStore(LayerStore):
    """One layer's K/V in ``inner``, bounded by ``spec`` (see ``kvfactory.policies.spec``)."""

    def __init__(self, inner: LayerStore, policy: Policy, spec: SelectiveSpec, num_layers: int) -> None:
        self.inner, self.policy, self.spec, self.num_layers = inner, policy, spec, num_layers
        self.seen = 0
        self.prefill_open = True
        self.accumulated: torch.Tensor | None = None  # [B, Hkv, T] attention mass (policy.accumulates)
        self.evicted = 0  # tokens evicted per row and head, all steps
        self.peak_bytes = 0  # the most this layer held, right before an eviction
        if isinstance(inner, DenseStore):  # a bounded cache needs no growth headroom
            inner.growth, inner.reserve_tokens = 1.0, min(inner.reserve_tokens, self.slack)

    @property
    def slack(self) -> int:
        if self.spec.slack is not None:
            return self.spec.slack
        return self.inner.page_size if isinstance(self.inner, PagedStore) else DENSE_SLACK

    def bind(self, layer_idx: int) -> None:
        super().bind(layer_idx)
        self.inner.bind(layer_idx)

    def attach(self, pool: object) -> None:
        self.inner.attach(pool)

    def __getattr__(self, name: str) -> Any:  # what the inner store adds (residual_report, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- storage, delegated -----------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.inner.append(key, value)
        self.seen += key.shape[2]
        if self.policy.accumulates:
            fresh = key.new_zeros((*key.shape[:2], key.shape[2]), dtype=torch.float32)
            self.accumulated = fresh if self.accumulated is None else torch.cat([self.accumulated, fresh], -1)

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.gather()

    def size(self) -> int:
        return self.inner.size()

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    def clear(self) -> None:
        self.inner.clear()
        self.seen, self.prefill_open, self.accumulated, self.evicted, self.peak_bytes = 0, True, None, 0, 0

    def keep(self, index: torch.Tensor) -> None:
        self.inner.keep(index)
        if self.accumulated is not None:
            self.accumulated = take_tokens(self.accumulated.unsqueeze(-1), index).squeeze(-1)

    def drop_front(self, n: int) -> None:
        self.keep(torch.arange(min(n, self.size()), self.size()))

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)
        if self.accumulated is not None:
            self.accumulated = self.accumulated[..., :max(0, n)]
        self.seen = min(self.seen, self.evicted + max(0, n))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)
        if self.accumulated is not None:
            self.accumulated = self.accumulated.index_select(0, rows.to(self.accumulated.device))

    def memory_report(self) -> MemoryReport:
        return self.inner.memory_report()

    def block_requests(self, new_tokens: int, batch: int, key: torch.Tensor, value: torch.Tensor) -> list:
        return self.inner.block_requests(new_tokens, batch, key, value)

    def deferred_read(self) -> Any:
        return self.inner.deferred_read()

    # -- eviction ---------------------------------------------------------------------------
    def end_prefill(self) -> None:
        """Stop compressing prefills by ratio: what comes next (a question) is kept whole."""
        self.prefill_open = False

    def _target(self, new_tokens: int) -> int | None:
        """Tokens this layer should hold after a step of ``new_tokens``, or None to keep all."""
        budget = self.spec.layer_target(self.layer_idx, self.num_layers)
        if new_tokens == 1:
            self.prefill_open = False
            if budget is None or not self.policy.decodes or self.size() <= budget + self.slack:
                return None
            return budget
        if budget is not None:
            return budget
        if not self.prefill_open:
            return None
        return max(1, int(self.seen * (1 - self.spec.compression_ratio)))

    def observe(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> None:
        """After this layer's attention over the step's ``query`` ``[B, Hq, q, D]``: accumulate what
        the policy tracks and evict down to the target."""
        if attention_mask is not None:
            last = attention_mask[..., -1, :]
            visible = last if last.dtype == torch.bool else last == 0
            if not bool(visible.all()):
                raise PaddedBatchError(
                    f"layer {self.layer_idx}: the batch has padded (masked) tokens; selective policies "
                    f"support unpadded batches only for now: run each sequence alone or use equal lengths")
        self.peak_bytes = max(self.peak_bytes, self.inner.memory_report().allocated)
        target = self._target(query.shape[2])
        if target is None and not self.policy.accumulates:
            return
        keys, _ = self.inner.gather()
        obs = Observation(keys, query, scaling, self.layer_idx, self.num_layers)
        if self.policy.accumulates:
            self.accumulated += obs.per_kv_head(obs.attention_mass())
        if target is None:
            return
        kept = self.policy.layer_budget(target, self.seen, obs)
        if self.size() <= kept:
            return
        scores = self.policy.scores(obs, self.accumulated, kept)
        index = scores.topk(kept, dim=-1).indices.sort(-1).values
        self.evicted += self.size() - kept
        self.keep(index)
