"""Quantized storage: keys and values held as codec-packed runs, the newest tokens in full precision.

``QuantizedStore`` wraps the config's storage (dense or paged) and uses it for the full-precision
residual window (KIVI's recent tokens, which are still being grouped). When the window overflows
by whole codec units, the oldest units are encoded (``kvfactory.codecs``) and appended to packed
buffers; nothing else is kept in floating point. A read decodes the packed part and copies the
residual into one workspace shared by every layer (``ReadWorkspace``), so decode allocates no
fresh full-size tensor per step and holds at most one layer's K/V in floating point.

Telemetry: every ``sample_every``-th flush (and the first) also decodes what it encoded and adds
the squared error and squared norm of K and V to running sums: ``quantization_error()`` gives the
relative MSE of this layer's keys and values so far, measured on what was really stored.

Eviction on quantized data (``keep``, ``drop_front``, ``truncate``) decodes, selects and encodes
again; per-token codecs and KIVI's min/max groups reproduce their codes, so this is near-lossless.
"""

from __future__ import annotations

import math

import torch

from kvfactory.codecs import Codec, Encoded
from kvfactory.errors import ShapeError
from kvfactory.storage.base import LayerStore, MemoryReport, check_kv
from kvfactory.storage.dense import DenseStore
from kvfactory.storage.workspace import ReadWorkspace


class PackedRuns:
    """Encoded tensors appended along the unit axis (dim 2) into buffers with ``reserve_tokens`` headroom.

    Packed data is small, so growing by a fixed headroom (a copy every ``reserve_tokens`` tokens)
    costs little and keeps the waste under ``reserve_tokens`` instead of a growth factor's 25 %.
    """

    def __init__(self, unit: int, reserve_tokens: int = 64) -> None:
        self.reserve_units = math.ceil(reserve_tokens / unit)
        self._buffers: dict[str, torch.Tensor] = {}
        self.units = 0
        self.tokens = 0

    def append(self, enc: Encoded, units: int) -> None:
        if not self._buffers or self.units + units > next(iter(self._buffers.values())).shape[2]:
            self._grow(self.units + units, enc)
        for name, tensor in enc.tensors.items():
            self._buffers[name][:, :, self.units:self.units + units] = tensor
        self.units += units
        self.tokens += enc.tokens

    def _grow(self, needed: int, like: Encoded) -> None:
        capacity = needed + self.reserve_units if self._buffers else needed
        grown = {}
        with torch.inference_mode(False):  # buffers outlive any one inference_mode block
            for name, tensor in like.tensors.items():
                shape = (*tensor.shape[:2], capacity, *tensor.shape[3:])
                grown[name] = tensor.new_empty(shape)
                if name in self._buffers and self.units:
                    grown[name][:, :, :self.units] = self._buffers[name][:, :, :self.units]
        self._buffers = grown

    def encoded(self) -> Encoded:
        """Everything stored, as views."""
        return Encoded({n: t[:, :, :self.units] for n, t in self._buffers.items()}, self.tokens)

    def select_rows(self, rows: torch.Tensor) -> None:
        self._buffers = {n: t.index_select(0, rows.to(t.device)) for n, t in self._buffers.items()}

    def clear(self) -> None:
        self._buffers, self.units, self.tokens = {}, 0, 0

    def report(self) -> tuple[int, int]:
        """``(allocated, used)`` bytes."""
        allocated = sum(t.nbytes for t in self._buffers.values())
        capacity = next(iter(self._buffers.values())).shape[2] if self._buffers else 1
        return allocated, allocated * self.units // capacity


class QuantizedStore(LayerStore):
    """One layer's K/V: codec-packed runs plus up to ``residual`` + one unit newest tokens in ``inner``."""

    def __init__(self, inner: LayerStore, key_codec: Codec, value_codec: Codec, residual: int,
                 workspace: ReadWorkspace, sample_every: int = 16) -> None:
        self.inner, self.key_codec, self.value_codec = inner, key_codec, value_codec
        self.residual, self.workspace, self.sample_every = residual, workspace, sample_every
        self._flushes = 0
        self._error = torch.zeros(4, dtype=torch.float64)  # K error, K norm, V error, V norm (squared sums)
        self.unit = math.lcm(key_codec.unit, value_codec.unit)
        if isinstance(inner, DenseStore):  # the window never holds more than residual + one unit
            inner.reserve_tokens = min(inner.reserve_tokens, self.unit)
        self.packed_k, self.packed_v = PackedRuns(key_codec.unit), PackedRuns(value_codec.unit)
        self._like: tuple[torch.Tensor, torch.Tensor] | None = None  # empty [B, H, 0, D] K and V

    def bind(self, layer_idx: int) -> None:
        super().bind(layer_idx)
        self.inner.bind(layer_idx)

    def attach(self, pool: object) -> None:
        """Give the inner store its pool (paged storage)."""
        self.inner.attach(pool)

    def _flush_count(self, total: int) -> int:
        """Tokens to encode when ``total`` sit in the window: whole units beyond ``residual``."""
        return max(0, (total - self.residual) // self.unit * self.unit)

    def _check_like(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if self._like is None:
            with torch.inference_mode(False):  # shape/dtype witnesses that hold no tokens
                self._like = key.new_empty((*key.shape[:2], 0, key.shape[3])), \
                    value.new_empty((*value.shape[:2], 0, value.shape[3]))
            return
        k, v = self._like
        if key.shape[:2] != k.shape[:2] or key.shape[3] != k.shape[3] or value.shape[3] != v.shape[3] \
                or key.dtype != k.dtype or key.device != k.device:
            raise ShapeError(f"layer {self.layer_idx}: cannot append key {tuple(key.shape)} ({key.dtype}) / "
                             f"value {tuple(value.shape)} to a store of [batch={k.shape[0]}, kv_heads="
                             f"{k.shape[1]}, head_dim={k.shape[3]}/{v.shape[3]}] ({k.dtype})")

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        check_kv(key, value)
        self._check_like(key, value)
        held = self.inner.size()
        flush = self._flush_count(held + key.shape[2])
        if flush == 0:
            self.inner.append(key, value)
            return
        if held:
            old_k, old_v = self.inner.gather()
            key, value = torch.cat([old_k, key], dim=2), torch.cat([old_v, value], dim=2)
        ek, ev = self.key_codec.encode(key[:, :, :flush]), self.value_codec.encode(value[:, :, :flush])
        if self._flushes % self.sample_every == 0:
            self._sample_error(key[:, :, :flush], value[:, :, :flush], ek, ev)
        self._flushes += 1
        self.packed_k.append(ek, flush // self.key_codec.unit)
        self.packed_v.append(ev, flush // self.value_codec.unit)
        self.inner.clear()
        if key.shape[2] > flush:
            self.inner.append(key[:, :, flush:].contiguous(), value[:, :, flush:].contiguous())

    def _sample_error(self, key: torch.Tensor, value: torch.Tensor, ek: Encoded, ev: Encoded) -> None:
        sums = []
        for x, codec, enc in ((key, self.key_codec, ek), (value, self.value_codec, ev)):
            x = x.double()
            sums += [(codec.decode(enc).double() - x).square().sum(), x.square().sum()]
        self._error += torch.stack(sums).cpu()

    def quantization_error(self) -> dict[str, float]:
        """Relative MSE of the keys and values encoded so far (sampled flushes), NaN before any."""
        k_err, k_norm, v_err, v_norm = self._error.tolist()
        return {"key": k_err / k_norm if k_norm else float("nan"),
                "value": v_err / v_norm if v_norm else float("nan")}

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        quantized, held = self.packed_k.tokens, self.inner.size()
        if quantized + held == 0 and self._like is not None:
            return self._like  # everything was removed: empty, with the stored shape
        if quantized == 0:
            return self.inner.gather()
        k, v = self._like
        b, h, _, dk = k.shape
        keys = self.workspace.buffer("quantized_keys", (b, h, quantized + held, dk), k)
        values = self.workspace.buffer("quantized_values", (b, h, quantized + held, v.shape[3]), v)
        self.key_codec.decode(self.packed_k.encoded(), out=keys[:, :, :quantized])
        self.value_codec.decode(self.packed_v.encoded(), out=values[:, :, :quantized])
        if held:
            rk, rv = self.inner.gather()
            keys[:, :, quantized:].copy_(rk)
            values[:, :, quantized:].copy_(rv)
        return keys, values

    def size(self) -> int:
        return self.packed_k.tokens + self.inner.size()

    @property
    def batch_size(self) -> int:
        return 0 if self._like is None else self._like[0].shape[0]

    def clear(self) -> None:
        self.packed_k.clear()
        self.packed_v.clear()
        self.inner.clear()
        self._like = None

    def keep(self, index: torch.Tensor) -> None:
        """Decode, keep ``index``, encode again (near-lossless, see the module doc)."""
        keys, values = self.gather()
        index = index.to(keys.device)
        keys, values = keys.index_select(2, index), values.index_select(2, index)
        like = self._like
        self.clear()
        self._like = like
        if keys.shape[2]:
            self.append(keys, values)

    def drop_front(self, n: int) -> None:
        self.keep(torch.arange(min(n, self.size()), self.size()))

    def truncate(self, n: int) -> None:
        if n >= self.packed_k.tokens:
            self.inner.truncate(n - self.packed_k.tokens)
        else:
            self.keep(torch.arange(max(0, n)))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.packed_k.select_rows(rows)
        self.packed_v.select_rows(rows)
        self.inner.select_rows(rows)
        if self._like is not None:
            self._like = tuple(t.index_select(0, rows.to(t.device)) for t in self._like)

    def residual_report(self) -> MemoryReport:
        """The full-precision window's share (reported apart from the packed bytes)."""
        return self.inner.memory_report()

    def memory_report(self) -> MemoryReport:
        inner = self.inner.memory_report()
        k_alloc, k_used = self.packed_k.report()
        v_alloc, v_used = self.packed_v.report()
        return MemoryReport(allocated=inner.allocated + k_alloc + v_alloc, used=inner.used + k_used + v_used,
                            tokens=self.batch_size * self.size())

    def blocks_needed(self, new_tokens: int, batch: int) -> int:
        """Blocks the inner store takes for what stays in full precision after the append."""
        held = self.inner.size()
        flush = self._flush_count(held + new_tokens)
        if flush == 0:
            return self.inner.blocks_needed(new_tokens, batch)
        return self.inner.blocks_needed(held + new_tokens - flush, batch)
