"""Dense storage: one contiguous ``[batch, kv_heads, capacity, head_dim]`` buffer per layer.

The buffer grows geometrically (``growth``) with ``reserve_tokens`` of headroom, so appends are
amortised O(1) instead of DynamicCache's full copy per step, and ``gather`` returns views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvfactory.errors import AllocationError, ConfigError, ShapeError
from kvfactory.storage.base import LayerStore, MemoryReport, check_kv, take_tokens
from kvfactory.storage.blocks import memory_bytes


@dataclass(eq=False)
class DenseStore(LayerStore):
    """Contiguous per-cache KV tensors (the lossless reference storage)."""

    growth: float = 1.25
    reserve_tokens: int = 256

    _k: torch.Tensor | None = field(default=None, init=False, repr=False)
    _v: torch.Tensor | None = field(default=None, init=False, repr=False)
    _start: int = field(default=0, init=False, repr=False)
    _len: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not math.isfinite(self.growth) or self.growth < 1.0:
            raise ConfigError("growth", self.growth, "a finite factor >= 1.0")
        if self.reserve_tokens < 0:
            raise ConfigError("reserve_tokens", self.reserve_tokens, "an integer >= 0")

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        check_kv(key, value)
        b, h, t, _ = key.shape
        if self._k is not None:
            if key.shape[:2] != self._k.shape[:2] or key.shape[3] != self._k.shape[3] \
                    or value.shape[3] != self._v.shape[3]:
                raise ShapeError(
                    f"layer {self.layer_idx}: cannot append key {tuple(key.shape)} / value "
                    f"{tuple(value.shape)} to a store of [batch={self._k.shape[0]}, kv_heads="
                    f"{self._k.shape[1]}, head_dim={self._k.shape[3]}/{self._v.shape[3]}]")
            if key.dtype != self._k.dtype or key.device != self._k.device:
                raise ShapeError(f"layer {self.layer_idx}: key is {key.dtype} on {key.device}, the store "
                                 f"holds {self._k.dtype} on {self._k.device}")
        if self._k is None or self._start + self._len + t > self._k.shape[2]:
            self._reallocate(self._len + t, like=(key, value))
        end = self._start + self._len
        self._k[:, :, end:end + t] = key
        self._v[:, :, end:end + t] = value
        self._len += t

    @classmethod
    def check_size(cls, options: dict, token_bytes: int, num_layers: int) -> None:
        """``reserve_tokens`` of headroom in every layer must fit this machine's memory."""
        reserve = options.get("reserve_tokens", cls.reserve_tokens)
        needed, limit = reserve * token_bytes * num_layers, memory_bytes()
        if needed > limit:
            raise ConfigError("reserve_tokens", reserve, f"headroom within this machine's {limit:,} bytes of "
                              f"memory: {reserve:,} tokens x {num_layers} layers x {token_bytes} bytes take "
                              f"at least {needed:,} bytes for one sequence")

    def _reallocate(self, needed: int, like: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Move the live tokens to a new buffer with room for ``needed`` tokens and headroom;
        ``AllocationError`` with the numbers where the allocator refuses (nothing is changed)."""
        capacity = needed + self.reserve_tokens
        if self._k is not None:
            capacity = max(capacity, math.ceil(needed * self.growth))
        key, value = like
        b, h, _, dk = key.shape
        try:
            with torch.inference_mode(False):  # the buffer outlives any one inference_mode block
                new_k = key.new_empty((b, h, capacity, dk))
                new_v = value.new_empty((b, h, capacity, value.shape[3]))
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            nbytes = b * h * capacity * (dk + value.shape[3]) * key.element_size()
            raise AllocationError(
                f"layer {self.layer_idx}: cannot allocate {nbytes:,} bytes for {capacity:,} tokens of keys "
                f"and values ([batch={b}, kv_heads={h}, head_dim={dk}] {key.dtype} on {key.device}: "
                f"{needed:,} tokens plus headroom, reserve_tokens={self.reserve_tokens:,} and growth="
                f"{self.growth}; this machine has {memory_bytes():,} bytes of memory); store fewer tokens, "
                f"lower reserve_tokens or use paged storage with a fixed pool (the allocator said: "
                f"{str(err).splitlines()[0]})") from err
        if self._k is not None and self._len:
            new_k[:, :, :self._len] = self._k[:, :, self._start:self._start + self._len]
            new_v[:, :, :self._len] = self._v[:, :, self._start:self._start + self._len]
        self._k, self._v, self._start = new_k, new_v, 0

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._k is None:
            raise ShapeError(f"layer {self.layer_idx}: nothing stored yet")
        span = slice(self._start, self._start + self._len)
        return self._k[:, :, span], self._v[:, :, span]

    def size(self) -> int:
        return self._len

    @property
    def batch_size(self) -> int:
        return 0 if self._k is None else self._k.shape[0]

    def clear(self) -> None:
        self._k = self._v = None
        self._start = self._len = 0

    def keep(self, index: torch.Tensor) -> None:
        """Copy the kept tokens into a new, smaller buffer: the memory of the evicted ones is freed."""
        keys, values = self.gather()
        self._k = self._v = None
        self._len = 0
        self.append(take_tokens(keys, index), take_tokens(values, index))

    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` tokens; a buffer left more than twice the size the rest needs (a
        sliding window after a long prefill) moves them to a smaller one."""
        n = min(n, self._len)
        self._start += n
        self._len -= n
        if self._k is not None and self._k.shape[2] > 2 * (self._len + self.reserve_tokens):
            self._reallocate(self._len, like=(self._k, self._v))

    def truncate(self, n: int) -> None:
        self._len = max(0, min(n, self._len))

    def select_rows(self, rows: torch.Tensor) -> None:
        if self._k is not None:
            rows = rows.to(self._k.device)
            self._k, self._v = self._k.index_select(0, rows), self._v.index_select(0, rows)

    def memory_report(self) -> MemoryReport:
        if self._k is None:
            return MemoryReport()
        b, h, cap, _ = self._k.shape
        allocated = self._k.nbytes + self._v.nbytes
        return MemoryReport(allocated=allocated, used=allocated * self._len // cap, tokens=b * self._len)
