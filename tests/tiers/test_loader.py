"""``LayerwiseLoad``: chunks stored as layer parts are read part by part, each layer usable once its
part is placed and not before; a missing or corrupted part fails its chunk alone (the corrupted
value discarded, the chunk's later parts not read); a fault of the caller fails every chunk and
never leaves a waiter hanging."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvfactory.errors import ConfigError
from kvfactory.tiers import (
    ChunkKey,
    ChunkLayout,
    HostTier,
    LayerwiseLoad,
    chunk_keys,
    encode_chunk,
    layer_parts,
)

LAYOUT = ChunkLayout(layers=6, kv_heads=2, head_dim=16, tokens=32)
PARTS = layer_parts(LAYOUT.layers, 3)


class GatedTier(HostTier):
    """A host tier whose reads each wait for one ``gate.release()``, and that counts them."""

    def __init__(self) -> None:
        super().__init__(1 << 24)
        self.gate = threading.Semaphore(0)
        self.reads: list[list[str]] = []

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        assert self.gate.acquire(timeout=30)
        self.reads.append(keys)
        return super()._get_many(keys)


KV = dict[ChunkKey, tuple[torch.Tensor, ...]]


def stored(tier: HostTier, chunks: int = 2) -> tuple[list[ChunkKey], KV]:
    """``chunks`` chunks of random K/V stored in ``tier`` as ``PARTS``."""
    keys = chunk_keys(list(range(chunks * LAYOUT.tokens)), "model", LAYOUT, "identity")
    kv = {}
    for i, key in enumerate(keys):
        gen = torch.Generator().manual_seed(i)
        kv[key] = tuple(torch.randn(LAYOUT.shape, generator=gen) for _ in range(2))
        tier.put_many([(str(key.part(a, b)), encode_chunk(key.part(a, b), kv[key][0][a:b], kv[key][1][a:b]))
                       for a, b in PARTS])
    return keys, kv


def test_layer_parts_cover_the_layers_in_order() -> None:
    assert layer_parts(30, 4) == [(0, 7), (7, 15), (15, 22), (22, 30)]
    assert layer_parts(3, 1) == [(0, 3)]
    with pytest.raises(ConfigError, match="layer_parts"):
        layer_parts(3, 4)


def test_each_layer_waits_for_its_own_part_only() -> None:
    tier = GatedTier()
    keys, kv = stored(tier)
    placed: list[tuple[ChunkKey, int]] = []
    got = {key: [torch.zeros(LAYOUT.shape) for _ in range(2)] for key in keys}

    def place(key: ChunkKey, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        got[key][0][first:first + len(k)] = k
        got[key][1][first:first + len(v)] = v
        placed.append((key, first))

    with ThreadPoolExecutor(1) as executor:
        load = LayerwiseLoad(tier, keys, PARTS, place, executor)
        assert not load.wait(0, timeout=0.05)  # nothing read yet
        tier.gate.release()
        assert load.wait(0, timeout=30) and load.wait(PARTS[0][1] - 1, timeout=0)
        assert not load.wait(PARTS[1][0], timeout=0.05)  # the second part is still held back
        assert placed == [(key, 0) for key in keys]
        for _ in PARTS[1:]:
            tier.gate.release()
        load.join()
    assert tier.reads == [[str(key.part(a, b)) for key in keys] for a, b in PARTS]  # one batch per part
    assert placed == [(key, a) for a, _ in PARTS for key in keys] and not load.failed
    assert all(torch.equal(got[key][i], kv[key][i]) for key in keys for i in range(2))
    assert load.bytes > 2 * 2 * LAYOUT.layers * 2 * 32 * 16 * 4 and set(load.stages) >= {"transfer", "copy",
                                                                                       "checksum"}


def test_a_missing_or_corrupted_part_fails_its_chunk_alone() -> None:
    tier = HostTier(1 << 24)
    keys, _ = stored(tier, chunks=3)
    missing, corrupted = keys[0].part(*PARTS[1]), keys[1].part(*PARTS[0])
    tier.discard_many([str(missing)])
    tier.put(str(corrupted), tier.get(str(corrupted))[:-100])
    placed: list[tuple[ChunkKey, int]] = []
    with ThreadPoolExecutor(1) as executor:
        load = LayerwiseLoad(tier, keys, PARTS, lambda key, first, *_: placed.append((key, first)), executor)
        load.join()
    assert set(load.failed) == {keys[0], keys[1]}
    assert "no longer in the tiers" in str(load.failed[keys[0]]) and "unreadable" in str(load.failed[keys[1]])
    assert placed == [(keys[0], 0), (keys[2], 0), (keys[2], PARTS[1][0]), (keys[2], PARTS[2][0])]
    assert str(corrupted) not in tier._items  # discarded, so that it is stored anew
    assert str(keys[1].part(*PARTS[1])) in tier._items  # a failed chunk's later parts: not read, kept


def test_a_fault_while_placing_fails_every_chunk_and_frees_every_waiter() -> None:
    tier = HostTier(1 << 24)
    keys, _ = stored(tier)

    def place(key: ChunkKey, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise RuntimeError("blocks out of range")

    with ThreadPoolExecutor(1) as executor:
        load = LayerwiseLoad(tier, keys, PARTS, place, executor)
        assert load.wait(LAYOUT.layers - 1, timeout=30)
        load.join()
    assert set(load.failed) == set(keys) and "blocks out of range" in str(load.failed[keys[0]])
