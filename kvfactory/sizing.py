"""KV-cache memory calculator: bytes per token, totals, and the longest context a budget holds.

An estimate from the model's shape, not a measurement (caches report their real bytes through
``memory_report()``). Per layer and token, with ``H`` KV heads of ``D`` channels, K and V together
cost ``2 * D * dtype_bytes`` per head unquantized (fp32 4, fp16 / bf16 2); a codec costs what its
``kvfactory.codecs`` class says it stores (``Codec.bytes_per_token``: packed codes, scales and zero
points), independent of the model dtype: int8 and fp8 one byte per element plus an fp16 scale per
token and head; KIVI int4 / int2 elements packed 2 / 4 per byte, keys with an E4M3 scale and an
fp16 zero point per channel and group of 32 tokens, values with E4M3 scale and zero per token and
group of 32 channels. The full-precision residual window of recent tokens is not counted.

Sliding-window layers hold at most their window (``kvfactory.cache.attention_layout``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DType = Literal["fp32", "fp16", "bf16"]
Codec = Literal["none", "int8", "fp8", "int4", "int2"]
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
CODECS: tuple[str, ...] = get_args(Codec)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class KVShape:
    """What the KV cache size depends on: KV heads, head size and each layer's window (None = full)."""

    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]

    @classmethod
    def from_config(cls, model_config: PretrainedConfig) -> KVShape:
        """Read a transformers ``PretrainedConfig`` (its text decoder for multimodal models)."""
        text = model_config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        from kvfactory.cache import attention_layout  # transformers: only once a config is read

        return cls(kv_heads, head_dim, tuple(attention_layout(model_config)))

    @property
    def num_layers(self) -> int:
        return len(self.windows)


if TYPE_CHECKING:
    Model = PretrainedConfig | KVShape  # what the calculator accepts: a transformers config or a KVShape


def _shape(model: Model) -> KVShape:
    return model if isinstance(model, KVShape) else KVShape.from_config(model)


def _check(dtype: str, codec: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r}: expected one of {', '.join(CODECS)}")


def _head_token_bytes(head_dim: int, dtype: DType, codec: Codec) -> Fraction:
    """Bytes one token costs in one KV head of one layer, keys and values together (see the table)."""
    _check(dtype, codec)
    if codec == "none":
        return Fraction(2 * head_dim * DTYPE_BYTES[dtype])
    from kvfactory.codecs import make_codec  # torch: only once a codec is sized

    return sum(Fraction(make_codec(codec, role).bytes_per_token(1, head_dim)) for role in ("key", "value"))


def bytes_per_token_per_layer(model: Model, dtype: DType = "fp16", codec: Codec = "none") -> float:
    """Bytes one token of one sequence costs in one layer (all KV heads, K and V)."""
    shape = _shape(model)
    return float(shape.kv_heads * _head_token_bytes(shape.head_dim, dtype, codec))


def bytes_per_token(model: Model, dtype: DType = "fp16", codec: Codec = "none") -> float:
    """Bytes one token of one sequence costs in all layers (while it is inside every window)."""
    return _shape(model).num_layers * bytes_per_token_per_layer(model, dtype, codec)


def kv_bytes(model: Model, context: int, batch: int = 1, dtype: DType = "fp16", codec: Codec = "none") -> int:
    """Bytes of KV cache for ``batch`` sequences of ``context`` tokens, summed over layers."""
    if context < 0 or batch < 1:
        raise ValueError(f"context={context}, batch={batch}: expected context >= 0 and batch >= 1")
    shape = _shape(model)
    held = sum(context if w is None else min(context, w) for w in shape.windows)
    return math.ceil(held * batch * shape.kv_heads * _head_token_bytes(shape.head_dim, dtype, codec))


def max_context(model: Model, memory: int, batch: int = 1, dtype: DType = "fp16",
                codec: Codec = "none") -> int | None:
    """Largest context whose KV cache for ``batch`` sequences fits in ``memory`` bytes.

    ``None`` means unbounded: every layer is sliding-window and all windows fit.
    """
    shape = _shape(model)
    if kv_bytes(shape, 1, batch, dtype, codec) > memory:
        return 0
    if all(w is not None for w in shape.windows) and kv_bytes(shape, max(shape.windows), batch, dtype,
                                                              codec) <= memory:
        return None
    lo, hi = 1, 2
    while kv_bytes(shape, hi, batch, dtype, codec) <= memory:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv_bytes(shape, mid, batch, dtype, codec) <= memory else (lo, mid)
    return lo


def parse_memory(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"512MiB"``, ``"2GB"``, ``"1.5 GiB"`` or plain ``"1000000"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) of 1000.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(f"memory {text!r}: expected a number of bytes with an optional unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 8GiB or 512MiB")
    size = int(Fraction(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"memory {text!r}: must be at least 1 byte")
    return size


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``"1.5 GiB"``, ``"768 B"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
