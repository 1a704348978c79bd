"""Saved sequences: one safetensors file with the KV of every layer and JSON metadata.

Each layer's tensors are its store's export (``layer.{i}.keys`` for plain pages;
``layer.{i}.packed.*``, the codes, scales and zero points as stored, for quantized ones). The
metadata (safetensors' string header) names the format, the model fingerprint (architecture fields
and name, so that a file is never loaded into a model whose K/V it does not fit), the cache config,
the tokens seen per layer and a SHA-256 of every tensor. Writes go to a temporary file in the same
folder, are flushed to disk and renamed over the target, so a crash leaves the old file or the new
one, never half of one. Loading checks all of it and raises ``SequenceFileError`` naming what is
wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from kvfactory.errors import SequenceFileError
from kvfactory.manager.state import SequenceState

FORMAT = "kvfactory.sequence/1"
FINGERPRINT_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "hidden_size", "vocab_size", "_name_or_path")


def fingerprint(model_config: Any) -> dict[str, Any]:
    """The fields of ``model_config`` that decide what a layer's K/V are and mean."""
    config = model_config.get_text_config(decoder=True)
    return {name: getattr(config, name, None) for name in FINGERPRINT_FIELDS}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def save_state(state: SequenceState, path: str | Path, model_config: Any, cache_config: dict,
               seq_id: str) -> None:
    """Write ``state`` to ``path`` atomically."""
    path = Path(path)
    tensors = {f"layer.{i}.{name}": t.cpu().contiguous()
               for i, layer in enumerate(state.layers) for name, t in layer.items()}
    meta = {"format": FORMAT, "seq_id": seq_id, "fingerprint": fingerprint(model_config),
            "cache_config": cache_config, "seen": state.seen,
            "checksums": {name: _digest(t) for name, t in tensors.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        save_file(tensors, tmp, metadata={"kvfactory": json.dumps(meta)})
        with open(tmp, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_state(path: str | Path, model_config: Any, cache_config: dict) -> tuple[SequenceState, str]:
    """The state saved at ``path`` and its sequence id, checked against the model and cache config."""
    path = Path(path)
    if not path.is_file():
        raise SequenceFileError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as file:
            header = file.metadata() or {}
        tensors = load_file(str(path))
        meta = json.loads(header["kvfactory"])
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise SequenceFileError(f"{path}: not a readable kvfactory sequence file ({err})") from None
    if meta.get("format") != FORMAT:
        raise SequenceFileError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    mine = fingerprint(model_config)
    if meta["fingerprint"] != mine:
        saved = meta["fingerprint"]
        differ = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        raise SequenceFileError(f"{path}: saved for another model; (file, this model) differ in {differ}")
    if meta["cache_config"] != cache_config:
        raise SequenceFileError(f"{path}: saved with cache config {meta['cache_config']}, this manager's is "
                                f"{cache_config}")
    if set(tensors) != set(meta["checksums"]):
        odd = sorted(set(tensors) ^ set(meta["checksums"]))
        raise SequenceFileError(f"{path}: tensors {odd} missing or extra")
    for name, t in tensors.items():
        if _digest(t) != meta["checksums"][name]:
            raise SequenceFileError(f"{path}: tensor {name} does not match its checksum (corrupted)")
    layers: list[dict[str, torch.Tensor]] = [{} for _ in meta["seen"]]
    for name, t in tensors.items():
        try:
            _, index, key = name.split(".", 2)
            layers[int(index)][key] = t
        except (ValueError, IndexError):
            raise SequenceFileError(f"{path}: tensor {name!r} names no layer of {len(layers)}") from None
    return SequenceState(layers, list(meta["seen"])), meta["seq_id"]
