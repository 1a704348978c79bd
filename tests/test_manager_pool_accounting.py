"""Pool accounting under random use: a hypothesis state machine drives a KVCacheManager through create
(with prompts that share prefixes), fork, append, free, pause (whole or partial), resume and
swap_out on a small bounded pool, and checks after every step that each block's refcount equals the
references held to it (block tables of live sequences, the prefix index) and that no block is both
free and used; closing the manager returns every block."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from tiny_models import tiny_config

from kvfactory import CacheFullError, KVCacheManager, SequenceStateError

PAGE = 4
CONFIG = tiny_config("llama")
HEADS, HEAD_DIM = CONFIG.num_key_value_heads, CONFIG.hidden_size // CONFIG.num_attention_heads
PROMPTS = [[7] * 9, [7] * 8 + [3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7] * 4 + [9] * 6]


def kv(tokens: int) -> torch.Tensor:
    return torch.randn(1, HEADS, tokens, HEAD_DIM)


class PoolMachine(RuleBasedStateMachine):
    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(CONFIG, {"type": "paged", "page_size": PAGE, "pool_blocks": 24})
        self.names = 0

    def _append(self, seq_id: str, tokens: int) -> None:
        cache = self.manager.get(seq_id)
        try:
            for layer in range(len(cache.layers)):
                cache.append(layer, kv(tokens), kv(tokens))
        except CacheFullError:
            assert all(cache.size(i) == cache.size(0) for i in range(len(cache.layers)))  # all or nothing

    @rule(target=live, prompt=st.sampled_from(PROMPTS) | st.none())
    def create(self, prompt: list[int] | None) -> str:
        self.names += 1
        seq_id = f"s{self.names}"
        cache = self.manager.create(seq_id, prompt=prompt)
        if prompt is not None:
            self._append(seq_id, len(prompt) - cache.get_seq_length())  # the prefill after the cached part
        return seq_id

    @rule(seq_id=live, tokens=st.integers(1, 9))
    def append(self, seq_id: str, tokens: int) -> None:
        if not self.manager.is_paused(seq_id):
            self._append(seq_id, tokens)

    @rule(target=live, seq_id=live)
    def fork(self, seq_id: str) -> str:
        self.names += 1
        new_id = f"s{self.names}"
        if self.manager.is_paused(seq_id):
            self.manager.create(new_id)
        else:
            self.manager.fork(seq_id, new_id)
        return new_id

    @rule(seq_id=consumes(live))
    def free(self, seq_id: str) -> None:
        self.manager.free(seq_id)

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
        for layer, pool in enumerate(manager._pools()):
            held = Counter()
            for seq_id in manager.sequences():
                ids = manager.get(seq_id).layers[layer].store.block_ids()
                if ids is not None:
                    held.update(ids.flatten().tolist())
            for entry in manager.index.entries.values():
                held[entry.ids[layer]] += 1
            refcount = pool.refcount.tolist()
            assert {i: c for i, c in enumerate(refcount) if c} == dict(held), f"layer {layer}"
            free = list(pool.free)
            assert len(free) == len(set(free)) and set(free) == {i for i, c in enumerate(refcount) if c == 0}

    def teardown(self) -> None:
        self.manager.close()
        for pool in self.manager._pools():
            assert len(pool.free) == pool.num_blocks and not pool.refcount.any()


PoolMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPoolAccounting = PoolMachine.TestCase
