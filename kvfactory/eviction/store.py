"""The ``eviction`` strategy: a layer store that evicts what its policy scores lowest.

``EvictionStore`` wraps the config's storage (dense, paged, quantized). kvfactory's attention
function hands it each attention call of its layer: ``attention_mask`` before attending (it
records which new slots are real tokens and, once a batch has shown padding, supplies the mask
itself, since transformers' mask cannot know which stored slots survived), ``observe`` after the
layer's output is computed (so eviction never changes what this step attends to).

Every row and KV head keeps its own choice of tokens, the same number in every head, through the
inner store's ``keep``: dense storage copies the kept tokens into a smaller buffer, paged storage
compacts each row's blocks and gives emptied blocks back to the pool, so evicted memory is really
freed. In a batch each row keeps what it would keep alone (its own real tokens and targets); rows
that keep fewer than the longest are filled with masked slots.
"""

from __future__ import annotations

import torch

from kvfactory.eviction.base import Observation, Policy
from kvfactory.eviction.spec import EvictionSpec
from kvfactory.storage.base import LayerStore, MemoryReport, WrappedStore, take_tokens


def visible_columns(mask: torch.Tensor | None, query_len: int, batch: int,
                    device: torch.device) -> torch.Tensor:
    """Which of the step's new tokens are real, from the attention mask's last query row: ``[B, q]``."""
    if mask is None:
        return torch.ones(batch, query_len, dtype=torch.bool, device=device)
    last = mask[:, 0, -1, -query_len:]
    return last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2


PER_ROW = ("valid", "accumulated", "seen_rows")  # per batch row state that follows the tokens

class EvictionStore(WrappedStore):
    """One layer's K/V in ``inner``, bounded by ``spec`` (see ``kvfactory.eviction.spec``)."""

    evicts = True
    observes_attention = True

    def __init__(self, inner: LayerStore, policy: Policy, spec: EvictionSpec, num_layers: int,
                 slack: int | None = None) -> None:
        """``slack``: tokens decoded between evictions (``kvfactory.compose.eviction_slack``; default
        ``spec.slack_for(None)``)."""
        self.inner, self.policy, self.spec, self.num_layers = inner, policy, spec, num_layers
        self.prefill_open = True
        self.valid: torch.Tensor | None = None  # [B, Hkv, T]: slot holds a real token
        self.seen_rows: torch.Tensor | None = None  # [B] real tokens seen per row
        self.padded = False  # a padded batch was seen: attention masks come from ``valid``
        self.accumulated: torch.Tensor | None = None  # [B, Hkv, T] attention mass (policy.accumulates)
        self._peak = 0  # the most this layer held, right before an eviction
        self.slack = spec.slack_for(None) if slack is None else slack

    # -- storage, delegated -----------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.inner.append(key, value)
        fresh = key.new_ones((*key.shape[:3],), dtype=torch.bool)
        self.valid = fresh if self.valid is None else torch.cat([self.valid, fresh], -1)
        if self.policy.accumulates:
            zeros = key.new_zeros((*key.shape[:3],), dtype=torch.float32)
            self.accumulated = zeros if self.accumulated is None else torch.cat([self.accumulated, zeros], -1)

    def clear(self) -> None:
        self.inner.clear()
        self.prefill_open, self.padded, self._peak = True, False, 0
        self.valid = self.seen_rows = self.accumulated = None

    def keep(self, index: torch.Tensor) -> None:
        self.inner.keep(index)
        self.valid = self._take(self.valid, index)
        self.accumulated = self._take(self.accumulated, index)

    @staticmethod
    def _take(per_slot: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
        return None if per_slot is None else take_tokens(per_slot.unsqueeze(-1), index).squeeze(-1)

    def drop_front(self, n: int) -> None:
        self.keep(torch.arange(min(n, self.size()), self.size()))

    def truncate(self, n: int) -> None:
        n = max(0, n)
        self.inner.truncate(n)
        if self.valid is not None and self.seen_rows is not None:
            self.seen_rows = self.seen_rows - self.valid[:, 0, n:].sum(-1)
        self.valid = None if self.valid is None else self.valid[..., :n]
        self.accumulated = None if self.accumulated is None else self.accumulated[..., :n]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)
        for name in PER_ROW:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, rows.to(value.device)))

    # -- forks and saved state (``kvfactory.manager``): the policy's bookkeeping goes along ---------
    def fork(self) -> EvictionStore:
        twin = EvictionStore(self.inner.fork(), self.policy, self.spec, self.num_layers, self.slack)
        twin.layer_idx = self.layer_idx
        twin.prefill_open, twin.padded, twin._peak = self.prefill_open, self.padded, self._peak
        for name in PER_ROW:
            value = getattr(self, name)
            setattr(twin, name, None if value is None else value.clone())
        return twin

    def export_state(self, tokens: int | None = None) -> dict[str, torch.Tensor]:
        """The inner store's state (``inner.*``), which tokens are real, the policy's accumulated scores
        and the prefill flags (``eviction.*``)."""
        if tokens is not None:
            raise self._unsupported("swapped in part")
        state = {f"inner.{name}": t for name, t in self.inner.export_state().items()}
        if state:
            state |= {f"eviction.{name}": getattr(self, name) for name in PER_ROW
                      if getattr(self, name) is not None}
            state["eviction.flags"] = torch.tensor([self.prefill_open, self.padded, self._peak])
        return state

    def import_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.inner.import_state({name[6:]: t for name, t in tensors.items() if name.startswith("inner.")})
        for name in PER_ROW:
            setattr(self, name, tensors.get(f"eviction.{name}"))
        prefill_open, padded, peak = tensors["eviction.flags"].tolist()
        self.prefill_open, self.padded, self._peak = bool(prefill_open), bool(padded), int(peak)

    def memory_report(self) -> MemoryReport:
        return self.inner.memory_report()

    # -- pages, delegated: a page selector above reads what eviction kept (RocketKV's two stages) ----
    @property
    def page_size(self) -> int:
        return self.inner.page_size

    def pageable(self) -> int:
        return self.inner.pageable()

    def read_pages(self, pages: torch.Tensor, tail_page: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read_pages(pages, tail_page)

    def read_bytes(self, page_tokens: int, tail_tokens: int) -> int:
        return self.inner.read_bytes(page_tokens, tail_tokens)

    def peak_bytes(self) -> int:
        return self._peak

    # -- attention and eviction -------------------------------------------------------------
    def end_prefill(self) -> None:
        """Stop compressing prefills by ratio: what comes next (a question) is kept whole."""
        self.prefill_open = False

    def attention_mask(self, mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
        """The mask this step attends with: transformers' own where it fits this layer, else one built
        from ``valid`` (real stored tokens, causal among the step's own)."""
        b, hq, q, _ = query.shape
        real = visible_columns(mask, q, b, query.device)
        self.valid[..., -q:] &= real[:, None, :]
        seen = real.sum(-1)
        self.seen_rows = seen if self.seen_rows is None else self.seen_rows + seen
        self.padded = self.padded or not bool(real.all())
        t = self.valid.shape[-1]
        # transformers sizes one mask for every layer from the first; layers that kept other counts
        # (PyramidKV) build their own, as do padded batches (the mask cannot know surviving slots)
        sized = mask.shape[-1] == t if mask is not None else q == 1 or q == t
        if not self.padded and sized:
            return mask
        rows = torch.arange(q, device=query.device)[:, None] + (t - q)
        slots = torch.arange(t, device=query.device)
        keys = self.valid.repeat_interleave(hq // self.valid.shape[1], dim=1)[:, :, None, :]
        return (keys & (slots <= rows)) | (slots == rows)  # a padding query sees itself: no empty row

    def _targets(self, new_tokens: int) -> torch.Tensor | None:
        """Real tokens each row should hold after a step of ``new_tokens`` (``[B]``), or None."""
        budget = self.spec.layer_target(self.layer_idx, self.num_layers)
        counts = self.valid[:, 0].sum(-1)
        if new_tokens == 1:
            self.prefill_open = False
            if budget is None or not self.policy.decodes:
                return None
            stored = int(counts.max())
            budget = self.policy.layer_budget(budget, stored, self.layer_idx, self.num_layers)
            if stored <= budget + self.slack:
                return None
            return torch.where(counts > budget + self.slack, budget, counts)
        if budget is not None:
            targets = torch.full_like(counts, budget)
        elif self.prefill_open:
            keep = 1 - self.spec.compression_ratio
            targets = torch.tensor([max(1, int(n * keep)) for n in self.seen_rows.tolist()])
        else:
            return None
        targets = torch.tensor([self.policy.layer_budget(int(k), int(n), self.layer_idx, self.num_layers)
                                for k, n in zip(targets.tolist(), counts.tolist(), strict=True)])
        return torch.minimum(targets.to(counts.device), counts)

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        """After this layer's attention over the step's ``query`` ``[B, Hq, q, D]``: accumulate what
        the policy tracks and evict down to each row's target."""
        targets = self._targets(query.shape[2])
        if targets is None and not self.policy.accumulates:
            return
        keys, _ = self.inner.gather()
        obs = Observation(keys, query, scaling, self.layer_idx, self.num_layers,
                          self.valid if self.padded or not bool(self.valid.all()) else None)
        if self.policy.accumulates:
            self.accumulated += obs.per_kv_head(obs.attention_mass())
        if targets is None:
            return
        kept = int(targets.max())
        if kept >= self.size():
            return
        self._evict(obs, targets, kept)

    def _evict(self, obs: Observation, targets: torch.Tensor, kept: int) -> None:
        """Keep ``kept`` slots per row and head: each row's ``targets`` best real tokens, then masked
        filler (the row's next best slots) where its target is smaller."""
        if bool((targets == kept).all()):
            scores = self.policy.scores(obs, self.accumulated, kept)
        else:  # per-row targets change what a policy protects (recent window, observation window)
            scores = torch.cat([self.policy.scores(obs.row(b), self._row(self.accumulated, b), int(k))
                                for b, k in enumerate(targets.tolist())])
        scores = scores.float().masked_fill(~self.valid, float("-inf"))
        order = scores.topk(kept, dim=-1).indices  # best first; ties broken as kvpress's topk does
        ranks = torch.arange(kept, device=order.device)
        chosen = (ranks < targets.to(order.device)[:, None, None]).expand_as(order)
        index, position = order.sort(-1)
        # memory only grows between evictions: its peak is what the layer held right before one
        self._peak = max(self._peak, self.inner.memory_report().allocated)
        self.keep(index)
        self.valid = chosen.gather(-1, position)

    @staticmethod
    def _row(per_slot: torch.Tensor | None, b: int) -> torch.Tensor | None:
        return None if per_slot is None else per_slot[b:b + 1]
