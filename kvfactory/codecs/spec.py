"""What a config asks of quantization: the codec, its options, the residual window and per-layer precision.

``{"type": "paged", "page_size": 16, "quantization": "int4"}`` (a codec name) or a mapping
(``{"codec": "int4", "group_size": 32, "residual": 128}``), or in a composite config a
``{"name": "quantized", ...}`` entry with the same options (``bits: 4`` is short for ``codec: int4``).

Per-layer precision: ``full_precision_first`` / ``full_precision_last`` keep that many
layers at each end unquantized, or ``layers`` names a codec per layer explicitly.

Static scales: ``scales`` names a file from ``kvfactory calibrate``; fp8 then stores
codes with one calibrated scale per KV head (``absmax / 448``, E5M2 ``/ 57344``), int8 likewise
(``absmax / 127``, per-head granularity), with no per-token scale bytes. ``calibrate: true`` makes
the same static scales online, from the first 512 tokens a cache writes, shared by every cache of
the factory (``calibration.FirstUseScales``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from kvfactory.codecs import CODECS, Codec, calibration, make_codec
from kvfactory.codecs.calibration import FirstUseScales
from kvfactory.errors import ConfigError

KIVI = ("int4", "int2")
LOSSLESS = ("none", "identity")
KIVI_RESIDUAL = 128  # KIVI's full-precision window of recent tokens
BITS = {8: "int8", 4: "int4", 2: "int2"}
STATIC_LIMITS = {"int8": 127.0, "fp8": torch.finfo(torch.float8_e4m3fn).max,
                 "fp8_e5m2": torch.finfo(torch.float8_e5m2).max}


@dataclass(frozen=True)
class QuantizationSpec:
    """Validated quantization options; ``codecs(layer, layers)`` builds one layer's key/value codecs."""

    codec: str = "int8"
    group_size: int = 32
    residual: int | None = None  # default: 128 for KIVI (int4/int2), 0 otherwise
    granularity: str = "token"  # int8 only: "token" or "head"
    full_precision_first: int = 0
    full_precision_last: int = 0
    layers: tuple[str, ...] | None = None
    scales: str | None = None  # a calibration file (kvfactory calibrate) for static fp8 / int8 scales
    calibrate: bool = False  # static fp8 / int8 scales from the first 512 tokens written (FirstUseScales)

    def __post_init__(self) -> None:
        for name in (self.codec, *(self.layers or ())):
            if name not in CODECS:
                raise ConfigError("quantization" if name == self.codec else "layers", name,
                                  ", ".join(CODECS))
        for key in ("group_size",):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(key, getattr(self, key), "an integer >= 1")
        for key in ("full_precision_first", "full_precision_last"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise ConfigError(key, getattr(self, key), "an integer >= 0")
        if self.residual is not None and (not isinstance(self.residual, int) or self.residual < 0):
            raise ConfigError("residual", self.residual, "an integer >= 0 (tokens kept in full precision)")
        if self.granularity not in ("token", "head"):
            raise ConfigError("granularity", self.granularity, "'token' or 'head' (int8)")
        if self.layers is not None and (self.full_precision_first or self.full_precision_last):
            raise ConfigError("layers", list(self.layers),
                              "either an explicit per-layer list or full_precision_first/last, not both")
        if not isinstance(self.calibrate, bool):
            raise ConfigError("calibrate", self.calibrate, "true or false")
        if self.calibrate and self.scales is not None:
            raise ConfigError("calibrate", True, f"static scales from a file (scales={self.scales!r}) or "
                              "from the first tokens written (calibrate: true), not both")
        unscaled = sorted({n for n in (self.codec, *(self.layers or ())) if n in KIVI})
        if unscaled and (self.scales is not None or self.calibrate):
            key, value = ("scales", self.scales) if self.scales is not None else ("calibrate", True)
            raise ConfigError(key, value, f"static scales serve fp8 and int8, not {unscaled} (KIVI computes "
                              f"its scales per group as it writes)")
        if self.scales is not None:
            calibration.load(self.scales)  # a missing or damaged file fails now, naming the file
        else:
            self.codecs(0, max(1, len(self.layers or ())), FirstUseScales(1))  # the codecs' own checks

    @classmethod
    def parse(cls, value: Any, where: str = "") -> QuantizationSpec | None:
        """A spec from a codec name, a mapping of options (``bits`` allowed), or None."""
        if value is None:
            return None
        if isinstance(value, str):
            value = {"codec": value}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}quantization", value, "a codec name or a mapping of options")
        options = dict(value)
        if "bits" in options:
            bits = options.pop("bits")
            if bits not in BITS or "codec" in options:
                raise ConfigError(f"{where}bits", bits, f"one of {sorted(BITS)}, without 'codec'")
            options["codec"] = BITS[bits]
        allowed = {f.name for f in fields(cls)}
        for key in options:
            if key not in allowed:
                raise ConfigError(f"{where}{key}", options[key], f"quantization options: {sorted(allowed)}")
        if isinstance(options.get("layers"), list):
            options["layers"] = tuple(options["layers"])
        try:
            return cls(**options)
        except ConfigError as exc:
            raise ConfigError(f"{where}{exc.key}", exc.value, exc.allowed) from None

    def check_layers(self, num_layers: int) -> None:
        """Refuse per-layer options that do not fit a model of ``num_layers`` layers (the factory knows
        it): a codec list of another length, or full-precision layers that leave none quantized."""
        self.codec_name(0, num_layers)  # a per-layer codec list names every layer
        first, last = self.full_precision_first, self.full_precision_last
        for key, value in (("full_precision_first", first), ("full_precision_last", last)):
            if value >= num_layers:
                raise ConfigError(key, value, f"fewer than the model's {num_layers} layers: at least one "
                                  f"layer is quantized (to quantize none, leave quantization out)")
        if first + last >= num_layers:
            raise ConfigError("full_precision_first", first, f"at most {num_layers - 1 - last} with "
                              f"full_precision_last={last}: at least one of the model's {num_layers} layers "
                              f"is quantized")

    def codec_name(self, layer: int, num_layers: int) -> str:
        """The codec of layer ``layer`` of ``num_layers``."""
        if self.layers is not None:
            if len(self.layers) != num_layers:
                raise ConfigError("layers", list(self.layers), f"one codec per layer: {num_layers} names")
            return self.layers[layer]
        if layer < self.full_precision_first or layer >= num_layers - self.full_precision_last:
            return "none"
        return self.codec

    def residual_for(self, name: str) -> int:
        """Tokens kept in full precision after the newest one (KIVI's window; 0 for per-token codecs)."""
        if self.residual is not None:
            return self.residual
        return KIVI_RESIDUAL if name in KIVI else 0

    def codecs(self, layer: int, num_layers: int,
               first_use: FirstUseScales | None = None) -> tuple[Codec, Codec] | None:
        """New key and value codecs for one layer, or None where the layer stays in full precision;
        with ``calibrate``, their scales are ``first_use``'s cells for the layer (the factory's)."""
        name = self.codec_name(layer, num_layers)
        if name in LOSSLESS:
            return None
        options: dict[str, Any] = {}
        if name in KIVI:
            options["group_size"] = self.group_size
        elif name == "int8":
            options["granularity"] = "head" if self.scales or self.calibrate else self.granularity
        if self.scales is None and not self.calibrate:
            return make_codec(name, "key", **options), make_codec(name, "value", **options)
        limit = STATIC_LIMITS[name]
        if name.startswith("fp8"):
            options["scale"] = "static"
        if self.calibrate:
            if first_use is None:
                raise ValueError("calibrate: true needs the factory's FirstUseScales")
            return (make_codec(name, "key", first_use=first_use.cell(layer, "key", limit), **options),
                    make_codec(name, "value", first_use=first_use.cell(layer, "value", limit), **options))
        key_max, value_max = calibration.layer_absmax(self.scales, layer, num_layers)
        return (make_codec(name, "key", static_scale=key_max / limit, **options),
                make_codec(name, "value", static_scale=value_max / limit, **options))
