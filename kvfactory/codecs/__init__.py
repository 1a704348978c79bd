"""Codecs: how K/V bytes are encoded (identity, int8, KIVI int4 / int2, fp8), pure tensor code.

``make_codec(name, role, **options)`` builds the codec a cache config names for the keys or the
values; ``CODECS`` maps each name to its factory, a ``CodecSpec`` called as ``spec(role, **options)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvfactory.codecs.base import Codec, Encoded
from kvfactory.codecs.fp8 import Fp8Codec
from kvfactory.codecs.identity import IdentityCodec
from kvfactory.codecs.int8 import Int8Codec
from kvfactory.codecs.kivi import KiviKeyCodec, KiviValueCodec
from kvfactory.errors import ConfigError

ROLES = ("key", "value")


@dataclass(frozen=True)
class CodecSpec:
    """The codec classes for keys and values under one name, and the options the name fixes."""

    key: type[Codec]
    value: type[Codec]
    fixed: dict[str, Any] = field(default_factory=dict)

    def __call__(self, role: str, **options: Any) -> Codec:
        if role not in ROLES:
            raise ConfigError("role", role, "'key' or 'value'")
        cls = self.key if role == "key" else self.value
        allowed = sorted({f.name for f in dataclasses.fields(cls) if f.init} - set(self.fixed))
        for name in options:
            if name not in allowed:
                raise ConfigError(f"{cls.__name__} option", name, ", ".join(allowed))
        return cls(**self.fixed, **options)


CODECS: dict[str, CodecSpec] = {
    "none": CodecSpec(IdentityCodec, IdentityCodec),
    "identity": CodecSpec(IdentityCodec, IdentityCodec),
    "int8": CodecSpec(Int8Codec, Int8Codec),
    "int4": CodecSpec(KiviKeyCodec, KiviValueCodec, {"bits": 4}),
    "int2": CodecSpec(KiviKeyCodec, KiviValueCodec, {"bits": 2}),
    "fp8": CodecSpec(Fp8Codec, Fp8Codec, {"format": "e4m3"}),
    "fp8_e5m2": CodecSpec(Fp8Codec, Fp8Codec, {"format": "e5m2"}),
}


def make_codec(name: str, role: str, **options: Any) -> Codec:
    """The codec ``name`` for the keys (``role="key"``) or the values, with its hyperparameters."""
    if name not in CODECS:
        raise ConfigError("quantization", name, ", ".join(CODECS))
    return CODECS[name](role, **options)


__all__ = ["CODECS", "Codec", "CodecSpec", "Encoded", "Fp8Codec", "IdentityCodec", "Int8Codec",
           "KiviKeyCodec", "KiviValueCodec", "make_codec"]
