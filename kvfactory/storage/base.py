"""The layer-store interface: what one attention layer's KV storage must do for one cache.

A store holds keys and values of shape ``[batch, kv_heads, tokens, head_dim]``. The transformers
adapter (``kvfactory.cache``) only talks to this interface, so codecs, policies and selectors
plug in above storage without touching it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

import torch

from kvfactory.errors import ShapeError, TensorTypeError, UnsupportedError

if TYPE_CHECKING:
    from kvfactory.attention import DeferredRead, NarrowRead
    from kvfactory.storage.blocks import PagedPool, PoolSpec


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by a cache, from the tensors it holds (not from a formula).

    ``allocated``: bytes reserved for this cache (buffer capacity or blocks owned);
    ``used``: bytes occupied by stored tokens; ``tokens``: stored token slots summed over
    batch rows and layers. ``waste`` and ``bytes_per_token`` derive from those.
    """

    allocated: int = 0
    used: int = 0
    tokens: int = 0

    @property
    def waste(self) -> int:
        return self.allocated - self.used

    @property
    def bytes_per_token(self) -> float:
        """Allocated bytes per stored token of one sequence, summed over layers."""
        return self.allocated / self.tokens if self.tokens else 0.0

    def __add__(self, other: MemoryReport) -> MemoryReport:
        return MemoryReport(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, float]:
        return {"allocated": self.allocated, "used": self.used, "waste": self.waste,
                "tokens": self.tokens, "bytes_per_token": self.bytes_per_token}


@dataclass(frozen=True)
class PrefixLayout:
    """How a store's tokens can be shared with another sequence by a prefix cache: ``block_tokens`` per
    block of kind ``kind`` (a block's contents depend only on the prefix up to it); ``recompute``, the
    newest prompt tokens a hit leaves to compute (quantized pages: the full-precision window, so the
    codes after a hit are those computing the prompt makes); ``from_start``: the store adopts every
    block from token 0, also in a sliding-window layer (codes aligned there), which gives its past back
    after the next write; ``window``: the tokens of full-precision window pages a hit may adopt after
    the quantized pages instead of computing them again (``QuantizedStore.adopt_window``), 0 where
    it may not."""

    block_tokens: int
    kind: str = "kv"
    recompute: int = 0
    from_start: bool = False
    window: int = 0

    @staticmethod
    def common(layouts: list[PrefixLayout | None]) -> PrefixLayout | None:
        """The layout every layer shares (the largest ``recompute``), None if any layer cannot share or
        layers' blocks differ."""
        if not layouts or any(layout is None for layout in layouts):
            return None
        first = layouts[0]
        if any((layout.block_tokens, layout.kind, layout.from_start)
               != (first.block_tokens, first.kind, first.from_start) for layout in layouts):
            return None
        window = first.window if all(layout.window == first.window for layout in layouts) else 0
        return PrefixLayout(first.block_tokens, first.kind, max(layout.recompute for layout in layouts),
                            first.from_start, window)


def take_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[:, :, index]`` of ``[B, H, T, D]`` for a 1-D or per row and head ``[B, H, n]`` ``index``."""
    index = index.to(x.device)
    if index.dim() == 1:
        return x.index_select(2, index)
    return x.gather(2, index.unsqueeze(-1).expand(*index.shape, x.shape[3]))


def check_kv(key: torch.Tensor, value: torch.Tensor) -> None:
    """Reject key/value pairs that cannot be stored together."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TensorTypeError(f"{name} is a {type(t).__name__}: expected torch tensors of shape "
                                  f"[batch, kv_heads, tokens, head_dim] for keys and values")
        if not t.is_floating_point():
            raise TensorTypeError(f"{name} is a {t.dtype} tensor: expected floating-point keys and values "
                                  f"(the model's K/V dtype, e.g. torch.float32 or torch.bfloat16)")
    if key.dim() != 4 or value.dim() != 4:
        raise ShapeError(f"key and value must be 4-D [batch, kv_heads, tokens, head_dim]; "
                         f"got key {tuple(key.shape)}, value {tuple(value.shape)}")
    if key.shape[:3] != value.shape[:3]:
        raise ShapeError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in "
                         f"batch, kv_heads or tokens")
    if key.dtype != value.dtype or key.device != value.device:
        raise ShapeError(f"key ({key.dtype}, {key.device}) and value ({value.dtype}, {value.device}) "
                         f"must share dtype and device")


class LayerStore(ABC):
    """KV storage of one layer for one cache (all batch rows share a token count).

    Subclasses implement the storage primitives; ``retain`` is the hook a strategy overrides to
    decide which stored tokens stay after a step has read them (the default keeps everything).

    Capabilities are declared, as transformers' ``CacheLayerMixin`` declares ``is_sliding``: class
    flags say what a store does beyond the primitives, and the optional reports below answer
    ``None`` where a store has nothing to report, so no caller probes a store's attributes.
    """

    #: ``retain`` or ``observe`` may drop stored tokens after a step read them, so a read handed to
    #: attention must be a copy (set by itself for a subclass that overrides ``retain``).
    evicts: ClassVar[bool] = False
    #: takes part in its layer's attention call (``kvfactory.attention.Observer``): the mask it
    #: attends with and what it sees afterwards (eviction scores, shadow measurements)
    observes_attention: ClassVar[bool] = False
    #: an observer whose ``attention_mask`` returns transformers' mask unchanged (it only records it):
    #: a causal prefill chunk may attend without building the mask (the engine's ``causal_chunk``)
    keeps_causal_mask: ClassVar[bool] = False
    #: its tokens are plain K/V in blocks of a shared pool, one block table per row: the paged
    #: kernel reads them in place and a manager shares, swaps and adopts its blocks
    #: (``storage.paged.BlockTableStore``); a wrapper that changes what is read is not
    plain_pages: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.retain is not LayerStore.retain and "evicts" not in cls.__dict__:  # a mixin's counts too
            cls.evicts = True

    layer_idx: int = 0

    def evicts_during(self, new_tokens: int) -> bool:
        """Whether a step writing ``new_tokens`` may drop stored tokens after attention read them: its
        reads must then be copies, never a read left pending (``evicts`` unless a store knows better)."""
        return self.evicts

    def bind(self, layer_idx: int) -> None:
        """Called once by the factory: which model layer this store serves."""
        self.layer_idx = layer_idx

    @classmethod
    def make_shared(cls, options: dict, num_layers: int) -> PagedPool | None:
        """The pool the caches of one factory share (paged storage), or None for storage without one."""
        return None

    @classmethod  # noqa: B027 - an optional hook, not abstract
    def check_size(cls, options: dict, token_bytes: int, num_layers: int) -> None:
        """Refuse ``options`` whose memory this machine cannot hold, once the factory knows the model:
        ``token_bytes`` is the least one token's keys and values take in one layer. Default: nothing
        to check (paged pools check their own size, ``PagedPool.expect_layout``)."""

    @abstractmethod
    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``[batch, kv_heads, new_tokens, head_dim]`` after what is already stored."""

    @abstractmethod
    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored keys and values as ``[batch, kv_heads, size(), head_dim]`` tensors.

        The result stays valid until the next ``append`` or ``gather`` of the same store or pool
        (paged reads of several rows share a workspace); copy it to keep it longer.
        """

    @abstractmethod
    def size(self) -> int:
        """Tokens stored per batch row."""

    @property
    @abstractmethod
    def batch_size(self) -> int:
        """Batch rows held (0 before the first append)."""

    @abstractmethod
    def clear(self) -> None:
        """Drop everything and give memory back."""

    @abstractmethod
    def keep(self, index: torch.Tensor) -> None:
        """Keep only the stored tokens at ``index``: 1-D (the same for every row and head) or
        ``[batch, kv_heads, n]`` (per row and head, as eviction policies choose); sorted."""

    @abstractmethod
    def drop_front(self, n: int) -> None:
        """Drop the ``n`` oldest stored tokens."""

    @abstractmethod
    def truncate(self, n: int) -> None:
        """Keep the ``n`` oldest stored tokens, drop the rest."""

    @abstractmethod
    def select_rows(self, rows: torch.Tensor) -> None:
        """Rebuild the batch from rows ``rows`` of the current one (beam reorder, repeat, select)."""

    @abstractmethod
    def memory_report(self) -> MemoryReport:
        """Bytes this store holds, from its tensors."""

    def block_requests(self, new_tokens: int, batch: int, key: torch.Tensor,
                       value: torch.Tensor) -> list[tuple[PoolSpec, int]]:
        """Pool blocks (per block pool) that appending ``new_tokens`` shaped like ``key`` / ``value`` to
        ``batch`` rows would take; none without a pool."""
        return []

    def deferred_read(self) -> DeferredRead | NarrowRead | None:
        """A chunked or narrowed read for kvfactory's attention (``kvfactory.attention``), or None to be
        read whole."""
        return None

    def fork(self) -> LayerStore:
        """A store holding the same tokens, independent from now on (``KVCache.fork``)."""
        raise self._unsupported("forked")

    def export_state(self, tokens: int | None = None) -> dict[str, torch.Tensor]:
        """What this store holds as named tensors that ``import_state`` writes back exactly (pausing,
        saving: ``kvfactory.manager``); ``tokens``: only the oldest ones (a partial swap)."""
        raise self._unsupported("paused or saved")

    def import_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill this empty store from ``export_state``'s tensors."""
        raise self._unsupported("restored")

    def _unsupported(self, what: str) -> UnsupportedError:
        return UnsupportedError(f"layer {self.layer_idx}: {type(self).__name__} cannot be {what} yet; use "
                                f"paged storage, plain or quantized ({{'type': 'paged'}})")

    def retain(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Decide what stays after a step read the cache. Default: keep everything."""

    def end_prefill(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """The prompt is complete (``KVCache.end_prefill``): what comes next is not prompt."""

    def prefix_layout(self) -> PrefixLayout | None:
        """How a prefix cache may name its blocks and another sequence adopt them (``KVCache.prefix_blocks``,
        ``adopt``): plain pages, quantized pages, also under a page selector; None for a store whose
        blocks do not depend on the prefix alone (eviction) or that has no blocks (dense)."""
        return None

    def share_filled(self, place: int, block: int) -> None:  # noqa: B027 - optional, not abstract
        """Hold block ``block`` of its pool at ``place`` (counted from token 0) in place of its own filled
        block there where both hold the same tokens and bytes, giving its own back
        (``KVCache.share_filled``); a store that keeps its own blocks does nothing."""

    def window_pages(self) -> tuple[int, torch.Tensor] | None:
        """Where a full-precision window in front of quantized pages starts in the sequence and its pages'
        ids ``[pages]`` (a prefix cache keeps them for a later hit: ``PrefixLayout.window``); None for a
        store without one."""
        return None

    def batch_flush(self, new_tokens: int) -> int:
        """Tokens at the front of a full-precision window in front of quantized pages that a batched
        flush (``kvfactory.quantization.ragged.flush_windows``) encodes before ``new_tokens`` more are
        written; 0 for a store without one, or one that encodes as it writes."""
        return 0

    def reads_blocks(self) -> bool:
        """Whether the next one-row decode step reads a subset of pool blocks chosen per KV head
        (``decode_blocks``, a page selector over plain pages), in the engine's block kernel."""
        return False

    # -- optional reports: None where the store has nothing to report -----------------------
    def peak_bytes(self) -> int | None:
        """The most bytes this store held (right before an eviction), for stores that evict."""
        return None

    def residual_report(self) -> MemoryReport | None:
        """The full-precision window's share of ``memory_report`` (quantized storage)."""
        return None

    def quantization_error(self) -> dict[str, float] | None:
        """Relative MSE of the keys and values stored so far (quantized storage)."""
        return None


class WrappedStore(LayerStore):
    """A store that adds behaviour on top of another one, ``inner`` (a policy, a selector). Binding,
    pool attachment, reads, pool requests and the optional hooks and reports are ``inner``'s unless the
    wrapper overrides them; anything else of ``inner`` is reached as ``inner``'s, by name."""

    inner: LayerStore

    def bind(self, layer_idx: int) -> None:
        super().bind(layer_idx)
        self.inner.bind(layer_idx)

    def attach(self, pool: object) -> None:
        self.inner.attach(pool)

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.gather()

    def size(self) -> int:
        return self.inner.size()

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    def block_requests(self, new_tokens: int, batch: int, key: torch.Tensor,
                       value: torch.Tensor) -> list[tuple[PoolSpec, int]]:
        return self.inner.block_requests(new_tokens, batch, key, value)

    def deferred_read(self) -> DeferredRead | NarrowRead | None:
        return self.inner.deferred_read()

    def end_prefill(self) -> None:
        self.inner.end_prefill()

    def peak_bytes(self) -> int | None:
        return self.inner.peak_bytes()

    def residual_report(self) -> MemoryReport | None:
        return self.inner.residual_report()

    def quantization_error(self) -> dict[str, float] | None:
        return self.inner.quantization_error()
