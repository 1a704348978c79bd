"""Eviction policies (the ``eviction`` strategy): one shared matrix over every registered policy,
plus each method's scores against a direct computation from its paper's definition."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_generation, attn_implementation, generate
from tiny_models import left_padded_batch, random_prompt, tiny_config, tiny_model
from transformers import DynamicCache

from kvfactory import ConfigError, KVCacheFactory, Policy, register_policy
from kvfactory.eviction import POLICIES, Observation
from kvfactory.eviction.h2o import H2OPolicy
from kvfactory.eviction.knorm import KnormPolicy
from kvfactory.eviction.snapkv import SnapKVPolicy
from kvfactory.eviction.spec import EvictionSpec
from kvfactory.eviction.store import EvictionStore
from kvfactory.eviction.tova import TOVAPolicy
from kvfactory.eviction.window import WindowPolicy
from kvfactory.prefill import prefill_in_chunks
from kvfactory.storage import DenseStore

STORAGES = {"dense": {"name": "dense"}, "paged": {"name": "paged", "page_size": 4},
            "dense+int8": {"name": "dense"}, "paged+int4": {"name": "paged", "page_size": 4}}
CODECS = {"dense+int8": {"codec": "int8"}, "paged+int4": {"codec": "int4", "residual": 8, "group_size": 8}}
SMALL_WINDOWS = {"snapkv": {"window_size": 4}, "pyramidkv": {"window_size": 4, "beta": 2}}
DECODING = sorted(name for name, cls in POLICIES.items() if cls.decodes)
PROMPT = 40


def evicting(policy: str, storage: str = "dense", **options) -> dict:
    strategies = [STORAGES[storage]]
    if storage in CODECS:
        strategies.append({"name": "quantized", **CODECS[storage]})
    options = SMALL_WINDOWS.get(policy, {}) | options
    entry = {"name": "eviction", "policy": policy, **options}
    return {"type": "composite", "strategies": [*strategies, entry]}


def llama():
    return tiny_model("llama")


@pytest.mark.parametrize(("entry", "key"), [
    ({"policy": "nope", "budget": 8}, "strategies[1].policy"),
    ({"policy": "h2o"}, "strategies[1].compression_ratio"),
    ({"policy": "h2o", "budget": 8, "compression_ratio": 0.5}, "strategies[1].compression_ratio"),
    ({"policy": "h2o", "compression_ratio": 1.0}, "strategies[1].compression_ratio"),
    ({"policy": "h2o", "budget": 0}, "strategies[1].budget"),
    ({"policy": "h2o", "budget": [4, "x"]}, "strategies[1].budget"),
    ({"policy": "h2o", "budget": 8, "window_size": 4}, "strategies[1].window_size"),
    ({"policy": "snapkv", "budget": 8, "window_size": "4"}, "strategies[1].window_size"),
    ({"policy": "snapkv", "budget": 8, "kernel_size": 4}, "strategies[1].kernel_size"),
    ({"policy": "h2o", "budget": 8, "recent_fraction": 1.5}, "strategies[1].recent_fraction"),
    ({"policy": "streaming_llm", "budget": 8, "n_sink": -1}, "strategies[1].n_sink"),
    ({"policy": "streaming_llm", "budget": 4}, "strategies[1].n_sink"),  # 4 sinks by default
    ({"policy": "window", "budget": [16, 8], "n_sink": 8}, "strategies[1].n_sink"),
    ({"policy": "h2o", "budget": 8, "slack": -1}, "strategies[1].slack"),
])
def test_invalid_eviction_configs_name_the_key(entry: dict, key: str) -> None:
    config = {"type": "composite", "strategies": [{"name": "dense"}, {"name": "eviction", **entry}]}
    with pytest.raises(ConfigError) as err:
        KVCacheFactory(tiny_config("llama"), config)
    assert err.value.key == key


def test_sinks_leave_room_for_a_recent_token_in_the_budget() -> None:
    config = evicting("window", budget=[16, 8], n_sink=9)
    with pytest.raises(ConfigError) as err:
        KVCacheFactory(tiny_config("llama"), config)
    assert (err.value.key, err.value.value) == ("strategies[1].n_sink", 9)
    assert "fewer than budget=8" in str(err.value), str(err.value)
    KVCacheFactory(tiny_config("llama"), evicting("window", budget=[16, 8], n_sink=7))  # one recent token
    KVCacheFactory(tiny_config("llama"), evicting("streaming_llm", compression_ratio=0.99))  # no budget


def test_a_budget_list_needs_one_budget_per_layer() -> None:
    model = llama()
    with attn_implementation(model, "kvfactory"):
        factory = KVCacheFactory(model.config, evicting("h2o", budget=[8, 8, 8]))
        with pytest.raises(ConfigError, match="one budget per layer: 2"):
            model(random_prompt(12), past_key_values=factory.create_cache())


def test_a_model_switched_away_from_kvfactory_attention_is_refused_before_any_write() -> None:
    model = llama()  # SDPA: create_cache switches it to kvfactory's attention
    with attn_implementation(model, "sdpa"):
        cache = KVCacheFactory(model.config, evicting("h2o", budget=8)).create_cache()
        assert model.config._attn_implementation == "kvfactory"
        model.set_attn_implementation("sdpa")
        with pytest.raises(ConfigError, match="attn_implementation"):
            model(random_prompt(12), past_key_values=cache)
    assert cache.get_seq_length() == 0 and cache.size(0) == 0


def test_compression_ratio_zero_is_lossless() -> None:
    model, inputs = llama(), {"input_ids": random_prompt(PROMPT)}
    ref = generate(model, inputs, DynamicCache(config=model.config))
    for policy in sorted(POLICIES):
        with attn_implementation(model, "kvfactory"):
            cache = KVCacheFactory(model.config, evicting(policy, compression_ratio=0.0)).create_cache()
            out = generate(model, inputs, cache)
        assert_same_generation(ref, out)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_prefill_compression_keeps_the_ratio_and_frees_memory(policy: str, storage: str) -> None:
    """After a compressed prefill every layer holds its budget (the same in every head), positions
    count every token seen, and the memory of evicted tokens is gone."""
    model = llama()
    with attn_implementation(model, "kvfactory"), torch.no_grad():
        full = KVCacheFactory(model.config, {"type": "dense"}).create_cache()
        model(random_prompt(PROMPT), past_key_values=full)
        factory = KVCacheFactory(model.config, evicting(policy, storage, compression_ratio=0.5))
        cache = factory.create_cache()
        model(random_prompt(PROMPT), past_key_values=cache)
    kept = [cache.size(i) for i in range(len(cache.layers))]
    if policy == "pyramidkv":  # budgets fall with depth around the target
        assert kept[0] > kept[1] and sum(kept) == pytest.approx(2 * PROMPT // 2, abs=1)
    else:
        assert kept == [PROMPT // 2] * len(kept)
    assert cache.get_seq_length() == PROMPT
    report = cache.memory_report()
    assert report["tokens_stored"] == sum(kept)
    if storage == "dense":
        assert report["allocated"] <= full.memory_report()["allocated"] * (max(kept) + 16) / (PROMPT + 16)
    if storage == "paged":  # emptied blocks went back to the pool
        pools, free = factory.pool.layers, factory.pool.free_blocks()
        assert [pools[i].num_blocks - free[i] for i in range(len(kept))] == [-(-k // 4) for k in kept]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_dense_and_paged_evict_the_same_tokens(policy: str) -> None:
    model, inputs = llama(), {"input_ids": random_prompt(PROMPT, seed=3)}
    outs = []
    with attn_implementation(model, "kvfactory"):
        for storage in ("dense", "paged"):
            config = evicting(policy, storage, budget=16, slack=3)
            outs.append(generate(model, inputs, KVCacheFactory(model.config, config).create_cache(),
                                 max_new_tokens=12))
    assert_same_generation(outs[0], outs[1])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_kept_tokens_keep_their_positions(policy: str) -> None:
    """The step after a compression equals a DynamicCache holding exactly the kept K/V, fed the
    true position: nothing stored was re-rotated or shifted."""
    model = llama()
    prompt = random_prompt(PROMPT, seed=5)
    with attn_implementation(model, "kvfactory"), torch.no_grad():
        cache = KVCacheFactory(model.config, evicting(policy, compression_ratio=0.75)).create_cache()
        model(prompt, past_key_values=cache)
        kept = [cache.gather(i) for i in range(len(cache.layers))]
        step = torch.tensor([[7]])
        ours = model(step, past_key_values=cache).logits
    reference = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(kept):
        reference.update(k, v, i)
    with torch.no_grad():
        theirs = model(step, past_key_values=reference, position_ids=torch.tensor([[PROMPT]]),
                       cache_position=torch.tensor([kept[0][0].shape[2]])).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy", DECODING)
@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_a_budget_bounds_decode(policy: str, storage: str) -> None:
    model = llama()
    budget, slack = 12, 4
    with attn_implementation(model, "kvfactory"), torch.no_grad():
        config = evicting(policy, storage, budget=budget, slack=slack)
        cache = KVCacheFactory(model.config, config).create_cache()
        out = model(random_prompt(20), past_key_values=cache)
        sizes = []
        for _ in range(30):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
            sizes.append(cache.size(0))
    assert max(sizes) <= budget + slack and min(sizes) >= budget
    assert cache.get_seq_length() == 50
    assert cache.memory_report()["tokens_stored"] <= 2 * (budget + slack)


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - set(DECODING)))
def test_prefill_only_policies_let_decode_grow(policy: str) -> None:
    model = llama()
    with attn_implementation(model, "kvfactory"), torch.no_grad():
        cache = KVCacheFactory(model.config, evicting(policy, budget=12)).create_cache()
        out = model(random_prompt(20), past_key_values=cache)
        after_prefill = [cache.size(i) for i in range(2)]
        for _ in range(9):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    assert sum(after_prefill) <= 2 * 12  # PyramidKV: 12 per layer on average
    assert [cache.size(i) for i in range(2)] == [n + 9 for n in after_prefill]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_ratio_compression_stops_at_end_prefill(policy: str) -> None:
    """kvpress's pipeline: the context is compressed, the question that follows is kept whole (and
    attends with a mask of each layer's own length: PyramidKV's layers keep different counts)."""
    model = llama()
    with attn_implementation(model, "kvfactory"), torch.no_grad():
        cache = KVCacheFactory(model.config, evicting(policy, compression_ratio=0.5)).create_cache()
        model(random_prompt(PROMPT), past_key_values=cache)
        kept = [cache.size(i) for i in range(2)]
        cache.end_prefill()
        out = model(random_prompt(6, seed=9), past_key_values=cache)
        model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    assert [cache.size(i) for i in range(2)] == [n + 7 for n in kept]
    assert cache.get_seq_length() == PROMPT + 7


def test_chunks_are_compressed_to_the_budget_as_they_arrive() -> None:
    model = llama()
    budget, chunk = 10, 8
    with attn_implementation(model, "kvfactory"), torch.no_grad():
        cache = KVCacheFactory(model.config, evicting("snapkv", budget=budget)).create_cache()
        prompt = random_prompt(PROMPT)
        peak = 0
        for start in range(0, PROMPT, chunk):
            model(prompt[:, start:start + chunk], past_key_values=cache)
            peak = max(peak, cache.size(0))
    assert peak == budget and cache.get_seq_length() == PROMPT


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("budget", ["ratio", "budget"])
def test_a_left_padded_batch_equals_each_row_alone(policy: str, budget: str) -> None:
    """Each row keeps what it would keep alone: same tokens, logits within float noise."""
    model = llama()
    lengths = [40, 31, 12, 36]  # the short row stays under the budget: it evicts later than the others
    batch = left_padded_batch(lengths, seed=11)
    options = {"compression_ratio": 0.5} if budget == "ratio" else {"budget": 16, "slack": 3}
    with attn_implementation(model, "kvfactory"):
        make = KVCacheFactory(model.config, evicting(policy, "paged", **options)).create_cache
        together = generate(model, batch, make(), max_new_tokens=12)
        for row, n in enumerate(lengths):
            alone = generate(model, {"input_ids": batch["input_ids"][row:row + 1, -n:]}, make(),
                             max_new_tokens=12)
            generated = alone.sequences[0, n:]  # may stop early at EOS; the batch row pads after it
            ours = together.sequences[row, max(lengths):][:generated.numel()]
            assert torch.equal(ours, generated), (row, n)
            for step_together, step_alone in zip(together.logits, alone.logits, strict=False):
                torch.testing.assert_close(step_together[row], step_alone[0], atol=1e-4, rtol=0)


# -- each method against its definition -------------------------------------------------------

def observation(b: int = 2, hq: int = 4, hkv: int = 2, t: int = 24, q: int = 6, seed: int = 0) -> Observation:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, t, 8, generator=gen)
    return Observation(keys, torch.randn(b, hq, q, 8, generator=gen), 8 ** -0.5, layer_idx=0, num_layers=2)


def full_attention(obs: Observation) -> torch.Tensor:
    """The step's causal attention ``[B, Hq, q, T]`` from the full matrix (what policies avoid)."""
    keys = obs.keys.repeat_interleave(obs.groups, dim=1)
    scores = obs.queries @ keys.transpose(-1, -2) * obs.scaling
    q, t = obs.queries.shape[2], keys.shape[2]
    allowed = torch.ones(q, t, dtype=torch.bool).tril(t - q)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1)


def test_observation_attention_equals_the_full_matrix(monkeypatch) -> None:
    monkeypatch.setattr("kvfactory.eviction.base.QUERY_CHUNK", 4)  # several query blocks
    obs = observation(q=10)
    full = full_attention(obs)
    torch.testing.assert_close(obs.attention(3), full[:, :, -3:])
    torch.testing.assert_close(obs.attention_mass(), full.sum(2))


def test_window_keeps_sinks_and_the_most_recent() -> None:
    obs = observation()
    top = WindowPolicy(n_sink=2).scores(obs, None, 6).topk(6, -1).indices.sort(-1).values
    assert top[0, 0].tolist() == [0, 1, 20, 21, 22, 23]


def test_knorm_keeps_the_lowest_key_norms() -> None:
    obs = observation()
    top = KnormPolicy().scores(obs, None, 5).topk(5, -1).indices
    norms = obs.keys.norm(dim=-1)
    assert torch.equal(top.sort(-1).values, norms.topk(5, -1, largest=False).indices.sort(-1).values)


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_knorm_skip_layers_are_left_whole_at_prefill_and_decode(storage: str) -> None:
    """The paper's code leaves its ``skip_layers`` uncompressed; the other layers keep the ratio
    (or the budget), and by default (kvpress's KnormPress) every layer is compressed."""
    model = llama()
    with attn_implementation(model, "kvfactory"), torch.no_grad():
        cache = KVCacheFactory(model.config, evicting("knorm", storage, compression_ratio=0.5,
                                                       skip_layers=[0])).create_cache()
        model(random_prompt(PROMPT), past_key_values=cache)
        assert [cache.size(i) for i in range(2)] == [PROMPT, PROMPT // 2]
        bounded = KVCacheFactory(model.config, evicting("knorm", storage, budget=12, slack=0,
                                                         skip_layers=[1])).create_cache()
        out = model(random_prompt(20), past_key_values=bounded)
        for _ in range(5):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=bounded)
        assert [bounded.size(i) for i in range(2)] == [12, 25]
        every = KVCacheFactory(model.config, evicting("knorm", storage, budget=12, slack=0)).create_cache()
        model(random_prompt(20), past_key_values=every)
        assert [every.size(i) for i in range(2)] == [12, 12]


@pytest.mark.parametrize("bad", [1, [0, -1], ["0"], [True]])
def test_knorm_skip_layers_must_be_layer_indices(bad) -> None:
    with pytest.raises(ConfigError) as err:
        KVCacheFactory(tiny_config("llama"), evicting("knorm", compression_ratio=0.5, skip_layers=bad))
    assert err.value.key == "strategies[1].skip_layers"


def test_tova_scores_the_last_query_averaged_over_heads() -> None:
    obs = observation()
    expected = full_attention(obs)[:, :, -1].mean(1, keepdim=True).expand(-1, 2, -1).clone()
    scores = TOVAPolicy().scores(obs, None, 5)
    torch.testing.assert_close(scores[..., :-1], expected[..., :-1])
    assert bool((scores[..., -1] > scores[..., :-1].max()).all())  # the newest token always stays


def test_snapkv_scores_pooled_window_attention() -> None:
    obs = observation(t=30, q=30)
    window, kernel = 5, 3
    weights = full_attention(obs)[:, :, -window:, :-window].mean(2)
    pooled = F.avg_pool1d(weights, kernel, stride=1, padding=1, count_include_pad=True)
    expected = pooled.view(2, 2, 2, -1).mean(2)
    scores = SnapKVPolicy(window_size=window, kernel_size=kernel).scores(obs, None, 10)
    torch.testing.assert_close(scores[..., :-window], expected)
    assert bool((scores[..., -window:] > expected.max()).all())


def test_h2o_accumulates_attention_over_every_step() -> None:
    """The store's accumulated mass equals the sum of every step's attention, kept tokens only."""
    gen = torch.Generator().manual_seed(0)
    spec = EvictionSpec("h2o", budget=10, slack=0)
    store = EvictionStore(DenseStore(), H2OPolicy(), spec, num_layers=1)
    store.bind(0)
    keys_seen, mass = torch.empty(1, 2, 0, 8), torch.empty(1, 2, 0)
    for q in [8, 1, 1, 1, 1]:
        k = torch.randn(1, 2, q, 8, generator=gen)
        store.append(k, k.clone())
        query = torch.randn(1, 4, q, 8, generator=gen)
        keys_seen = torch.cat([keys_seen, k], 2)
        obs = Observation(keys_seen, query, 0.5, 0, 1)
        mass = torch.cat([mass, torch.zeros(1, 2, q)], -1) + obs.per_kv_head(full_attention(obs).sum(2))
        store.attention_mask(None, query)
        store.observe(query, 0.5)
        assert store.size() == min(10, keys_seen.shape[2])
        if store.size() < keys_seen.shape[2]:  # evicted: the same heavy hitters + recent as the definition
            recent = 5
            expected = mass.clone()
            expected[..., -recent:] = expected.max() + 1
            index = expected.topk(10, -1).indices.sort(-1).values
            keys_seen = keys_seen.gather(2, index[..., None].expand(-1, -1, -1, 8))
            mass = mass.gather(2, index)
        torch.testing.assert_close(store.gather()[0], keys_seen)
        torch.testing.assert_close(store.accumulated, mass)


def test_prefill_in_chunks_bounds_the_peak_by_budget_plus_chunk() -> None:
    model = llama()
    budget, chunk = 12, 8
    slot = tiny_config("llama").num_key_value_heads * 16 * 2 * 4  # K+V bytes of one token, one layer
    with attn_implementation(model, "kvfactory"):
        config = evicting("snapkv", "paged", budget=budget)
        chunked = KVCacheFactory(model.config, config).create_cache()
        prefill_in_chunks(model, random_prompt(PROMPT), chunked, chunk_size=chunk)
        whole = KVCacheFactory(model.config, config).create_cache()
        prefill_in_chunks(model, random_prompt(PROMPT), whole, chunk_size=PROMPT)
    layers = len(chunked.layers)
    assert chunked.get_seq_length() == whole.get_seq_length() == PROMPT
    # pages of 4 tokens fit budget and chunk exactly
    assert chunked.memory_report()["peak_allocated"] == layers * slot * (budget + chunk)
    assert whole.memory_report()["peak_allocated"] == layers * slot * PROMPT
    assert chunked.memory_report()["allocated"] == layers * slot * budget
    with pytest.raises(ConfigError, match="chunk_size"):
        prefill_in_chunks(model, random_prompt(4), chunked, chunk_size=0)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_prompts_shorter_than_a_window_compress(policy: str) -> None:
    model = llama()
    with attn_implementation(model, "kvfactory"):
        for length in (1, 2, 3):
            cache = KVCacheFactory(model.config, evicting(policy, compression_ratio=0.5, window_size=64)
                                   if policy in SMALL_WINDOWS else evicting(policy, compression_ratio=0.5)
                                   ).create_cache()
            generate(model, {"input_ids": random_prompt(length)}, cache, max_new_tokens=3)
            assert cache.get_seq_length() == length + 2


def test_a_user_policy_registers_in_one_line() -> None:
    @dataclass
    class Oldest(Policy):
        """Keeps the oldest tokens (for the test only)."""

        def scores(self, obs: Observation, accumulated: torch.Tensor | None, kept: int) -> torch.Tensor:
            b, h, t, _ = obs.keys.shape
            return -torch.arange(t, dtype=torch.float32).expand(b, h, t)

    register_policy("oldest_for_test", Oldest)
    try:
        model = llama()
        with attn_implementation(model, "kvfactory"), torch.no_grad():
            cache = KVCacheFactory(model.config, evicting("oldest_for_test", budget=8)).create_cache()
            prompt = random_prompt(20)
            model(prompt, past_key_values=cache)
            keys = cache.gather(0)[0]
            full = DynamicCache(config=model.config)
            model(prompt, past_key_values=full)
        torch.testing.assert_close(keys, full.layers[0].keys[:, :, :8])
        with pytest.raises(ConfigError, match="policy class"):
            register_policy("not_a_policy", dict)
    finally:
        POLICIES.pop("oldest_for_test")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_beams_and_returned_sequences_reorder_what_the_policy_tracks(policy: str) -> None:
    model = llama()
    with attn_implementation(model, "kvfactory"):
        for kwargs in ({"num_beams": 3}, {"do_sample": True, "num_return_sequences": 2}):
            cache = KVCacheFactory(model.config, evicting(policy, budget=12, slack=2)).create_cache()
            out = generate(model, {"input_ids": random_prompt(20)}, cache, seed=0, max_new_tokens=10,
                           **kwargs)
            assert out.sequences.shape[1] == 30
            store = cache.layers[0].store
            assert store.valid.shape[0] == cache.batch_size
            assert cache.size(0) <= 12 + 2 or not POLICIES[policy].decodes
