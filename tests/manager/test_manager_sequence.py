"""The manager's sequence records: status transitions (legal and illegal), ``stats()`` only reading,
prompt blocks hashed when they fill, and the one eviction-ordered queue of cached free blocks."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import generate
from tiny_models import random_prompt, tiny_model

from kvfactory import KVCacheManager, SequenceStateError
from kvfactory.manager import Sequence, SequenceStatus
from kvfactory.manager.prefix import block_hashes
from kvfactory.manager.sequence import ACTIONS, TRANSITIONS

PAGE = 4
S = SequenceStatus


def manager_for(model, **options) -> KVCacheManager:
    return KVCacheManager(model.config, {"type": "paged", "page_size": PAGE} | options)


def prefill(model, cache, ids: torch.Tensor) -> None:
    generate(model, {"input_ids": ids}, cache, max_new_tokens=1, min_new_tokens=1)


def test_the_transition_table_is_the_documented_lifecycle() -> None:
    assert TRANSITIONS == {(S.WAITING, S.RUNNING), (S.WAITING, S.PAUSED), (S.RUNNING, S.PAUSED),
                           (S.PAUSED, S.PREFETCHING), (S.PAUSED, S.RUNNING), (S.PREFETCHING, S.RUNNING),
                           (S.WAITING, S.FINISHED), (S.RUNNING, S.FINISHED), (S.PAUSED, S.FINISHED),
                           (S.PREFETCHING, S.FINISHED)}
    assert not any(start is S.FINISHED for start, _ in TRANSITIONS)  # a freed sequence stays freed


@pytest.mark.parametrize(("action", "status"), [(action, status) for action, (starts, _) in ACTIONS.items()
                                                for status in S if status not in starts])
def test_an_illegal_transition_raises_naming_the_states_and_changes_nothing(action: str,
                                                                             status: SequenceStatus) -> None:
    record = Sequence("a", cache=None, status=status)
    with pytest.raises(SequenceStateError) as err:
        record.move(action)
    message = str(err.value)
    assert f"{action}('a')" in message and f"is {status.value}, not " in message
    assert all(start.value in message for start in ACTIONS[action][0])
    assert record.status is status


@pytest.mark.parametrize(("action", "start"), [(action, start) for action, (starts, _) in ACTIONS.items()
                                               for start in starts])
def test_a_legal_transition_moves_to_the_actions_status(action: str, start: SequenceStatus) -> None:
    record = Sequence("a", cache=None, status=start)
    record.move(action)
    assert record.status is ACTIONS[action][1]


def test_a_managed_sequence_goes_through_every_status() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    cache = manager.create("a")
    record = manager.record("a")
    assert record.status is S.WAITING and record.cache is cache and cache.hooks is record
    prefill(model, cache, random_prompt(10))
    assert record.status is S.RUNNING
    manager.pause("a")
    assert record.status is S.PAUSED and record.host is not None and manager.is_paused("a")
    manager.prefetch("a")
    assert record.status is S.PREFETCHING and record.prefetch is not None and manager.is_paused("a")
    manager.resume("a")
    assert record.status is S.RUNNING and record.host is None and record.prefetch is None
    assert manager.fork("a", "b") is manager.record("b").cache and manager.record("b").status is S.RUNNING
    manager.free("a")
    assert record.status is S.FINISHED and cache.hooks is None and "a" not in manager
    prefill(model, cache, random_prompt(5))  # a freed cache is a plain cache again, as before
    assert cache.get_seq_length() == 5
    manager.close()


def test_manager_calls_out_of_order_name_the_sequences_status() -> None:
    model = tiny_model("llama")
    manager = manager_for(model)
    prefill(model, manager.create("a"), random_prompt(10))
    manager.create("w")
    with pytest.raises(SequenceStateError, match=r"resume\('a'\): sequence 'a' is running, not paused or "
                                                 r"prefetching"):
        manager.resume("a")
    with pytest.raises(SequenceStateError, match=r"prefetch\('w'\): sequence 'w' is waiting, not paused"):
        manager.prefetch("w")
    manager.pause("a")
    for call, name in ((lambda: manager.pause("a"), "pause"), (lambda: manager.fork("a", "c"), "fork"),
                       (lambda: manager.mark_as_shareable("a"), "mark_as_shareable")):
        with pytest.raises(SequenceStateError, match=rf"{name}\('a'\): sequence 'a' is paused, not waiting "
                                                     r"or running: resume it first"):
            call()
    assert manager.record("a").status is S.PAUSED and manager.sequences() == ["a", "w"]
    assert manager.record("w").status is S.WAITING


def snapshot(manager: KVCacheManager) -> dict:
    """Everything ``stats()`` could change: the index, its queue, the pools, the records, the counters."""
    index = manager.index
    return copy.deepcopy({
        "entries": {name: vars(entry) for name, entry in index.entries.items()},
        "queue": list(index.free_queue),
        "index_counts": (index.hit_blocks, index.missed_blocks, index.lookups, index.evicted),
        "pools": [(p.refcount.tolist(), list(p.free), p.cached.tolist())
                  for p in manager.pool.block_pools(None)],
        "records": {seq_id: (r.status, r.prompt_tokens, r.cached_tokens, r.hashed_tokens, r.last_used,
                             r.host is None, r.cache.written_tokens())
                    for seq_id, r in ((s, manager.record(s)) for s in manager.sequences())},
        "counters": vars(manager.counters),
    })


def test_stats_only_reads_and_prompt_blocks_are_cached_when_they_fill() -> None:
    model = tiny_model("llama")
    manager = manager_for(model, pool_blocks=40)
    system = random_prompt(13, seed=1)
    prompts = [torch.cat([system, random_prompt(6, seed=s)], 1) for s in (2, 3)]
    prefill(model, manager.create("a", prompt=prompts[0][0]), prompts[0])
    assert len(manager.index) == 4  # 18 prompt tokens to cache: 4 full blocks, before any stats()
    assert manager.record("a").hashed_tokens == 16
    prefill(model, manager.create("b", prompt=prompts[1][0]), prompts[1])
    manager.create("c", prompt=prompts[0][0])
    manager.pause("b", blocks=2)
    manager.free("a")
    before = snapshot(manager)
    first, second = manager.stats(), manager.stats()
    assert snapshot(manager) == before
    assert {k: v for k, v in first.items() if k != "prefix_hit_rate"} == \
           {k: v for k, v in second.items() if k != "prefix_hit_rate"}
    assert first["prefix_cached_blocks"] == 4 + 1 and first["paused"] == 1  # b added its 4th block only


def test_cached_free_blocks_wait_in_one_queue_in_release_order_and_are_evicted_from_its_head() -> None:
    model = tiny_model("llama")
    manager = manager_for(model, pool_blocks=8)
    a, b = random_prompt(9, seed=1), random_prompt(9, seed=2)  # 8 tokens to cache each: 2 blocks
    names = {key: block_hashes(ids[0, :8].tolist(), PAGE) for key, ids in (("a", a), ("b", b))}
    prefill(model, manager.create("a", prompt=a[0]), a)
    prefill(model, manager.create("b", prompt=b[0]), b)
    assert len(manager.index) == 4 and not manager.index.free_queue  # in use: not evictable
    manager.free("b")
    manager.free("a")
    a0, a1 = names["a"]
    b0, b1 = names["b"]
    assert list(manager.index.free_queue) == [b1, b0, a1, a0]  # released first, a chain's tail first
    manager.create("c", prompt=a[0])  # a prefix hit takes a's blocks out of the queue
    assert manager.cached_tokens("c") == 8 and list(manager.index.free_queue) == [b1, b0]
    assert manager.stats()["pool_blocks_free"] == 4  # a block holds a page of every layer
    d = manager.create("d")
    config = model.config
    shape = (1, config.num_key_value_heads, 17, config.hidden_size // config.num_attention_heads)
    for layer in range(config.num_hidden_layers):  # 5 blocks: the pool evicts the queue's head, b's tail
        d.append(layer, torch.randn(shape), torch.randn(shape))
    assert list(manager.index.free_queue) == [b0] and b1 not in manager.index.entries
    assert manager.stats()["prefix_evicted_blocks"] == 1
    manager.free("c")
    assert list(manager.index.free_queue) == [b0, a1, a0]
    assert manager.pin_prefix(a[0, :8]) == 2 and list(manager.index.free_queue) == [b0]  # pinned: never
    manager.close()
    assert all(not p.refcount.any() and not p.cached.any() for p in manager.pool.block_pools(None))


def test_a_sliding_layers_past_blocks_are_reclaimed_first_and_a_hit_needs_only_its_window() -> None:
    """Gemma 3's layout (a sliding layer of window 8, then a full-attention layer): while a sequence
    runs, the prompt blocks its sliding layer gave back stay cached but wait in ``window_queue`` and
    are given back first (a chain's tail first); a later prompt then starts from the longest prefix
    whose last window the sliding layer still has, and answers as without the cache."""
    from helpers import greedy_tokens

    model = tiny_model("gemma3")
    manager = manager_for(model, pool_blocks=64)
    a = random_prompt(25, seed=1)  # 24 tokens to cache: 6 blocks
    names = block_hashes(a[0, :24].tolist(), PAGE)
    prefill(model, manager.create("a", prompt=a[0]), a)  # 25 tokens seen: the window holds from token 18
    index = manager.index
    assert len(index) == 6 and all(min(index.entries[name].ids) >= 0 for name in names)
    assert list(index.window_queue) == [(names[i], 1) for i in (3, 2, 1, 0)] and not index.free_queue
    stats = manager.stats()
    assert stats["pool_blocks_used"] - stats["pool_blocks_held"] == index.idle_blocks == 4
    assert manager._reclaim() and index.entries[names[3]].ids[0] == -1  # the sliding layer's block only
    assert index.entries[names[3]].ids[1] >= 0 and len(index) == 6
    b = torch.cat([a[:, :16], random_prompt(5, seed=2)], 1)  # shares 4 blocks; block 3's window is gone
    cache = manager.create("b", prompt=b[0])
    assert manager.cached_tokens("b") == 12  # the hit of 3 blocks needs sliding blocks 1 and 2
    assert cache.layers[0].store.size() == 7 and cache.layers[1].store.size() == 12
    assert generate(model, {"input_ids": b}, cache, max_new_tokens=4).sequences[0, -4:].tolist() == \
        greedy_tokens(model, b[0].tolist(), 4)
    manager.free("a")
    manager.free("b")
    assert not index.window_queue and set(index.free_queue) >= set(names)
    manager.close()
    assert all(not p.refcount.any() and not p.cached.any() for p in manager.pool.block_pools(None))


def test_a_window_written_back_after_a_pause_is_never_named_from_token_0() -> None:
    """A sliding layer paused and resumed holds its window from the store's first slot: its blocks
    are not offered to the prefix cache as the sequence's first ones (8 tokens seen, 7 held in 2
    blocks, as many as 8 tokens from token 0 would take)."""
    model = tiny_model("gemma3")
    manager = manager_for(model, pool_blocks=64)
    prompt = random_prompt(8, seed=3)
    cache = manager.create("a", prompt=prompt[0])
    prefill(model, cache, prompt)
    assert cache.prefix_blocks() is not None  # the sliding layer gave token 0 back, still in its block
    manager.pause("a")
    manager.resume("a")
    assert cache.layers[0].store.size() == 7 and cache.prefix_blocks() is None
