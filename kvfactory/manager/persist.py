"""Saved sequences: one safetensors file with the KV of every layer and JSON metadata.

Each layer's tensors are its store's export (``layer.{i}.keys`` for plain pages;
``layer.{i}.packed.*``, the codes, scales and zero points as stored, for quantized ones). The
metadata (safetensors' string header) names the format, the model fingerprint (architecture fields
and name, the K/V layout and element type, so that a file is never loaded into a model or pool
whose K/V it does not fit), the cache config, the tokens seen per layer and a SHA-256 of every
tensor, and a SHA-256 of all of that (``digest``), so an edited header is refused like a corrupted
tensor. Writes go to a temporary file in the same folder, ``.NAME.PID.XXXXXXXX.tmp`` (PID: the
writing process), are flushed to disk and renamed over the target, so a crash leaves the old file or
the new one, never half of one; the temporaries of writers that no longer run (a killed save) are
removed by the next save or load of that path, a running writer's never. Loading checks all of it,
field by field, and raises ``SequenceFileError`` naming what is wrong, as does a path that cannot be
written or read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from kvfactory.errors import SequenceFileError
from kvfactory.manager.state import SequenceState
from kvfactory.sizing import KVShape

FORMAT = "kvfactory.sequence/2"
FINGERPRINT_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "hidden_size", "vocab_size", "_name_or_path")


def fingerprint(model_config: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The fields of ``model_config`` that decide what a layer's K/V are and mean, with the K/V layout
    and, when known, their element type (``dtype``)."""
    config = model_config.get_text_config(decoder=True)
    shape = KVShape.from_config(model_config)
    return {name: getattr(config, name, None) for name in FINGERPRINT_FIELDS} | {
        "kv_heads": shape.kv_heads, "kv_head_dim": shape.head_dim,
        "kv_dtype": None if dtype is None else str(dtype).removeprefix("torch.")}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _meta_digest(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _kv_dtype(state: SequenceState) -> torch.dtype | None:
    """The element type of the plain K/V (or full-precision window) the state holds."""
    for layer in state.layers:
        for name, t in layer.items():
            if name.endswith("keys"):
                return t.dtype
    return None


TEMPORARY = ".tmp"  # a temporary's suffix: .NAME.PID.XXXXXXXX.tmp
_WRITER = re.compile(r"(\d{1,9})\.[a-z0-9_]+")  # PID.XXXXXXXX (mkstemp's random part has no dot)


def _writer(path: Path, name: str) -> int | None:
    """The process id of the save that wrote ``name``, if ``name`` is one of ``path``'s temporaries."""
    prefix = f".{path.name}."
    if not (name.startswith(prefix) and name.endswith(TEMPORARY)):
        return None
    match = _WRITER.fullmatch(name[len(prefix):-len(TEMPORARY)])
    return int(match.group(1)) if match else None


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's included; a killed one once its parent reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _remove_dead_temporaries(path: Path) -> None:
    """Remove ``path``'s temporaries whose writer no longer runs (a killed save); a running one's
    (another process or thread saving now) stays."""
    try:
        names = os.listdir(path.parent)
    except OSError:  # no folder yet, or none readable: nothing of ours to remove
        return
    for name in names:
        pid = _writer(path, name)
        if pid is not None and pid > 0 and not _running(pid):
            with contextlib.suppress(OSError):  # best effort: it must not stop a save or a load
                (path.parent / name).unlink()


def save_state(state: SequenceState, path: str | Path, model_config: Any, cache_config: dict,
               seq_id: str) -> None:
    """Write ``state`` to ``path`` atomically (``SequenceFileError`` where the path cannot be written)."""
    path = Path(path)
    if path.is_dir():
        raise SequenceFileError(f"{path}: is a directory; give the path of a file to write")
    tensors = {f"layer.{i}.{name}": t.cpu().contiguous()
               for i, layer in enumerate(state.layers) for name, t in layer.items()}
    meta = {"format": FORMAT, "seq_id": seq_id, "fingerprint": fingerprint(model_config, _kv_dtype(state)),
            "cache_config": cache_config, "seen": state.seen,
            "checksums": {name: _digest(t) for name, t in tensors.items()}}
    meta["digest"] = _meta_digest(meta)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_temporaries(path)
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=TEMPORARY,
                                       dir=path.parent)
        os.close(handle)
        save_file(tensors, tmp, metadata={"kvfactory": json.dumps(meta)})
        with open(tmp, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(tmp, path)
        tmp = None
    except (OSError, SafetensorError) as err:
        raise SequenceFileError(f"{path}: cannot be written ({err})") from err
    finally:  # a failed save leaves no temporary
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load_state(path: str | Path, model_config: Any, cache_config: dict, pool_dtype: torch.dtype | None = None,
               evicts: bool = False) -> tuple[SequenceState, str]:
    """The state saved at ``path`` and its sequence id, checked against the model, the cache config,
    ``pool_dtype`` (the element type the pool's K/V have, if fixed) and whether the config evicts
    (else a full-attention layer of plain pages stores every token it has seen)."""
    path = Path(path)
    _remove_dead_temporaries(path)
    if path.is_dir():
        raise SequenceFileError(f"{path}: is a directory; give the path of a saved sequence file")
    if not path.is_file():
        raise SequenceFileError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as file:
            header = file.metadata() or {}
        tensors = load_file(str(path))
        meta = json.loads(header["kvfactory"])
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise SequenceFileError(f"{path}: not a readable kvfactory sequence file ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise SequenceFileError(f"{path}: format {found!r}, expected {FORMAT!r}")
    if meta.get("digest") != _meta_digest(meta):
        raise SequenceFileError(f"{path}: the metadata does not match its digest (edited or corrupted)")
    return _checked(path, meta, tensors, model_config, cache_config, pool_dtype, evicts)


def _checked(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor], model_config: Any,
             cache_config: dict, pool_dtype: torch.dtype | None, evicts: bool) -> tuple[SequenceState, str]:
    """The file's state after every field is checked (types, the model, the config, the checksums)."""
    expected = {"seq_id": str, "fingerprint": dict, "cache_config": dict, "seen": list, "checksums": dict}
    for key, kind in expected.items():
        if not isinstance(meta.get(key), kind):
            raise SequenceFileError(f"{path}: metadata {key!r} is {meta.get(key)!r}, "
                                    f"expected a {kind.__name__}")
    saved, mine = meta["fingerprint"], fingerprint(model_config)
    differ = {k: (saved.get(k), v) for k, v in mine.items() if k != "kv_dtype" and saved.get(k) != v}
    if differ:
        raise SequenceFileError(f"{path}: saved for another model; (file, this model) differ in {differ}")
    wanted = pool_dtype or getattr(model_config.get_text_config(decoder=True), "dtype", None)
    if wanted is not None and saved.get("kv_dtype") not in (None, str(wanted).removeprefix("torch.")):
        raise SequenceFileError(f"{path}: K/V of dtype {saved.get('kv_dtype')}, this manager's are {wanted}")
    if meta["cache_config"] != cache_config:
        raise SequenceFileError(f"{path}: saved with cache config {meta['cache_config']}, this manager's is "
                                f"{cache_config}")
    seen, layers = meta["seen"], model_config.get_text_config(decoder=True).num_hidden_layers
    if len(seen) != layers or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                      for n in seen):
        raise SequenceFileError(f"{path}: seen={seen}: expected {layers} token counts >= 0")
    if set(tensors) != set(meta["checksums"]):
        odd = sorted(set(tensors) ^ set(meta["checksums"]))
        raise SequenceFileError(f"{path}: tensors {odd} missing or extra")
    for name, t in tensors.items():
        if _digest(t) != meta["checksums"][name]:
            raise SequenceFileError(f"{path}: tensor {name} does not match its checksum (corrupted)")
    state: list[dict[str, torch.Tensor]] = [{} for _ in seen]
    for name, t in tensors.items():
        try:
            _, index, key = name.split(".", 2)
            state[int(index)][key] = t
        except (ValueError, IndexError):
            raise SequenceFileError(f"{path}: tensor {name!r} names no layer of {len(state)}") from None
    windows = KVShape.from_config(model_config).windows
    for i, layer in enumerate(state):
        stored = layer["keys"].shape[2] if "keys" in layer else 0
        whole = set(layer) <= {"keys", "values"} and windows[i] is None and not evicts
        if seen[i] < stored or whole and seen[i] != stored:
            raise SequenceFileError(f"{path}: layer {i} stores {stored} tokens but has seen {seen[i]}")
    return SequenceState(state, list(seen)), meta["seq_id"]
