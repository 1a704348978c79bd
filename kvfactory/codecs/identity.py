"""The identity codec: tensors stored as they are (lossless), the reference for every other codec."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfactory.codecs.base import Codec, Encoded
from kvfactory.errors import ConfigError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(eq=False)
class IdentityCodec(Codec):
    """Stores ``[B, H, T, D]`` unchanged in ``dtype`` (``None``: the first encoded tensor's dtype).

    Lossless when ``dtype`` is the input's; a narrower ``dtype`` (fp16 storage of an fp32 model) is a
    plain cast. Encoded: ``data`` ``[B, H, T, D]``, a copy, so the caller may reuse its tensor.
    """

    dtype: torch.dtype | None = None

    name = "identity"

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in FLOAT_DTYPES:
            raise ConfigError("dtype", self.dtype, ", ".join(map(str, FLOAT_DTYPES)) + " or None")

    @property
    def bits(self) -> int:
        if self.dtype is None:
            raise ValueError("identity codec: its width is fixed by `dtype` or by the first encode")
        return 8 * self.dtype.itemsize

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check_input(x)
        return Encoded({"data": x.to(self.dtype, copy=True)}, x.shape[2])

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        data = enc.tensors["data"]
        if out is None:
            return data.clone()
        return self._output(out, tuple(data.shape), data.device).copy_(data)

    def bytes_per_token(self, heads: int, head_dim: int) -> float:
        return heads * head_dim * self.bits / 8
