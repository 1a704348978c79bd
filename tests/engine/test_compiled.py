"""The compiled steps (``kvfactory.engine.compiled``, ``compiled_prefill``): their plain pages' custom
ops are well-formed torch ops that write and read as the eager kernels and causal attention do (KIVI
pages' op: ``test_ragged_quantized``); engines that compile give the tokens of engines that do not, on
a dense and a hybrid (sliding-window) architecture, over plain and KIVI pages, prefill chunks
included; a compiler failure runs the steps eagerly with the same tokens; configs it does not cover
are refused."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from configs import composite
from helpers import greedy_tokens
from tiny_models import random_prompt, tiny_model
from torch.profiler import ProfilerActivity, profile

from kvfactory import CacheFullError, ConfigError, KVCacheFactory
from kvfactory.engine import Engine, SamplingParams
from kvfactory.engine import compiled as compiled_step
from kvfactory.engine.batch import Segment
from kvfactory.engine.weights import PackedLinear, pack_panels
from kvfactory.storage.ragged import paged_decode, shared_fits

PROMPTS = [random_prompt(n, seed=n)[0].tolist() for n in (5, 23, 12, 40)]
NEW = 10


def _step_args() -> tuple:
    torch.manual_seed(0)
    heads, kv_heads, dim, page, blocks = 4, 2, 8, 4, 12
    tables = torch.tensor([[3, 7, 1], [5, 0, 11]])
    starts, lengths = torch.tensor([0, 2]), torch.tensor([10, 7])
    slots = torch.tensor([int(tables[0, 2]) * page + 1, int(tables[1, 2]) * page])  # each one's last token
    return (torch.randn(1, heads, 2, dim), torch.randn(1, kv_heads, 2, dim), torch.randn(1, kv_heads, 2, dim),
            torch.randn(kv_heads, blocks, page, dim), torch.randn(kv_heads, blocks, page, dim), slots, tables,
            starts, lengths, torch.tensor(0), 0.35)


def _shared_step_args() -> tuple:
    """Five sequences behind the same 9 blocks of 16 tokens (SmolLM2's heads), each with 2 of its own."""
    torch.manual_seed(1)
    heads, kv_heads, dim, page = 9, 3, 64, 16
    own = torch.arange(9, 19).view(5, 2)
    tables = torch.cat([torch.arange(9).expand(5, 9), own], 1)
    starts, lengths = torch.zeros(5, dtype=torch.long), torch.tensor([145, 150, 160, 170, 175])
    last = lengths - 1  # each one's last token
    slots = tables[torch.arange(5), last // page] * page + last % page
    return (torch.randn(1, heads, 5, dim), torch.randn(1, kv_heads, 5, dim), torch.randn(1, kv_heads, 5, dim),
            torch.randn(kv_heads, 19, page, dim), torch.randn(kv_heads, 19, page, dim), slots, tables,
            starts, lengths, torch.tensor(9), 0.125)


@pytest.mark.parametrize("args", [_step_args, _shared_step_args])
def test_the_step_op_writes_each_token_to_its_slot_then_attends_as_paged_decode(args) -> None:
    """Sequences of their own blocks, and sequences behind shared blocks read once for all."""
    query, key, value, k_pool, v_pool, slots, tables, starts, lengths, shared, scale = args()
    want_k, want_v = k_pool.clone(), v_pool.clone()
    for pool, new in ((want_k, key), (want_v, value)):
        flat = pool.view(pool.shape[0], -1, pool.shape[-1])
        flat[:, slots] = new[0]
    want = paged_decode(query[0].transpose(0, 1), want_k, want_v, tables, starts, lengths, scale,
                        kernel=False)
    out = torch.ops.kvfactory.paged_decode_step(query, key, value, k_pool, v_pool, slots, tables, starts,
                                                lengths, shared, scale)
    torch.testing.assert_close(k_pool, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_pool, want_v, atol=0, rtol=0)
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)


def test_the_step_op_passes_torch_custom_op_checks() -> None:
    """Schema, declared mutations, the fake kernel's shapes and tracing with dynamic shapes."""
    torch.library.opcheck(torch.ops.kvfactory.paged_decode_step.default, _step_args())


def test_the_panel_linear_op_passes_torch_custom_op_checks() -> None:
    weight, bias = torch.randn(64, 24), torch.randn(64)
    for rows in (1, 9):
        torch.library.opcheck(torch.ops.kvfactory.panel_linear.default,
                              (torch.randn(2, rows, 24), pack_panels(weight), bias))


def _prefill_args() -> tuple:
    """Two prefill chunks and a decode token of SmolLM2's heads in blocks of 4: 6 tokens after 5 stored
    ones, the ninth token of a sequence and 9 tokens of a new sequence."""
    torch.manual_seed(2)
    heads, kv_heads, dim, page, blocks = 9, 3, 64, 4, 20
    tables = torch.tensor([[3, 7, 12], [9, 14, 15], [5, 0, 11]])
    bounds, totals = torch.tensor([0, 6, 7, 16]), torch.tensor([11, 9, 9])
    at = [torch.arange(5, 11), torch.tensor([8]), torch.arange(9)]
    slots = torch.cat([tables[s, at[s] // page] * page + at[s] % page for s in range(3)])
    key, value = torch.randn(2, 1, kv_heads, 16, dim)
    return (torch.randn(1, heads, 16, dim), key, value, torch.randn(kv_heads, blocks, page, dim),
            torch.randn(kv_heads, blocks, page, dim), slots, bounds, tables, totals, 0.125)


needs_chunk_kernel = pytest.mark.skipif(not shared_fits(torch.empty(1, 1, 64)),
                                        reason="the chunk kernel has no AVX-512 body on this CPU")


@needs_chunk_kernel
def test_the_prefill_op_writes_each_chunk_then_attends_causally_over_its_blocks() -> None:
    query, key, value, k_pool, v_pool, slots, bounds, tables, totals, scale = _prefill_args()
    want_k, want_v = k_pool.clone(), v_pool.clone()
    for pool, new in ((want_k, key), (want_v, value)):
        pool.view(pool.shape[0], -1, pool.shape[-1])[:, slots] = new[0]
    out = torch.ops.kvfactory.paged_prefill_step(query, key, value, k_pool, v_pool, slots, bounds, tables,
                                                 totals, scale)
    torch.testing.assert_close(k_pool, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_pool, want_v, atol=0, rtol=0)
    for s in range(3):
        chunk = slice(int(bounds[s]), int(bounds[s + 1]))
        total, tokens = int(totals[s]), chunk.stop - chunk.start
        keys, values = (pool[:, tables[s]].flatten(1, 2)[None, :, :total] for pool in (want_k, want_v))
        visible = torch.arange(total)[None] <= torch.arange(total - tokens, total)[:, None]
        want = F.scaled_dot_product_attention(query[:, :, chunk], keys, values, attn_mask=visible,
                                              scale=scale, enable_gqa=True)
        torch.testing.assert_close(out[0, chunk], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@needs_chunk_kernel
def test_the_prefill_op_passes_torch_custom_op_checks() -> None:
    torch.library.opcheck(torch.ops.kvfactory.paged_prefill_step.default, _prefill_args())


def _generate(model: torch.nn.Module, config: dict, compile_step: bool) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, None, config, pool_tokens=512, compile_step=compile_step)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    return [output.token_ids for output in outputs], engine


PLAIN = {"type": "paged", "page_size": 4}
INT4 = {"type": "paged", "page_size": 4, "quantization": {"codec": "int4", "residual": 8, "group_size": 8}}


@pytest.mark.parametrize(("name", "config"), [("llama", PLAIN), ("gemma3", PLAIN), ("llama", INT4)],
                         ids=["llama", "gemma3", "llama-int4"])  # gemma3: sliding layers (window 8) and full
def test_compiled_and_eager_steps_give_the_same_tokens(name: str, config: dict) -> None:
    """Plain pages, and KIVI pages whose windows flush a group of 8 tokens every 8 steps (before the
    forward, where the compiled step runs), some sequences holding packed tokens and some not yet.
    Also: caches made before their first forward, one dropped and one still held, leave kvfactory's
    model-finding forward hook registered until a forward runs it; the step still compiles (the hook,
    which takes a lock, does nothing in a traced forward) rather than falling back to eager steps, and
    the held cache then finds its model in its own first forward."""
    model = tiny_model(name)
    eager, _ = _generate(model, config, compile_step=False)
    KVCacheFactory(model.config, config).create_cache()
    gc.collect()
    held = KVCacheFactory(model.config, config).create_cache()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled, engine = _generate(model, config, compile_step=True)
    ops = {event.key for event in prof.key_averages()}
    # the graph multiplies by the engine's panels where they are packed, not by weights inductor packs
    panels = isinstance(model.lm_head, PackedLinear) and model.lm_head.packed.panels
    assert ("kvfactory::panel_linear" in ops) == panels
    assert greedy_tokens(model, PROMPTS[0], NEW, cache=held) == eager[0]
    factory = KVCacheFactory(model.config, config)
    assert compiled == eager == [greedy_tokens(model, p, NEW, factory.create_cache()) for p in PROMPTS]
    assert engine.compiled.failure is None
    assert engine.compiled.recompiles == 0  # the graph compiled for the dummy step served every real one
    assert engine.compiled.steps >= NEW - 1  # decode steps of several sequences ran compiled
    assert engine.stats()["sequences"] == 0


@needs_chunk_kernel
@pytest.mark.parametrize(("prefill_first", "config"), [(True, PLAIN), (False, PLAIN), (True, INT4)],
                         ids=["prefill-first", "mixed-steps", "int4"])
def test_compiled_prefill_steps_give_the_eager_tokens(prefill_first: bool, config: dict) -> None:
    """Prefill steps of ``GEMM_ROWS`` tokens or more (chunks of two sequences packed, a long prompt's
    chunks after its first, a prompt behind a cached prompt's blocks; in mixed steps, with the decode
    tokens of the sequences already prefilled) run in the compiled prefill graph, compiled once, and
    give the tokens of the eager engine and of the cache alone. Over KIVI pages every chunk but the
    decode tokens' encodes some of its own tokens (windows of 8), the first step before any packed
    page exists (a pool that grows as it is used)."""
    model = tiny_model("llama", head_dim=64)  # heads the chunk kernel takes
    base = random_prompt(150, seed=7)[0].tolist()
    first = [base + random_prompt(30, seed=8)[0].tolist(), random_prompt(70, seed=9)[0].tolist(),
             random_prompt(300, seed=10)[0].tolist()]
    second = [base + random_prompt(140, seed=11)[0].tolist()]
    outputs = {}
    for compile_step in (False, True):
        engine = Engine(model, None, config, pool_tokens=2048 if config is PLAIN else None,
                        max_num_batched_tokens=200,
                        prefill_first=prefill_first, compile_step=compile_step)
        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        outputs[compile_step] = [*engine.generate(first, params), *engine.generate(second, params)]
    compiled = engine.compiled_prefill
    assert (compiled.failure, compiled.recompiles) == (None, 0)
    # 180 + 20, 50 + 150, 150 tokens (mixed: 1 + 50 + 149, 2 + 151); then 142 after 148 cached (whole blocks)
    assert compiled.steps == 4
    assert outputs[True][-1].cached_tokens == (148 if config is PLAIN else 144)
    tokens = [[output.token_ids for output in outputs[compile_step]] for compile_step in (False, True)]
    factory = KVCacheFactory(model.config, config)
    alone = [greedy_tokens(model, prompt, NEW, factory.create_cache()) for prompt in first + second]
    assert tokens[1] == tokens[0] == alone
    assert engine.stats()["sequences"] == 0


def test_the_engines_of_one_process_compile_their_steps_apart() -> None:
    """Dynamo keeps graphs per code object and fails a whole-graph compile past its recompile limit: each
    engine's steps compile code of their own, so that the engines of one process do not share the limit
    (here 1, so that a second engine's steps would fail)."""
    model = tiny_model("llama")
    with torch._dynamo.config.patch(recompile_limit=1):
        engines = [Engine(model, None, PLAIN, pool_tokens=512, compile_step=True) for _ in range(2)]
    assert [(engine.compiled.failure, engine.compiled.recompiles) for engine in engines] == [(None, 0)] * 2


def test_a_dropped_engines_compiled_steps_are_freed() -> None:
    """Dynamo keeps a compiled step's backend as long as its code's cache: the backend refers to nothing
    of the step, so that the steps (the decode step's frozen weights) go with their engine."""
    engine = Engine(tiny_model("llama", head_dim=64), None, INT4, pool_tokens=512, compile_step=True)
    steps = [weakref.ref(step) for step in (engine.compiled, engine.compiled_prefill) if step is not None]
    del engine
    gc.collect()
    assert steps and all(step() is None for step in steps)


@pytest.mark.parametrize("config", [PLAIN, INT4], ids=["plain", "int4"])
def test_a_group_whose_layers_stand_apart_is_not_planned_as_one(config: dict) -> None:
    """A step that stopped part way (the first layer wrote a token, the last did not) leaves a group's
    layers apart: the compiled decode step does not plan it (the eager step runs it), having made no
    room; standing together, they are planned."""
    model = tiny_model("llama")
    engine = Engine(model, None, config, pool_tokens=512, compile_step=True)
    caches = [engine.manager.create(f"s{i}") for i in range(2)]
    for cache, prompt in zip(caches, PROMPTS[2:], strict=True):
        with torch.inference_mode():
            model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    members = engine.compiled.members
    stores = [[cache.layers[i].store for cache in caches] for i in range(len(caches[0].layers))]
    assert len(members) == 1 and compiled_step.groups_aligned(members, stores)
    kv_heads, dim = model.config.num_key_value_heads, model.config.head_dim
    caches[0].update(torch.randn(1, kv_heads, 1, dim), torch.randn(1, kv_heads, 1, dim), 0)
    sizes = [[layer.store.size() for layer in cache.layers] for cache in caches]
    assert not compiled_step.groups_aligned(members, stores)
    assert engine.compiled.plan([Segment(cache, cache.get_seq_length(), cache.get_seq_length() + 1)
                                 for cache in caches]) is None
    assert [[layer.store.size() for layer in cache.layers] for cache in caches] == sizes


@needs_chunk_kernel
def test_a_prefill_step_the_pool_cannot_hold_is_refused_before_any_room_is_made() -> None:
    """Two chunks of 100 tokens need 50 blocks of 4; the pool holds 40: ``CacheFullError`` from the plan,
    with no block taken and no token counted."""
    engine = Engine(tiny_model("llama", head_dim=64), None, PLAIN, pool_tokens=160, compile_step=True)
    caches = [engine.manager.create(f"s{i}") for i in range(2)]
    free = engine.manager.stats()["pool_blocks_free"]
    with pytest.raises(CacheFullError):
        engine.compiled_prefill.plan([Segment(caches[0], 0, 100), Segment(caches[1], 100, 200)])
    assert engine.manager.stats()["pool_blocks_free"] == free
    assert all(layer.store.size() == 0 for cache in caches for layer in cache.layers)


def test_a_compiler_failure_decodes_eagerly_with_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")

    def compile_that_fails(fn: object, **options: object) -> object:
        def run(*args: object) -> None:
            raise torch._dynamo.exc.TorchDynamoException("no C++ compiler")
        return run

    monkeypatch.setattr(torch, "compile", compile_that_fails)
    tokens, engine = _generate(model, {"type": "paged", "page_size": 4}, compile_step=True)
    assert tokens == [greedy_tokens(model, prompt, NEW) for prompt in PROMPTS]
    assert engine.compiled.failure == "TorchDynamoException: no C++ compiler" and engine.compiled.steps == 0


@pytest.mark.parametrize(("name", "config"), [
    ("llama", {"type": "paged", "page_size": 4, "quantization": "int8"}),  # codes the kernels do not read
    ("gemma3", INT4),  # KIVI pages on sliding layers
    ("llama", composite({"name": "eviction", "policy": "streaming_llm", "budget": 16, "n_sink": 2})),
    ("llama", composite({"name": "quest", "dense_layers": 0, "read_budget": 0.5}))],
    ids=["int8", "gemma3-int4", "eviction", "quest"])
def test_configs_it_does_not_cover_are_refused(name: str, config: dict) -> None:
    with pytest.raises(ConfigError, match="compile_step.*plain pages and KIVI pages"):
        Engine(tiny_model(name), None, config, pool_tokens=512, compile_step=True)
