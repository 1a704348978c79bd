"""Symmetric int8: ``x ~ code * scale`` with ``code`` in ``[-127, 127]`` and ``scale = absmax / 127``.

Absmax ("vector-wise") quantisation as in Dettmers et al., 2022, "LLM.int8(): 8-bit Matrix
Multiplication for Transformers at Scale", applied per token as in Yao et al., 2022, "ZeroQuant:
Efficient and Affordable Post-Training Quantization for Large-Scale Transformers"; int8 KV caches
with per-token or per-head scales are what serving engines (e.g. vLLM, LMDeploy) ship.

Granularity:

- ``"token"``: one scale per (batch, head, token) over the head's ``D`` channels; unit 1.
  Encoded: ``codes`` int8 ``[B, H, T, D]``, ``scale`` ``[B, H, T, 1]``.
- ``"head"`` with ``static_scale`` (a calibrated ``[H]`` tensor the caller loads): one fixed scale
  per head, held once by the codec (``fixed_nbytes``), no per-token bytes; unit 1. Values beyond
  ``127 * scale`` saturate. Encoded: ``codes`` ``[B, H, T, D]``.
- ``"head"`` with ``first_use`` (``kvfactory.codecs.calibration.FirstUseScale``): the same, the
  scale fixed by the first tokens encoded.
- ``"head"`` without ``static_scale``: one dynamic scale per head for each block of ``group_size``
  tokens (a per-head scale must live on the unit axis, so the block is the unit).
  Encoded: ``codes`` ``[B, H, T / G, G, D]``, ``scale`` ``[B, H, T / G, 1, 1]``.

Dynamic scales are rounded up to ``scale_dtype`` (fp16 by default, floored at its smallest
subnormal), so ``|x - decode(x)| <= scale / 2`` holds with the stored scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvfactory.codecs import fused
from kvfactory.codecs.base import (
    Codec,
    Encoded,
    check_dtype,
    check_static_scale,
    per_head,
    round_to,
    smallest,
    widen,
)
from kvfactory.errors import ConfigError

if TYPE_CHECKING:
    from kvfactory.codecs.calibration import FirstUseScale

QMAX = 127


@dataclass(eq=False)
class Int8Codec(Codec):
    """Symmetric int8 with per-token, per-head-block or static per-head scales (see the module doc)."""

    granularity: str = "token"
    group_size: int = 16
    static_scale: torch.Tensor | None = None
    first_use: FirstUseScale | None = None  # a scale fixed by the first tokens encoded (calibrate)
    scale_dtype: torch.dtype = torch.float16
    dtype: torch.dtype | None = None

    name = "int8"
    bits = 8

    def __post_init__(self) -> None:
        if self.granularity not in ("token", "head"):
            raise ConfigError("granularity", self.granularity, "'token' or 'head'")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ConfigError("group_size", self.group_size, "an integer >= 1")
        check_dtype("scale_dtype", self.scale_dtype)
        self.adopt_first_use()
        if self.static_scale is not None:
            if self.granularity != "head":
                raise ConfigError("static_scale", "a tensor", "only with granularity='head'")
            self.static_scale = check_static_scale("static_scale", self.static_scale)

    @property
    def unit(self) -> int:
        return self.group_size if self.granularity == "head" and self.static_scale is None else 1

    @property
    def fixed_nbytes(self) -> int:
        return 0 if self.static_scale is None else self.static_scale.numel() * 4

    def _scale(self, absmax: torch.Tensor) -> torch.Tensor:
        return round_to((absmax / QMAX).clamp_min(smallest(self.scale_dtype)), self.scale_dtype, up=True)

    @staticmethod
    def _codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (x / scale).round_().clamp_(-QMAX, QMAX).to(torch.int8)

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check_input(x)
        b, h, t, d = x.shape
        xf = x.float()
        if self.static_scale is not None:
            return Encoded({"codes": self._codes(xf, per_head(self.static_scale, h, x))}, t)
        if self.granularity == "token":
            scale = self._scale(xf.abs().amax(-1, keepdim=True))
        else:
            xf = xf.view(b, h, t // self.group_size, self.group_size, d)
            scale = self._scale(xf.abs().amax((-2, -1), keepdim=True))
        return Encoded({"codes": self._codes(xf, widen(scale, torch.float32)), "scale": scale}, t)

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        codes = enc.tensors["codes"]
        b, h, d = codes.shape[0], codes.shape[1], codes.shape[-1]
        out = self._output(out, (b, h, enc.tokens, d), codes.device)
        scale = per_head(self.static_scale, h, out) if self.static_scale is not None else enc.tensors["scale"]
        out.view(codes.shape).copy_(codes).mul_(widen(scale, out.dtype))  # torch.mul would cast codes first
        return out

    def bytes_per_token(self, heads: int, head_dim: int) -> float:
        if self.static_scale is not None:
            return heads * head_dim
        return heads * (head_dim + self.scale_dtype.itemsize / self.unit)

    def scores(self, query: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        if self.granularity != "token" or self.static_scale is not None:
            return None
        scale = widen(enc.tensors["scale"], torch.float32)
        return fused.run("int8_scores", query, enc.tensors["codes"], scale)

    def weighted_sum(self, probs: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        if self.granularity != "token" or self.static_scale is not None:
            return None
        scale = widen(enc.tensors["scale"], torch.float32)
        return fused.run("int8_values", probs, enc.tensors["codes"], scale)
