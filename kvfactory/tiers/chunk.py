"""A chunk of K/V as bytes, what the tiers store, and the key that names it.

A chunk is ``tokens`` consecutive tokens of a prompt in every layer: keys and values
``[layers, kv_heads, tokens, head_dim]``, encoded by one of kvfactory's codecs (``identity``:
exact; ``int8`` or ``fp8``: about a quarter of fp32's bytes, half of fp16's; ``int4``, KIVI: about
a sixth of fp32's) and serialized as a safetensors file. Its header carries the format, the key
the chunk was stored under and a 128-bit XXH3 checksum of every tensor (a checksum against
corruption, at memory speed, not a signature: whoever can write to a tier can write any chunk), so
a value that comes back truncated, corrupted or under another key is refused (``ChunkError``) and
its reader treats it as a miss.

``ChunkKey`` names a chunk by the model (a fingerprint of the fields that decide what its K/V
mean), the layout (layers, KV heads, head size, chunk tokens, element type), the codec and the
chained hash of every token up to the chunk's end (``kvfactory.hashing.block_hashes``), so two
models, two layouts or two codecs never read each other's chunks, and equal keys mean equal K/V. A
chunk may be stored as parts, each a range of its layers under a key of its own (``ChunkKey.part``),
so that a reader starts on the first layers while the rest are on their way.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash
from safetensors.torch import save as save_tensors

from kvfactory.codecs import Encoded, make_codec
from kvfactory.errors import ConfigError, KVFactoryError, ShapeError
from kvfactory.hashing import block_hashes

FORMAT = "kvfactory.chunk/2"
CHUNK_CODECS = ("identity", "int8", "fp8", "int4")
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16)}


class ChunkError(KVFactoryError, ValueError):
    """Chunk bytes that are not a whole, matching chunk: a miss for the tier that returned them."""


@dataclass(frozen=True)
class ChunkLayout:
    """What every chunk of one cache looks like: ``layers`` × ``kv_heads`` × ``tokens`` ×
    ``head_dim`` keys and values of ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens: int = 256
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "an integer >= 1")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, ", ".join(DTYPES))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.layers, self.kv_heads, self.tokens, self.head_dim

    def __str__(self) -> str:
        return f"L{self.layers}-H{self.kv_heads}-D{self.head_dim}-T{self.tokens}-{self.dtype}"


def model_fingerprint(**fields: object) -> str:
    """A short digest of the fields that decide what a model's K/V mean (architecture, sizes, the
    weights' name or revision): chunks of two models never share a key."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ChunkKey:
    model: str  # model_fingerprint(...)
    layout: str  # str(ChunkLayout)
    codec: str
    prefix: str  # hex of the chained hash of the prompt's tokens up to the chunk's end
    layers: tuple[int, int] | None = None  # a part of the chunk: its layers [first, end); None: all

    def __str__(self) -> str:
        part = "" if self.layers is None else f":{self.layers[0]}-{self.layers[1]}"
        return f"kvfactory:{self.model}:{self.layout}:{self.codec}:{self.prefix}{part}"

    def part(self, first: int, end: int) -> ChunkKey:
        """The key of the chunk's layers ``[first, end)`` stored as a value of their own, so that a
        reader can use the first layers before the last ones arrive."""
        layers = _layout(self).layers
        if not 0 <= first < end <= layers:
            raise ConfigError("layers", (first, end), f"a range inside the chunk's {layers} layers")
        return ChunkKey(self.model, self.layout, self.codec, self.prefix, (first, end))

    @classmethod
    def parse(cls, text: str) -> ChunkKey:
        """The key ``str(key)`` printed."""
        parts = text.split(":")
        if len(parts) not in (5, 6) or parts[0] != "kvfactory":
            raise ChunkError(f"{text!r} is not a kvfactory chunk key "
                             f"(kvfactory:MODEL:LAYOUT:CODEC:PREFIX[:FIRST-END])")
        if len(parts) == 5:
            return cls(*parts[1:])
        try:
            first, end = (int(n) for n in parts[5].split("-"))
        except ValueError as exc:
            raise ChunkError(f"{text!r}: layers {parts[5]!r} are not FIRST-END") from exc
        return cls(*parts[1:5], layers=(first, end))


def layer_parts(layers: int, parts: int) -> list[tuple[int, int]]:
    """``layers`` split into ``parts`` consecutive ranges of near-equal size, first to last."""
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= layers:
        raise ConfigError("layer_parts", parts, f"an integer from 1 to the {layers} layers")
    bounds = [layers * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def chunk_keys(tokens: Sequence[int], model: str, layout: ChunkLayout, codec: str) -> list[ChunkKey]:
    """The keys of the whole chunks of ``tokens``, in order (a partial last chunk has none)."""
    if codec not in CHUNK_CODECS:
        raise ConfigError("codec", codec, ", ".join(CHUNK_CODECS))
    return [ChunkKey(model, str(layout), codec, name.hex()) for name in block_hashes(tokens, layout.tokens)]


def encode_chunk(key: ChunkKey, keys: torch.Tensor, values: torch.Tensor) -> bytes:
    """The bytes of one chunk: ``keys`` and ``values`` ``[layers, kv_heads, tokens, head_dim]``
    (the layout ``key`` names; for a part, its layers only) through ``key.codec``."""
    if keys.shape != values.shape or keys.dim() != 4 or keys.dtype != values.dtype:
        raise ShapeError(f"chunk {key.prefix[:12]}: keys {tuple(keys.shape)} ({keys.dtype}) and values "
                         f"{tuple(values.shape)} ({values.dtype}) must be one [layers, kv_heads, tokens, "
                         f"head_dim] shape and dtype")
    layout = _layout(key)
    if tuple(keys.shape) != layout.shape or DTYPES[layout.dtype] != keys.dtype:
        raise ShapeError(f"chunk {key.prefix[:12]}: K/V {tuple(keys.shape)} ({keys.dtype}) do not match the "
                         f"key's layout {layout}")
    tensors = {}
    for role, x in (("k", keys), ("v", values)):
        encoded = _codec(key.codec, role, keys.dtype).encode(x.detach().cpu())
        tensors |= {f"{role}.{name}": t.contiguous() for name, t in encoded.tensors.items()}
    metadata = {"format": FORMAT, "key": str(key), "xxh3_128": _digest(tensors)}
    return save_tensors(tensors, metadata)


def decode_chunk(data: bytes, key: ChunkKey, stages: dict[str, float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a chunk read back under ``key``; ``ChunkError`` unless the bytes are a
    whole chunk of that key with intact tensors. ``stages`` accumulates the seconds spent parsing,
    checking and decoding (``parse``, ``checksum``, ``decode``). An ``identity`` chunk's tensors are
    read-only views of ``data``, not copies: copy them before writing to them."""
    began = time.perf_counter()
    header = _header(data)
    metadata = header["__metadata__"]
    if metadata.get("format") != FORMAT:
        raise ChunkError(f"not a kvfactory chunk (format {metadata.get('format')!r}, expected {FORMAT!r})")
    if metadata.get("key") != str(key):
        raise ChunkError(f"chunk stored as {metadata.get('key')!r} read back as {str(key)!r}")
    tensors = _views(data, header, key)
    parsed = time.perf_counter()
    if _digest(tensors) != metadata.get("xxh3_128"):
        raise ChunkError(f"chunk {key.prefix[:12]}: checksum mismatch (corrupted in its tier)")
    checked = time.perf_counter()
    layout = _layout(key)
    dtype = DTYPES[layout.dtype]
    out = []
    for role in ("k", "v"):
        streams = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.startswith(f"{role}.")}
        try:
            if key.codec == "identity" and tuple(streams["data"].shape) == layout.shape \
                    and streams["data"].dtype == dtype:
                out.append(streams["data"])  # already what decoding would copy out
                continue
            x = torch.empty(layout.shape, dtype=dtype)
            _codec(key.codec, role, dtype).decode(Encoded(streams, layout.tokens), out=x)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise ChunkError(f"chunk {key.prefix[:12]}: tensors do not decode to {layout} ({exc})") from exc
        out.append(x)
    if stages is not None:
        for stage, seconds in (("parse", parsed - began), ("checksum", checked - parsed),
                               ("decode", time.perf_counter() - checked)):
            stages[stage] = stages.get(stage, 0.0) + seconds
    return out[0], out[1]


def _codec(name: str, role: str, dtype: torch.dtype):
    return make_codec(name, "key" if role == "k" else "value", dtype=dtype)


def _layout(key: ChunkKey) -> ChunkLayout:
    """The layout of the tensors stored under ``key``: a part holds only its layers."""
    try:
        sizes, dtype = key.layout.rsplit("-", 1)
        layers, heads, dim, tokens = (int(part[1:]) for part in sizes.split("-"))
    except ValueError as exc:
        raise ConfigError("layout", key.layout, "str(ChunkLayout), e.g. L30-H3-D64-T256-float32") from exc
    if key.layers is not None:
        first, end = key.layers
        if not 0 <= first < end <= layers:
            raise ChunkError(f"layers {first}-{end} of a chunk of {layers} layers")
        layers = end - first
    return ChunkLayout(layers, heads, dim, tokens, dtype)


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = xxhash.xxh3_128()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    return digest.hexdigest()


def _header(data: bytes) -> dict:
    """The header of a safetensors payload (an 8-byte little-endian length, then JSON), which must
    carry ``__metadata__``."""
    if len(data) < 8:
        raise ChunkError(f"chunk of {len(data)} bytes: too short for a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise ChunkError(f"chunk header of {length} bytes in a {len(data)}-byte value: truncated")
    try:
        header = json.loads(data[8:8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChunkError(f"chunk header is not JSON ({exc})") from exc
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ChunkError("chunk header has no metadata")
    return header


def _views(data: bytes, header: dict, key: ChunkKey) -> dict[str, torch.Tensor]:
    """The payload's tensors as read-only views of ``data`` (no copy: a chunk is tens of MB), each
    checked to lie inside the payload with as many bytes as its shape needs."""
    start = 8 + struct.unpack("<Q", data[:8])[0]
    tensors = {}
    with warnings.catch_warnings():  # the views are only read: bytes being immutable is fine
        warnings.simplefilter("ignore", UserWarning)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
                shape = [int(n) for n in entry["shape"]]
                begin, end = (int(n) for n in entry["data_offsets"])
                count = math.prod(shape)
                if not 0 <= begin <= end <= len(data) - start or end - begin != count * dtype.itemsize:
                    raise ValueError(f"offsets {begin}..{end} for {count} elements of {dtype}")
                view = torch.frombuffer(data, dtype=dtype, count=count, offset=start + begin) if count \
                    else torch.empty(0, dtype=dtype)
            except (KeyError, TypeError, ValueError) as exc:
                raise ChunkError(f"chunk {key.prefix[:12]}: unreadable tensor {name!r} ({exc})") from exc
            tensors[name] = view.view(shape)
    return tensors


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                       "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
