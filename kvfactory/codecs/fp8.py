"""FP8 codes: ``x ~ fp8(x / scale) * scale`` in OCP FP8 E4M3 (3 mantissa bits) or E5M2 (2 bits).

Micikevicius et al., 2022, "FP8 Formats for Deep Learning": E4M3 (max 448, no infinities) has the
precision KV caches need, E5M2 (max 57344) the range. Serving engines (vLLM, TensorRT-LLM) store
FP8 KV caches with per-tensor or per-head scales from calibration.

Scales:

- ``"static"``: a calibrated per-head ``[H]`` ``static_scale`` given at construction, held once by
  the codec (``fixed_nbytes``), or fixed by the first tokens encoded (``first_use``,
  ``kvfactory.codecs.calibration.FirstUseScale``); codes only, 1 byte per element. Values beyond
  ``fp8_max * scale`` saturate.
- ``"dynamic"``: one scale per (batch, head, token), ``absmax / fp8_max`` rounded up to
  ``scale_dtype`` (fp16: 2 bytes per token and head on top of the ``D`` code bytes).

Relative error of a value whose scaled form is a normal FP8 number is at most half an ulp:
``2**-4`` (E4M3) or ``2**-3`` (E5M2); smaller values (subnormals) are within half the smallest
subnormal times the scale. Decoding rebuilds the fp16 bit pattern of each code with integer ops
(``base.fp8_as_half``: 10x faster than torch's FP8 casts on CPU) in one int16 temporary, half
the size of an fp32 output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvfactory.codecs.base import (
    Codec,
    Encoded,
    check_dtype,
    check_static_scale,
    fp8_as_half,
    per_head,
    round_to,
    smallest,
    widen,
)
from kvfactory.errors import ConfigError

if TYPE_CHECKING:
    from kvfactory.codecs.calibration import FirstUseScale

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass(eq=False)
class Fp8Codec(Codec):
    """FP8 E4M3 / E5M2 codes with per-token dynamic or per-head static scales (see the module doc)."""

    format: str = "e4m3"
    scale: str = "dynamic"
    static_scale: torch.Tensor | None = None
    first_use: FirstUseScale | None = None  # a scale fixed by the first tokens encoded (calibrate)
    scale_dtype: torch.dtype = torch.float16
    dtype: torch.dtype | None = None

    bits = 8

    def __post_init__(self) -> None:
        self.adopt_first_use()
        if self.format not in FORMATS:
            raise ConfigError("format", self.format, "'e4m3' or 'e5m2'")
        if self.scale not in ("dynamic", "static"):
            raise ConfigError("scale", self.scale, "'dynamic' or 'static'")
        if (self.static_scale is None) == (self.scale == "static"):
            raise ConfigError("static_scale", None if self.static_scale is None else "a tensor",
                              "a per-head [H] tensor exactly when scale='static'")
        check_dtype("scale_dtype", self.scale_dtype)
        if self.static_scale is not None:
            self.static_scale = check_static_scale("static_scale", self.static_scale)

    @property
    def name(self) -> str:
        return "fp8" if self.format == "e4m3" else "fp8_e5m2"

    @property
    def fixed_nbytes(self) -> int:
        return 0 if self.static_scale is None else self.static_scale.numel() * 4

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check_input(x)
        fp8 = FORMATS[self.format]
        limit = torch.finfo(fp8).max
        xf = x.float()
        if self.static_scale is not None:
            scaled = xf / per_head(self.static_scale, x.shape[1], x)
            return Encoded({"codes": scaled.clamp_(-limit, limit).to(fp8)}, x.shape[2])
        absmax = xf.abs().amax(-1, keepdim=True)
        scale = round_to((absmax / limit).clamp_min(smallest(self.scale_dtype)), self.scale_dtype, up=True)
        codes = (xf / widen(scale, torch.float32)).clamp_(-limit, limit).to(fp8)
        return Encoded({"codes": codes, "scale": scale}, x.shape[2])

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        codes = enc.tensors["codes"]
        out = self._output(out, tuple(codes.shape), codes.device)
        half, factor = fp8_as_half(codes)
        out.copy_(half)
        if self.static_scale is not None:
            scale = per_head(self.static_scale, codes.shape[1], out)
        else:
            scale = widen(enc.tensors["scale"], torch.float32)
        return out.mul_((scale * factor).to(out.dtype))

    def bytes_per_token(self, heads: int, head_dim: int) -> float:
        if self.static_scale is not None:
            return heads * head_dim
        return heads * (head_dim + self.scale_dtype.itemsize)
