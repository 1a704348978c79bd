"""Calibration: per-layer, per-head K/V magnitudes on real text, saved as static scales (safetensors).

Static-scale codecs (fp8 with ``scale="static"``, int8 with ``granularity="head"``) store codes
only, no per-token scale: their one scale per KV head comes from here. ``collect`` runs the model
over calibration text and records each layer's largest |K| and |V| per KV head; ``save`` writes
them (atomically: temp file, fsync, rename) with the model's shape and the token count;
``load`` checks the file against the model it is used with. A codec's scale is
``absmax / code_max`` (448 for FP8 E4M3, 57344 for E5M2, 127 for int8); values beyond saturate.
"""

from __future__ import annotations

import functools
import os
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
