"""The codec interface: how a run of K or V tokens becomes packed tensors and back.

Pure tensor code, no storage: a store encodes what it appends and decodes what attention reads.
Every encoded tensor is laid out ``[batch, kv_heads, units, ...]`` so a store can concatenate runs
along dim 2, select batch rows on dim 0 and keep or drop whole units (``Codec.unit`` tokens each).

A codec object serves one stream (the keys or the values of one layer, or of layers of one shape):
its compute dtype is given at construction or fixed by its first ``encode``; ``decode`` returns
that dtype unless it writes into an ``out`` tensor, whose dtype then decides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvfactory.errors import ConfigError, ShapeError

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


@dataclass(frozen=True)
class Encoded:
    """Packed form of a run of tokens: named tensors whose dim 2 is the unit axis (see Codec.unit)."""

    tensors: dict[str, torch.Tensor]
    tokens: int

    def nbytes(self) -> int:
        """Bytes of every tensor held (codes, scales and zero points): the true encoded size."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Codec(ABC):
    """Encodes ``[B, H, T, D]`` float tensors into an ``Encoded`` and decodes them back."""

    name: str  # the registry name (``kvfactory.codecs.CODECS``)
    bits: int  # bits per element of the codes: 8, 4, 2; 32 or 16 for the identity codec
    dtype: torch.dtype | None  # compute dtype: decode's output; None until the first encode
    #: the encoded layout kvfactory's C kernels read in place (``kivi-keys``, ``kivi-values``), if any
    kernel_layout: ClassVar[str | None] = None
    #: a static scale fixed on first use (``kvfactory.codecs.calibration.FirstUseScale``), if any
    first_use: Any = None
    static_scale: Any = None  # a static per-head scale, in codecs that take one

    @property
    def unit(self) -> int:
        """Tokens per unit along dim 2 of every encoded tensor (encode takes whole units)."""
        return 1

    @property
    def fixed_nbytes(self) -> int:
        """Bytes the codec itself holds for all the tokens it encodes (static per-head scales): counted
        once per codec, not per token, so not in ``Encoded.nbytes`` nor in ``bytes_per_token``."""
        return 0

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Encoded:
        """Encode ``x`` float ``[B, H, T, D]``; ``T`` must be a multiple of ``unit``."""

    @abstractmethod
    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode to ``[B, H, T, D]``, into ``out`` (any float dtype, may be a view) when given."""

    @abstractmethod
    def bytes_per_token(self, heads: int, head_dim: int) -> float:
        """Encoded bytes per token of one sequence in one layer, for K or V alone, scales included."""

    def scores(self, query: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        """``query [B, H, R, D]`` dotted with every encoded key, ``[B, H, R, T]``, straight from the
        codes (``kvfactory.codecs.fused``); None where the codec has no such kernel."""
        return None

    def weighted_sum(self, probs: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        """``probs [B, H, R, T]`` times the encoded values, ``[B, H, R, D]``, straight from the codes;
        None where the codec has no such kernel."""
        return None

    def reads_whole(self, device: torch.device) -> bool:
        """Whether ``scores`` and ``weighted_sum`` take any number of tokens on ``device`` without
        floating-point temporaries (the C kernels, ``kvfactory.codecs.native``), so a reader need not
        cut the stored tokens into runs."""
        return False

    def adopt_first_use(self) -> None:
        """With ``first_use``, take its cell's tensor as the static scale (fixed in place later); called
        by a codec's ``__post_init__`` before it checks ``static_scale``."""
        if self.first_use is None:
            return
        if self.static_scale is not None:
            raise ConfigError("static_scale", "a tensor", "no static_scale with first_use (it fixes one)")
        self.static_scale = self.first_use.scale

    def fix_first_use(self, x: torch.Tensor) -> None:
        """Fix a first-use scale from ``x`` (every token a store holds, or those encoded); a no-op once
        fixed or without one."""
        if self.first_use is not None:
            self.first_use.fix(x)

    def _check_input(self, x: torch.Tensor) -> None:
        """Reject what cannot be encoded, fix the compute dtype on the first encode and a first-use
        scale on the first tokens (``fix_first_use``)."""
        if x.dim() != 4 or not x.is_floating_point():
            raise ShapeError(f"{self.name}: encode takes a float [batch, kv_heads, tokens, head_dim] tensor; "
                             f"got {x.dtype} of shape {tuple(x.shape)}")
        if x.shape[2] % self.unit:
            raise ShapeError(f"{self.name}: cannot encode T={x.shape[2]} tokens: T must be a multiple of "
                             f"unit={self.unit}")
        if self.dtype is None:
            self.dtype = x.dtype
        self.fix_first_use(x)

    def _output(self, out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``out`` checked against ``shape``, or a new tensor of the compute dtype."""
        if out is None:
            if self.dtype is None:
                raise ValueError(f"{self.name}: decode needs `out` or a dtype (given at construction or "
                                 f"fixed by the first encode)")
            return torch.empty(shape, dtype=self.dtype, device=device)
        if tuple(out.shape) != shape or not out.is_floating_point():
            raise ShapeError(f"{self.name}: out is {out.dtype} {tuple(out.shape)}; expected a float tensor "
                             f"of shape {shape}")
        return out


def check_dtype(key: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...] = SCALE_DTYPES) -> None:
    """Raise ConfigError unless ``dtype`` is one of ``allowed``."""
    if dtype not in allowed:
        raise ConfigError(key, dtype, ", ".join(str(d) for d in allowed))


def check_static_scale(key: str, scale: torch.Tensor) -> torch.Tensor:
    """A calibrated per-head scale as a float32 ``[H]`` tensor of positive finite values."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if scale.dim() != 1 or not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ConfigError(key, scale.tolist(), "a 1-D tensor of positive finite per-head scales")
    return scale


def per_head(scale: torch.Tensor, heads: int, x: torch.Tensor) -> torch.Tensor:
    """A static ``[H]`` scale as ``[1, H, 1, 1]`` on ``x``'s device, after checking ``H``."""
    if scale.numel() != heads:
        raise ShapeError(f"static scale holds {scale.numel()} heads; the tensor has {heads} KV heads")
    return scale.to(x.device).view(1, heads, 1, 1)


def smallest(dtype: torch.dtype) -> float:
    """The smallest positive value of ``dtype`` (a subnormal): the floor of stored scales."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    return float(torch.ones((), dtype=ints[dtype.itemsize]).view(dtype))


def round_to(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Cast float32 ``x`` to ``dtype`` rounding toward +inf (``up``) or -inf, saturating at its range.

    Quantisation parameters stored this way bound what they stand for (a scale never smaller than
    needed, a zero point never above the minimum), so the stored codes stay in range and the error
    bound holds with the stored, low-precision parameters. The step to the neighbouring value is
    taken on the bit pattern (sign-magnitude: +1 moves away from zero).
    """
    if dtype == torch.float32:
        return x
    limit = torch.finfo(dtype).max
    x = x.clamp(-limit, limit)
    y = x.to(dtype)
    stored = widen(y, torch.float32)
    off = stored < x if up else stored > x
    bits = y.view({1: torch.int8, 2: torch.int16}[y.element_size()])
    toward_zero = (bits < 0) == up
    moved = torch.where(toward_zero, bits - 1, bits + 1)
    return torch.where(off, moved, bits).view(dtype)


def fp8_as_half(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """An FP8 tensor as ``(half, factor)`` with ``t == half * factor`` exactly, built with integer ops.

    torch's FP8 casts are slow on CPU; the fp16 bit pattern of an E5M2 value is its byte shifted
    left by 8, that of an E4M3 value its byte shifted left by 7 (without the sign extension's bit
    14), which is the value divided by 2**8 (the exponent biases differ by 8). Exact for every
    finite code, subnormals included.
    """
    if t.dtype == torch.float8_e5m2:
        return (t.view(torch.uint8).to(torch.int16) << 8).view(torch.float16), 1.0
    return (t.view(torch.int8).to(torch.int16) << 7).bitwise_and_(~(1 << 14)).view(torch.float16), 256.0


def widen(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored scales or zero points as ``dtype`` (FP8 through ``fp8_as_half``)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        half, factor = fp8_as_half(t)
        return half.to(dtype).mul_(factor)
    return t.to(dtype)
