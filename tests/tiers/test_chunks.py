"""Chunks as tier values: exact through the identity codec, measured loss and bytes through int8,
fp8 and int4, keys that separate models, layouts, codecs and prefixes, and every damaged or
misplaced value refused rather than loaded; the package imports without transformers."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch

from kvfactory.errors import ConfigError, ShapeError
from kvfactory.tiers import ChunkError, ChunkKey, ChunkLayout, chunk_keys, decode_chunk, encode_chunk

LAYOUT = ChunkLayout(layers=3, kv_heads=2, head_dim=64, tokens=64)
MODEL = "model-a"


def kv(layout: ChunkLayout = LAYOUT, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(layout.shape, generator=gen).to(dtype) for _ in range(2))


def key_for(codec: str, layout: ChunkLayout = LAYOUT) -> ChunkKey:
    return chunk_keys(list(range(layout.tokens)), MODEL, layout, codec)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_identity_chunks_are_exact(dtype: str) -> None:
    layout = ChunkLayout(3, 2, 64, 64, dtype)
    keys, values = kv(layout, getattr(torch, dtype))
    key = key_for("identity", layout)
    got_keys, got_values = decode_chunk(encode_chunk(key, keys, values), key)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


@pytest.mark.parametrize("codec", ["identity", "int8"])
def test_decoding_reports_its_stages(codec: str) -> None:
    key = key_for(codec)
    stages = {"parse": 1.0}  # accumulated onto what the caller already counted
    decode_chunk(encode_chunk(key, *kv()), key, stages)
    assert set(stages) == {"parse", "checksum", "decode"} and stages["parse"] > 1.0
    assert all(seconds > 0 for seconds in stages.values())


@pytest.mark.parametrize(("codec", "max_error", "max_bytes"), [("int8", 1e-3, 0.30), ("fp8", 1e-2, 0.30),
                                                               ("int4", 5e-2, 0.20)])
def test_compressed_chunks_bound_their_loss_and_bytes(codec: str, max_error: float, max_bytes: float) -> None:
    keys, values = kv()
    exact = len(encode_chunk(key_for("identity"), keys, values))
    data = encode_chunk(key_for(codec), keys, values)
    got_keys, got_values = decode_chunk(data, key_for(codec))
    for got, want in ((got_keys, keys), (got_values, values)):
        assert ((got - want).square().sum() / want.square().sum()).item() < max_error
    assert len(data) / exact < max_bytes


def test_keys_separate_models_layouts_codecs_and_prefixes() -> None:
    tokens = list(range(200))
    keys = chunk_keys(tokens, MODEL, LAYOUT, "identity")
    assert len(keys) == 3  # the last 8 tokens make no whole chunk
    assert chunk_keys(tokens[:128], MODEL, LAYOUT, "identity") == keys[:2]
    changed = chunk_keys([7, *tokens[1:]], MODEL, LAYOUT, "identity")
    assert all(a != b for a, b in zip(keys, changed, strict=True))  # a chunk's key names its whole prefix
    others = [chunk_keys(tokens, "model-b", LAYOUT, "identity")[0],
              chunk_keys(tokens, MODEL, LAYOUT, "int8")[0],
              chunk_keys(tokens, MODEL, ChunkLayout(3, 2, 64, 64, "float16"), "identity")[0]]
    assert len({str(keys[0]), *map(str, others)}) == 4
    with pytest.raises(ConfigError, match="codec"):
        chunk_keys(tokens, MODEL, LAYOUT, "int3")


def test_damaged_or_misplaced_chunks_are_refused() -> None:
    keys, values = kv()
    key = key_for("int8")
    data = encode_chunk(key, keys, values)
    other = chunk_keys(list(range(1, 65)), MODEL, LAYOUT, "int8")[0]
    with pytest.raises(ChunkError, match="read back as"):
        decode_chunk(data, other)
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    with pytest.raises(ChunkError, match="checksum"):
        decode_chunk(bytes(flipped), key)
    for broken in (data[:len(data) // 2], data[:5], b"\xff" * 64):
        with pytest.raises(ChunkError):
            decode_chunk(broken, key)
    length = struct.unpack("<Q", data[:8])[0]
    header, payload = json.loads(data[8:8 + length]), data[8 + length:]
    for name, entry in [("k.codes", {"data_offsets": [0, 10**9]}), ("k.codes", {"shape": [7]}),
                        ("v.scale", {"dtype": "X9"})]:  # offsets past the payload, a wrong size, no dtype
        bad = json.dumps({**header, name: {**header[name], **entry}}).encode()
        with pytest.raises(ChunkError, match="unreadable tensor"):
            decode_chunk(struct.pack("<Q", len(bad)) + bad + payload, key)


def test_chunks_of_the_wrong_shape_are_not_written() -> None:
    keys, values = kv()
    with pytest.raises(ShapeError, match="layout"):
        encode_chunk(key_for("identity"), keys[:, :, :32], values[:, :, :32])
    with pytest.raises(ShapeError):
        encode_chunk(key_for("identity"), keys, values.half())


def test_tiers_and_codecs_import_without_transformers() -> None:
    """vLLM's virtualenv pins another transformers: the connector's side of kvfactory never imports it."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import kvfactory.tiers, kvfactory.codecs\n"
            "assert 'kvfactory.cache' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
