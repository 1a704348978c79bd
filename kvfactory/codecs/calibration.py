"""Calibration: per-layer, per-head K/V magnitudes on real text, saved as static scales (safetensors).

Static-scale codecs (fp8 with ``scale="static"``, int8 with ``granularity="head"``) store codes
only, no per-token scale: their one scale per KV head comes from here. ``collect`` runs the model
over calibration text and records each layer's largest |K| and |V| per KV head; ``save`` writes
them (atomically: temp file, fsync, rename) with the model's shape and the token count;
``load`` checks the file against the model it is used with. A codec's scale is
``absmax / code_max`` (448 for FP8 E4M3, 57344 for E5M2, 127 for int8); values beyond saturate.

``FirstUseScales`` calibrates online instead (``calibrate: true``, as vLLM's ``calculate_kv_scales``
does on its first forward): each layer's scales are fixed by the first ``FIRST_USE_TOKENS`` tokens
a cache writes through it (held in full precision until then), so a short first prompt (a warm-up)
does not set scales its successors overflow.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvfactory.errors import ConfigError

KEYS, VALUES = "key_absmax", "value_absmax"


@torch.inference_mode()
def collect(model: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{key_absmax, value_absmax}``: ``[layers, kv_heads]`` float32 maxima of |K| and |V| on the ids."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    keys = torch.stack([layer.keys.abs().amax(dim=(0, 2, 3)) for layer in cache.layers]).float()
    values = torch.stack([layer.values.abs().amax(dim=(0, 2, 3)) for layer in cache.layers]).float()
    return {KEYS: keys.contiguous(), VALUES: values.contiguous()}


def save(scales: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> Path:
    """Write the scales to ``path`` without ever leaving a partial file there."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file(scales, str(tmp), metadata=metadata)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@functools.cache
def load(path: str) -> dict[str, torch.Tensor]:
    """The scales in ``path`` (cached per path); ``ConfigError`` for a missing or malformed file."""
    try:
        scales = load_file(path)
    except (OSError, SafetensorError) as exc:
        raise ConfigError("scales", path, f"a calibration file from `kvfactory calibrate` ({exc})") from exc
    if set(scales) != {KEYS, VALUES} or scales[KEYS].shape != scales[VALUES].shape or scales[KEYS].dim() != 2:
        raise ConfigError("scales", path, f"a file holding {KEYS} and {VALUES} of shape [layers, kv_heads]")
    if not all(bool((t > 0).all()) and bool(torch.isfinite(t).all()) for t in scales.values()):
        raise ConfigError("scales", path, "positive finite magnitudes (the file is damaged)")
    return scales


def layer_absmax(path: str, layer: int, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s ``[kv_heads]`` |K| and |V| maxima, after checking the file has ``num_layers``."""
    scales = load(path)
    if scales[KEYS].shape[0] != num_layers:
        raise ConfigError("scales", path, f"calibration for a model of {num_layers} layers; the file holds "
                                          f"{scales[KEYS].shape[0]}")
    return scales[KEYS][layer], scales[VALUES][layer]


FIRST_USE_TOKENS = 512  # tokens a layer holds in full precision before its first-use scales are fixed


class FirstUseScale:
    """One layer's static per-head scale of its keys or its values, fixed by the first tokens encoded
    with it: ``absmax / limit`` per KV head over those tokens (a prompt's prefill, typically), what
    ``collect`` would measure on them. It holds ones until then, and an all-zero tensor (a probe of
    the block layout) leaves it unfixed. ``scale`` is one tensor, updated in place, so every codec
    built on the cell sees the fixed value."""

    def __init__(self, heads: int, limit: float) -> None:
        self.scale = torch.ones(heads)
        self.limit = limit
        self.fixed = False
        self._lock = threading.Lock()

    def fix(self, x: torch.Tensor) -> None:
        """Fix the scale from ``x [B, heads, T, D]`` unless it is fixed already or ``x`` is all zeros."""
        if self.fixed:
            return
        absmax = x.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
        if not bool((absmax > 0).any()):
            return
        with self._lock:
            if not self.fixed:
                self.scale.copy_((absmax / self.limit).clamp_min(torch.finfo(torch.float32).tiny))
                self.fixed = True


class FirstUseScales:
    """The first-use scales of every layer of a factory's caches (``cell(layer, role, limit)``): all its
    caches encode with the same scales, so the blocks they share decode alike."""

    def __init__(self, kv_heads: int) -> None:
        self.kv_heads = kv_heads
        self._cells: dict[tuple[int, str], FirstUseScale] = {}

    def cell(self, layer: int, role: str, limit: float) -> FirstUseScale:
        return self._cells.setdefault((layer, role), FirstUseScale(self.kv_heads, limit))

    def fixed(self) -> bool:
        """Whether every layer built so far has fixed its scales."""
        return bool(self._cells) and all(cell.fixed for cell in self._cells.values())
