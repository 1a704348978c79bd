"""The engine on tiny random models of every architecture the cache tests cover: greedy outputs
equal ``model.generate`` with ``DynamicCache`` sequence by sequence, whatever shares the batch
(prompts of different lengths, chunked prefills, a sliding window shorter than the prompts), also
when a shared prefix comes from the prefix cache or from another engine's tiers."""

from __future__ import annotations

import pytest
from helpers import greedy_tokens
from tiny_models import TINY_IDS, random_prompt, tiny_model

from kvfactory import ConfigError
from kvfactory.engine import Engine, SamplingParams
from kvfactory.manager.tiered import ChunkRun
from kvfactory.tiers import DiskTier, TierChain

ENGINE_ARCHITECTURES = [name for name in TINY_IDS if name != "gpt2"]


@pytest.mark.parametrize("name", ENGINE_ARCHITECTURES)
@pytest.mark.parametrize("budget", [7, 64])  # 7: prefills are chunked over several steps
def test_greedy_equals_generate(name: str, budget: int) -> None:
    model = tiny_model(name)
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (5, 23, 12, 40)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine = Engine(model, None, {"type": "paged", "page_size": 4}, pool_tokens=512,
                    max_num_batched_tokens=budget)
    outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == greedy_tokens(model, prompt, 10)
        assert output.finish_reason == "length"
    stats = engine.stats()
    assert stats["sequences"] == 0 and stats["running"] == stats["waiting"] == 0


@pytest.mark.parametrize("selector", ["quest", "oval"])
def test_sparse_reads_under_chunked_prefill(selector: str) -> None:
    """A page selector reads sparsely for a prefill chunk written over stored pages too: its mask
    spans every stored token."""
    from helpers import tiny_router

    model = tiny_model("llama")
    entry = {"name": selector, "read_budget": 0.5, "dense_layers": 0}
    if selector == "oval":
        entry["router"] = tiny_router(64, 2, 16, (0, 1))
    config = {"type": "composite", "strategies": [{"name": "paged", "page_size": 4}, entry]}
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (30, 45)]
    engine = Engine(model, None, config, pool_tokens=512, max_num_batched_tokens=9)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outputs)
    assert engine.stats()["sequences"] == 0


@pytest.mark.parametrize("name", ENGINE_ARCHITECTURES)
def test_int4_decode_in_place_equals_each_cache(name: str, monkeypatch) -> None:
    """KIVI pages decoded by the batched in-place kernels (``quantized_decode``, over packed blocks and
    windows, full windows encoding their oldest group in one batch: ``flush_windows``) give the tokens
    each sequence's own cache gives (``in_place_decode=False``); sliding layers (Mistral's) keep reading
    through their caches. The packed blocks' read plan is kept once per layer group, whose layers share
    one block table."""
    from kvfactory.engine import batch
    from kvfactory.quantization import ragged

    calls, flushed = [], []
    real, real_flush = batch.quantized_decode, ragged.flush_windows
    monkeypatch.setattr(batch, "quantized_decode",
                        lambda query, stores, scale, *planned: calls.append(
                            max(s.quantized_tokens for s in stores)) or real(query, stores, scale, *planned))
    monkeypatch.setattr(ragged, "flush_windows",  # a decode step's flushes (``flush_full_windows``)
                        lambda stores, tokens: flushed.append(len(stores)) or real_flush(stores, tokens))
    model = tiny_model(name)
    quantization = {"codec": "int4", "group_size": 8, "residual": 4}
    config = {"type": "paged", "page_size": 4, "quantization": quantization}
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (5, 23, 12, 40)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engines = {mode: Engine(model, None, config, pool_tokens=1024, in_place_decode=mode,
                            max_num_batched_tokens=64) for mode in (True, False)}
    outputs = {mode: [o.token_ids for o in engine.generate(prompts, params)]
               for mode, engine in engines.items()}
    assert outputs[True] == outputs[False]
    if getattr(model.config, "sliding_window", None) is None:  # sliding layers read through their caches
        assert calls and max(calls) > 0  # the packed part was read in place
        assert flushed and max(flushed) > 1  # several sequences' windows encoded in one batch
        assert list(engines[True]._packed_plans) == engines[True].manager.factory.groups


@pytest.mark.parametrize("name", [n for n in ENGINE_ARCHITECTURES if n not in ("mistral-sw8", "gemma3")])
def test_prefill_chunks_flush_full_int4_windows_in_one_batch(name: str, monkeypatch) -> None:
    """Prefill chunks that push several sequences' KIVI windows past their residual in one step (a
    prompt's last chunk and the requests that found its first part cached with its window's pages, as
    behind a system prompt; such hits are off with sliding layers) encode the oldest groups in one
    batch per layer (``flush_windows``, through ``flush_full_windows``) and give the tokens each store's
    own write gives (the batch turned off)."""
    from kvfactory.quantization import ragged

    real, batched = ragged.flush_windows, []
    model = tiny_model(name)
    config = {"type": "paged", "page_size": 4,
              "quantization": {"codec": "int4", "group_size": 8, "residual": 16}}
    shared = random_prompt(48, seed=1)[0].tolist()
    prompts = [shared + random_prompt(10, seed=2 + i)[0].tolist() for i in range(3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = {}
    for mode in ("batched", "each"):
        monkeypatch.setattr(ragged, "flush_windows", (lambda stores, tokens: batched.append(len(stores))
                                                      or real(stores, tokens)) if mode == "batched"
                            else (lambda stores, tokens: None))
        # decode steps go through each cache, so every batched flush here is a prefill chunk's
        engine = Engine(model, None, config, pool_tokens=1024, in_place_decode=False,
                        max_num_batched_tokens=24)
        outputs[mode] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs["batched"] == outputs["each"]
    assert batched and max(batched) > 1


@pytest.mark.parametrize("name", ENGINE_ARCHITECTURES)
@pytest.mark.parametrize("selector", ["quest", "oval"])
def test_sparse_decode_in_place_equals_each_cache(name: str, selector: str, monkeypatch) -> None:
    """Sparse layers over plain pages decoded by the batched kernel, each KV head over the blocks its
    selector picked (``SparseStore.decode_blocks``), give the tokens and the read accounting of each
    sequence's own cache (``in_place_decode=False``); shadow steps keep their attention call."""
    from helpers import tiny_router

    from kvfactory.selectors.sparse import SparseStore

    picked = []
    real = SparseStore.decode_blocks
    monkeypatch.setattr(SparseStore, "decode_blocks",
                        lambda store, query: picked.append((store.routed, store.steps)) or real(store, query))
    model = tiny_model(name)
    entry = {"name": selector, "read_budget": 0.4, "dense_layers": 1, "shadow_every": 5}
    if selector == "oval":
        config_ = model.config
        head_dim = getattr(config_, "head_dim", None) or config_.hidden_size // config_.num_attention_heads
        entry["router"] = tiny_router(config_.hidden_size, config_.num_key_value_heads, head_dim,
                                      tuple(range(1, config_.num_hidden_layers)))
    config = {"type": "composite", "strategies": [{"name": "paged", "page_size": 4}, entry]}
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (33, 50, 41)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = {}
    for mode in (True, False):
        engine = Engine(model, None, config, pool_tokens=1024, in_place_decode=mode,
                        max_num_batched_tokens=64)
        outputs = [o.token_ids for o in engine.generate(prompts, params)]
        runs[mode] = outputs, {name: gauge._value.get() for name, gauge in engine.metrics.routing.items()}
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == pytest.approx(runs[False][1], abs=1e-6)
    if getattr(model.config, "sliding_window", None) is None:  # sliding layers read through their caches
        assert 0 < runs[True][1]["read_fraction"] < 1 and 0 < runs[True][1]["token_read_fraction"] < 1
        assert any(routed for routed, _ in picked)
        assert all((step + 1) % 5 for routed, step in picked if routed)  # shadow steps: attention's

@pytest.mark.parametrize("budget", [0.125, 0.25, 0.5])
def test_sparse_decode_reads_its_budget(budget: float, monkeypatch) -> None:
    """Each decode step of a sparse layer reads ``read_budget`` of its stored tokens within one page
    per KV head, the sink, local and new-token pages included, each page at most once."""
    import math

    from kvfactory.selectors.sparse import SparseStore

    page = 4
    reads = []
    real = SparseStore.decode_blocks

    def recorded(store, query):
        blocks, tokens = real(store, query)
        reads.append((store.size(), blocks, tokens))
        return blocks, tokens

    monkeypatch.setattr(SparseStore, "decode_blocks", recorded)
    entry = {"name": "quest", "read_budget": budget, "dense_layers": 0, "shadow_every": 0}
    config = {"type": "composite", "strategies": [{"name": "paged", "page_size": page}, entry]}
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (90, 130)]
    Engine(tiny_model("llama"), None, config, pool_tokens=1024).generate(
        prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    checked = 0
    for stored, blocks, tokens in reads:
        pages = math.ceil(stored / page)
        assert all(len(set(row.tolist())) == len(row) for row in blocks)  # no page read twice
        if math.ceil(budget * pages) < 2 or math.ceil(budget * pages) >= pages:
            continue  # the always-read pages exceed the budget, or it covers every page
        assert abs(tokens - budget * stored) <= page
        checked += 1
    assert checked > 0

def test_eos_ends_a_request() -> None:
    model = tiny_model("llama")
    engine = Engine(model, None, {"type": "paged", "page_size": 4}, pool_tokens=512)
    prompt = random_prompt(9)[0].tolist()
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    stop = engine.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=(greedy[2],)))[0]
    assert stop.token_ids == greedy[:greedy.index(greedy[2]) + 1] and stop.finish_reason == "stop"


def test_int4_pages_admit_more_sequences_in_one_byte_budget() -> None:
    """With one KV byte budget, int4 pages hold over three times the concurrent long sequences of plain
    pages (the scheduler admits while their writes fit the pool), and finish every one of them with
    the tokens the same int4 cache gives alone (the quality the quantization docs measure)."""
    from kvfactory import KVCacheFactory

    model = tiny_model("llama")
    prompts = [random_prompt(400, seed=i)[0].tolist() for i in range(40)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    running, done = {}, {}
    for name, config in (("plain", {"type": "paged", "page_size": 16}),
                         ("int4", {"type": "paged", "page_size": 16, "quantization": "int4"})):
        pool = 6 * 416 * 2 * 2 * 16 * 4 * 2  # 6 plain sequences of 416 tokens, 2 layers
        engine = Engine(model, None, config, pool_bytes=pool, max_num_batched_tokens=100_000, max_num_seqs=64,
                        prefix_caching=False)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        outputs = {o.request_id: o for o in engine.step() if o.finished}
        running[name] = len(engine.scheduler.running)
        while engine.has_unfinished():
            outputs |= {o.request_id: o for o in engine.step() if o.finished}
        done[name] = [outputs[i].token_ids for i in ids]
        assert engine.stats()["sequences"] == 0
    assert running["plain"] == 6 and running["int4"] >= 3 * running["plain"]
    with pytest.raises(ConfigError, match="pool_bytes"):  # one pool size
        Engine(model, None, pool_tokens=512, pool_bytes=pool)
    assert all(len(tokens) == 16 for tokens in done["int4"])
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": 16, "quantization": "int4"})
    for prompt, tokens in list(zip(prompts, done["int4"], strict=True))[::13]:
        assert tokens == greedy_tokens(model, prompt, 16, factory.create_cache())


@pytest.mark.parametrize("name", ENGINE_ARCHITECTURES)
@pytest.mark.parametrize("budget", [7, 64])
def test_a_shared_prefix_is_computed_once(name: str, budget: int) -> None:
    """Requests sharing a 40-token prefix, one first and then three together, answer as
    ``model.generate`` and start from the first one's cached blocks: sliding-window layers (window 8)
    keep the blocks of a prompt's last window for later prompts, as full-attention layers keep all."""
    model = tiny_model(name)
    prefix = random_prompt(40, seed=7)[0].tolist()
    prompts = [prefix + random_prompt(3 + i, seed=20 + i)[0].tolist() for i in range(4)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = Engine(model, None, {"type": "paged", "page_size": 4}, pool_tokens=512,
                    max_num_batched_tokens=budget)
    outputs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == greedy_tokens(model, prompt, 6)
    stats = engine.stats()
    assert stats["prefix_hit_blocks"] >= 3 * 10, stats
    assert stats["pool_blocks_held"] == 0


@pytest.mark.parametrize("name", ENGINE_ARCHITECTURES)
def test_a_second_engine_loads_a_shared_prefix_from_the_tiers(name: str, tmp_path) -> None:
    """A second engine (its own pool and prefix cache) loads the first one's 40-token prefix in
    8-token chunks from a disk tier, for every layer of a hybrid model too, and answers as
    ``model.generate``."""
    model = tiny_model(name)
    prefix = random_prompt(40, seed=7)[0].tolist()
    prompts = [prefix + random_prompt(3 + i, seed=20 + i)[0].tolist() for i in range(3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def engine() -> Engine:
        return Engine(model, None, {"type": "paged", "page_size": 4}, pool_tokens=512,
                      tiers=TierChain([DiskTier(tmp_path, 1 << 26)]), chunk_tokens=8)

    first = engine()
    first.generate(prompts[:1], params)
    assert first.stats()["tier_chunks_stored"] == 5
    assert first.manager.tiers.flush(timeout=60)  # written off the engine's thread
    second = engine()
    outputs = second.generate(prompts[1:], params)
    for prompt, output in zip(prompts[1:], outputs, strict=True):
        assert output.token_ids == greedy_tokens(model, prompt, 6)
    stats = second.stats()
    assert stats["tier_chunks_loaded"] == 2 * 5 and stats["pool_blocks_held"] == 0


def test_tier_reads_start_after_the_prefix_the_pool_holds(tmp_path) -> None:
    """``read_tiers`` reads only the chunks after the blocks the pool's prefix cache holds; a read
    that started later than the pool's prefix now ends (its blocks evicted since) is not used, and
    the chunks are read again at ``create``."""
    model = tiny_model(ENGINE_ARCHITECTURES[0])
    prefix = random_prompt(40, seed=7)[0].tolist()
    prompt = prefix + random_prompt(4, seed=21)[0].tolist()

    def engine() -> Engine:
        return Engine(model, None, {"type": "paged", "page_size": 4}, pool_tokens=512,
                      tiers=TierChain([DiskTier(tmp_path, 1 << 26)]), chunk_tokens=8)

    first = engine()
    first.generate([prefix + [1]], SamplingParams(max_tokens=1))
    assert first.manager.tiers.flush(timeout=60)
    assert first.manager.read_tiers(prompt) is None  # the pool holds all 5 chunks' blocks: nothing to read
    manager = engine().manager
    run = manager.read_tiers(prompt).result(timeout=60)
    assert run.first == 0 and len(run.chunks) == 5
    manager.create("late", prompt, tier_chunks=ChunkRun(2, run.chunks[2:]))
    assert manager.cached_tokens("late") == 40 and manager.stats()["tier_chunks_loaded"] == 5 + 5
