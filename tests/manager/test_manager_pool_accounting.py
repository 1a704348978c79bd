"""Pool accounting and prefix correctness under random use: a hypothesis state machine drives a
KVCacheManager through create (with prompts that share prefixes, and whose written tokens may differ
from the declared prompt), fork, appends on every layer (naming their tokens or not), free, pause
(whole or partial), resume and swap_out on a small bounded pool. After every step it checks that each
block's refcount equals the references held to it (block tables of live sequences, the prefix index),
that no block is both free and used, that every cached prefix block holds exactly the K/V its tokens
produce and that every live sequence holds its own tokens' K/V; closing the manager returns every
block. K/V are a fixed function of (layer, token id, position), so any mix-up shows."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from tiny_models import tiny_config

from kvfactory import CacheFullError, KVCacheManager, SequenceStateError
from kvfactory.hashing import block_hashes

PAGE = 4
CONFIG = tiny_config("llama")
HEADS, HEAD_DIM = CONFIG.num_key_value_heads, CONFIG.hidden_size // CONFIG.num_attention_heads
PROMPTS = [[7] * 9, [7] * 8 + [3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7] * 4 + [9] * 6]


def kv(layer: int, tokens: list[int], start: int) -> torch.Tensor:
    """The K (= V) that ``tokens`` at positions ``start...`` produce in ``layer``: ``[1, H, n, D]``."""
    ids = torch.tensor(tokens, dtype=torch.float32)[:, None]
    positions = torch.arange(start, start + len(tokens), dtype=torch.float32)[:, None]
    channels = torch.arange(HEADS * HEAD_DIM, dtype=torch.float32)[None]
    x = torch.sin(ids * 0.37 + positions * 0.011 * (layer + 1) + channels * 0.05)
    return x.view(len(tokens), HEADS, HEAD_DIM).transpose(0, 1)[None]


def block_tokens(tokens: list[int]) -> dict[bytes, tuple[int, list[int]]]:
    """Each full block's chained name -> (its index, its tokens)."""
    names = block_hashes(tokens, PAGE)
    return {name: (i, tokens[i * PAGE:(i + 1) * PAGE]) for i, name in enumerate(names)}


class PoolMachine(RuleBasedStateMachine):
    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(CONFIG, {"type": "paged", "page_size": PAGE, "pool_blocks": 24})
        self.names = 0
        self.tokens: dict[str, list[int]] = {}  # what each live sequence really holds, from token 0
        self.blocks: dict[bytes, tuple[int, list[int]]] = {}  # every full block ever written, by name

    def _append(self, seq_id: str, tokens: list[int], named: bool = True) -> None:
        cache = self.manager.get(seq_id)
        start = cache.get_seq_length()
        try:
            for layer in range(len(cache.layers)):
                k = kv(layer, tokens, start)
                cache.append(layer, k, k.clone(), torch.tensor([tokens]) if named else None)
        except CacheFullError:
            assert all(cache.size(i) == cache.size(0) for i in range(len(cache.layers)))  # all or nothing
            return
        self.tokens[seq_id] = self.tokens[seq_id] + tokens
        self.blocks.update(block_tokens(self.tokens[seq_id]))

    @rule(target=live, prompt=st.sampled_from(PROMPTS) | st.none(), written=st.sampled_from(PROMPTS))
    def create(self, prompt: list[int] | None, written: list[int]) -> str:
        """``written`` (another prompt, often) is what the sequence then really holds."""
        self.names += 1
        seq_id = f"s{self.names}"
        cache = self.manager.create(seq_id, prompt=prompt)
        cached = cache.get_seq_length()
        self.tokens[seq_id] = list(prompt[:cached]) if cached else []
        if prompt is not None and cached:
            self._append(seq_id, prompt[cached:])  # the prefill after the cached part
        else:
            self._append(seq_id, written)
        return seq_id

    @rule(seq_id=live, tokens=st.lists(st.integers(3, 9), min_size=1, max_size=9), named=st.booleans())
    def append(self, seq_id: str, tokens: list[int], named: bool) -> None:
        """Low-level appends on every layer; unnamed ones leave the cache's tokens unknown."""
        if not self.manager.is_paused(seq_id):
            self._append(seq_id, tokens, named)

    @rule(target=live, seq_id=live)
    def fork(self, seq_id: str) -> str:
        self.names += 1
        new_id = f"s{self.names}"
        if self.manager.is_paused(seq_id):
            self.manager.create(new_id)
            self.tokens[new_id] = []
        else:
            self.manager.fork(seq_id, new_id)
            self.tokens[new_id] = list(self.tokens[seq_id])
        return new_id

    @rule(seq_id=consumes(live))
    def free(self, seq_id: str) -> None:
        self.manager.free(seq_id)
        del self.tokens[seq_id]

    @rule(seq_id=live, blocks=st.none() | st.integers(1, 3))
    def pause(self, seq_id: str, blocks: int | None) -> None:
        paused = self.manager.is_paused(seq_id)
        try:
            self.manager.pause(seq_id, blocks=blocks)  # None: all; else a partial swap of the oldest pages
        except SequenceStateError:
            assert paused

    @rule(seq_id=live)
    def resume(self, seq_id: str) -> None:
        paused = self.manager.is_paused(seq_id)
        try:
            self.manager.resume(seq_id)
        except SequenceStateError:
            assert not paused
        except CacheFullError:
            assert self.manager.is_paused(seq_id)

    @rule(blocks=st.integers(1, 12))
    def swap_out(self, blocks: int) -> None:
        try:
            self.manager.swap_out(blocks)
        except CacheFullError:
            pass

    @invariant()
    def refcounts_equal_references(self) -> None:
        manager = self.manager
        for group, pool in enumerate(manager._pools()):  # the layers of a group share one block table
            held = Counter()
            for seq_id in manager.sequences():
                ids = manager.get(seq_id).layers[pool.layer_idx].store.held_blocks()
                if ids is not None:
                    held.update(ids.flatten().tolist())
            for entry in manager.index.entries.values():
                held[entry.ids[group]] += 1
            refcount = pool.refcount.tolist()
            assert {i: c for i, c in enumerate(refcount) if c} == dict(held), f"layers {pool.layers}"
            free = list(pool.free)
            assert len(free) == len(set(free)) and set(free) == {i for i, c in enumerate(refcount) if c == 0}

    @invariant()
    def the_free_queue_holds_exactly_the_cached_blocks_no_sequence_uses(self) -> None:
        """Unpinned entries whose blocks only the index references, each once, and nothing else."""
        pools, index = self.manager._pools(), self.manager.index
        idle = {name for name, entry in index.entries.items() if not entry.pinned and all(
            pool.refcount[block] == 1 for pool, block in zip(pools, entry.ids, strict=True))}
        assert set(index.free_queue) == idle
        for group, pool in enumerate(pools):
            assert set(pool.cached.nonzero()[0].tolist()) == {e.ids[group] for e in index.entries.values()}

    @invariant()
    def cached_blocks_hold_their_tokens_kv(self) -> None:
        """Every prefix-index entry names a block written with exactly those tokens at those positions."""
        pools = self.manager._pools()
        for name, entry in self.manager.index.entries.items():
            assert name in self.blocks, "a cached block under a name no written tokens have"
            index, tokens = self.blocks[name]
            for pool, block in zip(pools, entry.ids, strict=True):
                for layer in pool.layers:  # a block holds a page of every layer of its group
                    expected, blocks = kv(layer, tokens, index * PAGE)[0], pool.layer(layer)
                    assert torch.equal(blocks.k[:, block], expected)
                    assert torch.equal(blocks.v[:, block], expected)

    @invariant()
    def live_sequences_hold_their_own_kv(self) -> None:
        for seq_id, tokens in self.tokens.items():
            cache = self.manager.get(seq_id)
            if self.manager.is_paused(seq_id) and cache.size() == 0 or not tokens:
                continue
            stored = cache.size()
            for layer in range(len(cache.layers)):
                keys, values = cache.gather(layer)
                expected = kv(layer, tokens, 0)[:, :, len(tokens) - stored:]
                assert torch.equal(keys, expected) and torch.equal(values, expected), (seq_id, layer)

    def teardown(self) -> None:
        self.manager.close()
        for pool in self.manager._pools():
            assert len(pool.free) == pool.num_blocks and not pool.refcount.any()


PoolMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPoolAccounting = PoolMachine.TestCase
