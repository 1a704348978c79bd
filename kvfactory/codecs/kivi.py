"""KIVI: asymmetric 4-bit / 2-bit KV quantisation, keys per channel and values per token.

Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (ICML 2024):
key caches have a few outlier channels whose magnitude is shared by all tokens, so keys are
quantised per channel over groups of ``group_size`` tokens; value caches have no such channels and
are quantised per token over groups of ``group_size`` channels. Each group stores its minimum
(the zero point) and ``scale = (max - min) / (2**bits - 1)``; ``x ~ code * scale + zero``.

Keys are encoded in whole groups of tokens (``unit = group_size``): the full-precision window of
recent tokens that KIVI keeps until a group is complete is the storage's job, not the codec's.
Codes are packed along the last dim (``kvfactory.codecs.packing``). Zero points are rounded down
and scales up to their storage dtype, so every element is within ``scale / 2`` of its decoded
value with the stored parameters (and a constant group, ``max == min``, decodes exactly);
parameters beyond their dtype's range saturate.

Parameter dtypes (the defaults meet K+V budgets of 0.30 (int4) and 0.17 (int2) of an fp16 cache
for SmolLM2's 3 KV heads of 64 channels at ``group_size=32``; fp16 everywhere costs 0.3125 and
0.1875): scales are FP8 E4M3 rounded up (at most 12.5% coarser steps); key zero points stay fp16,
because key channels carry large offsets (the outliers that motivate KIVI), value zero points are
E4M3, values being small and centred. On SmolLM2's K/V of 1024 WikiText tokens this raised the
relative squared error over fp16 parameters from 0.0016 to 0.0018 (int4 keys), 0.0076 to 0.0092
(int4 values), 0.041 to 0.045 (int2 keys) and 0.19 to 0.22 (int2 values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.codecs import fused, native
from kvfactory.codecs.base import Codec, Encoded, check_dtype, round_to, smallest, widen
from kvfactory.codecs.packing import pack, packed_size, unpack
from kvfactory.errors import ConfigError, ShapeError


@dataclass(eq=False)
class _Kivi(Codec):
    """Shared hyperparameters and the asymmetric quantiser of both KIVI codecs."""

    bits: int = 4
    group_size: int = 32
    scale_dtype: torch.dtype = torch.float8_e4m3fn
    zero_dtype: torch.dtype = torch.float16
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ConfigError("bits", self.bits, "2 or 4")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ConfigError("group_size", self.group_size, "an integer >= 1")
        check_dtype("scale_dtype", self.scale_dtype)
        check_dtype("zero_dtype", self.zero_dtype)

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def _params(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored ``(scale, zero)`` for groups with minimum ``lo`` and maximum ``hi`` (float32)."""
        zero = round_to(lo, self.zero_dtype, up=False)
        step = (hi - widen(zero, torch.float32)) / (2 ** self.bits - 1)
        scale = round_to(step.clamp_min(smallest(self.scale_dtype)), self.scale_dtype, up=True)
        return scale, zero

    def _codes(self, x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        q = (x - widen(zero, torch.float32)).div_(widen(scale, torch.float32))
        q = q.round_().clamp_(0, 2 ** self.bits - 1)
        return q.to(torch.uint8)

    def reads_whole(self, device: torch.device) -> bool:
        return device.type == "cpu" and native.available()

    def _meta_bytes(self) -> int:
        return self.scale_dtype.itemsize + self.zero_dtype.itemsize


@dataclass(eq=False)
class KiviKeyCodec(_Kivi):
    """KIVI keys: per-channel scale and zero point over each group of ``group_size`` tokens.

    Encoded: ``codes`` uint8 ``[B, H, T / G, G, ceil(D * bits / 8)]``, ``scale`` and ``zero``
    ``[B, H, T / G, 1, D]``.
    """

    kernel_layout = "kivi-keys"

    @property
    def unit(self) -> int:
        return self.group_size

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check_input(x)
        tensors = native.encode_keys(x.float(), self.bits, self.group_size, self.scale_dtype, self.zero_dtype)
        return Encoded(tensors if tensors is not None else self.encode_in_torch(x), x.shape[2])

    def encode_in_torch(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """What ``encode`` stores, in torch (where the C encoder does not run; its reference)."""
        b, h, t, d = x.shape
        groups = x.float().view(b, h, t // self.group_size, self.group_size, d)
        scale, zero = self._params(groups.amin(3, keepdim=True), groups.amax(3, keepdim=True))
        return {"codes": pack(self._codes(groups, scale, zero), self.bits), "scale": scale, "zero": zero}

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        codes, scale, zero = enc.tensors["codes"], enc.tensors["scale"], enc.tensors["zero"]
        b, h, n, g, _ = codes.shape
        d = scale.shape[-1]
        out = self._output(out, (b, h, n * g, d), codes.device)
        groups = unpack(codes, self.bits, out.view(b, h, n, g, d))
        torch.addcmul(widen(zero, out.dtype), groups, widen(scale, out.dtype), out=groups)
        return out

    def bytes_per_token(self, heads: int, head_dim: int) -> float:
        per_group = self.group_size * packed_size(head_dim, self.bits) + head_dim * self._meta_bytes()
        return heads * per_group / self.group_size

    def scores(self, query: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        t = enc.tensors
        if native.supports(t["codes"], t["scale"], t["zero"], self.bits):
            return native.key_scores(query, t["codes"], t["scale"], t["zero"], self.bits).to(query.dtype)
        return fused.run("kivi_scores", query, t["codes"], widen(t["scale"], torch.float32),
                         widen(t["zero"], torch.float32), self.bits)


@dataclass(eq=False)
class KiviValueCodec(_Kivi):
    """KIVI values: per-token scale and zero point over each group of ``group_size`` channels.

    The last group is smaller when ``group_size`` does not divide ``head_dim``. Encoded: ``codes``
    uint8 ``[B, H, T, ceil(D * bits / 8)]``, ``scale`` and ``zero`` ``[B, H, T, ceil(D / G)]``.
    Packed codes do not tell ``D`` apart from its padding, so ``head_dim`` is given at construction
    or fixed by the first encode (or read from ``out``).
    """

    kernel_layout = "kivi-values"
    zero_dtype: torch.dtype = torch.float8_e4m3fn
    head_dim: int | None = None

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check_input(x)
        b, h, t, d = x.shape
        if self.head_dim is None:
            self.head_dim = d
        if d != self.head_dim:
            raise ShapeError(f"{self.name} values: head_dim {d} differs from the codec's {self.head_dim}")
        tensors = native.encode_values(x.float(), self.bits, self.group_size, self.scale_dtype,
                                       self.zero_dtype)
        return Encoded(tensors if tensors is not None else self.encode_in_torch(x), t)

    def encode_in_torch(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """What ``encode`` stores, in torch (where the C encoder does not run; its reference)."""
        b, h, t, d = x.shape
        g = self.group_size
        n = -(-d // g)
        xf = x.float()
        if n * g != d:  # repeat the last channel: the last group's min/max stay its own
            xf = torch.cat([xf, xf[..., -1:].expand(b, h, t, n * g - d)], dim=-1)
        groups = xf.view(b, h, t, n, g)
        scale, zero = self._params(groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True))
        codes = self._codes(groups, scale, zero).view(b, h, t, n * g)[..., :d]
        return {"codes": pack(codes, self.bits), "scale": scale[..., 0], "zero": zero[..., 0]}

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        codes, scale, zero = enc.tensors["codes"], enc.tensors["scale"], enc.tensors["zero"]
        b, h, t, _ = codes.shape
        if out is None and self.head_dim is None:
            raise ValueError(f"{self.name} values: decode needs `out` or head_dim (set by the first encode)")
        d = out.shape[-1] if out is not None else self.head_dim
        out = self._output(out, (b, h, t, d), codes.device)
        unpack(codes, self.bits, out)
        scale, zero = widen(scale, out.dtype).unsqueeze(-1), widen(zero, out.dtype).unsqueeze(-1)
        full = d // self.group_size
        if full:
            groups = out[..., :full * self.group_size].unflatten(-1, (full, self.group_size))
            groups.mul_(scale[..., :full, :]).add_(zero[..., :full, :])
        if full * self.group_size < d:
            tail = out[..., full * self.group_size:]
            tail.mul_(scale[..., -1, :]).add_(zero[..., -1, :])
        return out

    def bytes_per_token(self, heads: int, head_dim: int) -> float:
        groups = -(-head_dim // self.group_size)
        return heads * (packed_size(head_dim, self.bits) + groups * self._meta_bytes())

    def weighted_sum(self, probs: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        t = enc.tensors
        if self.head_dim is not None and native.supports(t["codes"], t["scale"], t["zero"], self.bits):
            return native.value_sums(probs, t["codes"], t["scale"], t["zero"], self.bits, self.group_size,
                                     self.head_dim).to(probs.dtype)
        if self.head_dim is None or self.head_dim % self.group_size:
            return None  # a smaller last group: decoded in chunks instead
        return fused.run("kivi_values", probs, t["codes"], widen(t["scale"], torch.float32),
                         widen(t["zero"], torch.float32), self.bits, self.group_size)
