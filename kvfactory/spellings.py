"""The design article's spellings of kvfactory's concepts, accepted as they are pasted.

The article kvfactory implements gives its own YAML config, typed config objects and keyword
names. ``translate`` rewrites its config keys into kvfactory's before a config is validated, and
``PagedKVCacheConfig`` / ``PagedQuantizedCacheConfig`` are its typed configs (docs/storage.md
has the table, the article's name against kvfactory's):

- ``type: native`` is ``type: dense`` (``DynamicCache``'s layout);
- ``quant_bits: 8`` (flat, or in a ``quantized`` entry) is ``quantization: int8`` (4: ``int4``,
  2: ``int2``);
- ``calibrate: true`` in a ``quantized`` entry is kvfactory's own ``calibrate`` for int8 and fp8:
  static per-head scales fixed by the first 512 tokens a cache writes, shared by the factory's
  caches; ``false`` keeps per-token scales. KIVI codecs (``quant_bits`` 4 and 2) compute
  their scales per group as they write, so for them ``calibrate`` changes nothing;
- ``{name: selective, strategy: sliding_window, window_size: W}`` is
  ``{name: eviction, policy: window, budget: W}``; another ``strategy`` names an eviction policy
  (``h2o``, ``snapkv``, ...) with its own options;
- ``share_system_prompt`` is ``share_prefix``: a ``KVCacheManager`` (and the engine) over the config
  shares cached prompt prefixes between sequences, or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvfactory.codecs.spec import BITS, KIVI
from kvfactory.errors import ConfigError

SELECTIVE = {"sliding_window": "window", "attention_score": "h2o"}  # the article's eviction strategies


def translate(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the article's keys rewritten as kvfactory's (a new dict; kvfactory's own keys
    pass through unchanged)."""
    config = dict(config)
    if "share_system_prompt" in config:
        config["share_prefix"] = config.pop("share_system_prompt")
    if config.get("type") == "native":
        config["type"] = "dense"
    if "quant_bits" in config:
        config["quantization"] = _codec(config.pop("quant_bits"), "quant_bits")
    if config.get("type") == "composite" and isinstance(config.get("strategies"), list):
        config["strategies"] = [_entry(entry, f"strategies[{i}].")
                                for i, entry in enumerate(config["strategies"])]
    return config


def _entry(entry: Any, where: str) -> Any:
    if not isinstance(entry, dict):
        return entry
    entry = dict(entry)
    if entry.get("name") == "quantized":
        if "quant_bits" in entry:
            entry["codec"] = _codec(entry.pop("quant_bits"), f"{where}quant_bits")
        calibrate = entry.get("calibrate", False)
        if not isinstance(calibrate, bool):
            raise ConfigError(f"{where}calibrate", calibrate, "true or false")
        if entry.get("codec", BITS.get(entry.get("bits"), "int8")) in KIVI:
            entry.pop("calibrate", None)
    elif entry.get("name") == "selective":
        strategy = entry.pop("strategy", "sliding_window")
        if not isinstance(strategy, str):
            raise ConfigError(f"{where}strategy", strategy, "an eviction strategy, e.g. 'sliding_window'")
        entry = {"name": "eviction", "policy": SELECTIVE.get(strategy, strategy)} | {
            k: v for k, v in entry.items() if k != "name"}
        if strategy == "sliding_window" and "window_size" in entry:
            entry["budget"] = entry.pop("window_size")
    return entry


def _codec(bits: Any, key: str) -> str:
    if bits not in BITS or isinstance(bits, bool):
        raise ConfigError(key, bits, f"one of {sorted(BITS)} (bits per stored element)")
    return BITS[bits]


@dataclass(frozen=True)
class PagedKVCacheConfig:
    """Paged storage as the article's typed config: ``page_size`` tokens per page, ``num_blocks``
    pages in the pool (default: grown as needed). ``dtype`` is the precision attention computes in,
    the model's own: caches hold what the model writes and give it back in that dtype."""

    page_size: int = 256
    num_blocks: int | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        floating = isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        if self.dtype is not None and not floating:
            raise ConfigError("dtype", self.dtype, "a floating torch dtype (the model's), or None")

    def to_config(self) -> dict[str, Any]:
        """The same config as a kvfactory config dict."""
        config: dict[str, Any] = {"type": "paged", "page_size": self.page_size}
        return config | ({} if self.num_blocks is None else {"pool_blocks": self.num_blocks})


@dataclass(frozen=True)
class PagedQuantizedCacheConfig(PagedKVCacheConfig):
    """Paged storage with keys and values stored in ``quant_bits`` bits (8: int8, 4: int4 KIVI, 2:
    int2 KIVI), as the article's typed config."""

    quant_bits: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        _codec(self.quant_bits, "quant_bits")

    def to_config(self) -> dict[str, Any]:
        return super().to_config() | {"quantization": _codec(self.quant_bits, "quant_bits")}
