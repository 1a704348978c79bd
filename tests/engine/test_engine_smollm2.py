"""The engine on the embedded SmolLM2: outputs equal running each request alone, for every kind of
config, under chunked prefills, prefix hits, staggered arrivals and preemption by swap or recompute;
sampling, stops, aborts and admission errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import first_divergence, greedy_tokens

from kvfactory.engine import AdmissionError, Engine, EngineFullError, SamplingParams
from kvfactory.engine import compiled as compiled_step
from kvfactory.engine.weights import GEMM_ROWS
from kvfactory.errors import ConfigError
from kvfactory.factory import KVCacheFactory
from kvfactory.manager.prefix import block_hashes
from kvfactory.presets import load_preset
from kvfactory.quantization import ragged as ragged_quantized
from kvfactory.storage.ragged import shared_fits

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
           "def fibonacci(n):\n    ", "The three laws of thermodynamics state that"]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def ids_of(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in prompts]


STORY_TOKENS = 24
# logits of SmolLM2 over int4 pages move by up to 0.6 between two layouts of the same weights (the
# engine's panels or not) whose products differ by summation order alone: a tie closer than this is noise
KIVI_TIE = 1.0


@pytest.fixture(scope="module")
def stories(smollm2) -> tuple[list[list[int]], list[list[int]]]:
    """8 short prompts and each one's ``STORY_TOKENS`` greedy tokens alone: the preemption tests'
    requests."""
    model, tokenizer = smollm2
    prompts = ids_of(tokenizer, [f"Story {i}: " + PROMPTS[i % 4] for i in range(8)])
    return prompts, [greedy_tokens(model, prompt, STORY_TOKENS) for prompt in prompts]


def assert_idle(engine: Engine) -> None:
    """No request holds a block: what is still used is idle prefix-cache blocks, reclaimable."""
    stats = engine.stats()
    assert stats["sequences"] == 0 and stats["running"] == stats["waiting"] == stats["swapped"] == 0
    assert stats["pool_blocks_held"] == 0


def test_greedy_equals_dynamic_cache_with_staggered_arrivals(smollm2) -> None:
    model, tokenizer = smollm2
    prompts = ids_of(tokenizer, PROMPTS)
    engine = Engine(model, tokenizer, {"type": "paged", "page_size": 16}, pool_tokens=2048,
                    max_num_batched_tokens=16)  # prefills chunked and mixed with decodes
    done: dict[str, list[int]] = {}
    ids = [engine.add_request(prompts[0], GREEDY)]
    for prompt in prompts[1:]:  # each arrives while the others decode
        for _ in range(3):
            done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        ids.append(engine.add_request(prompt, GREEDY))
    while engine.has_unfinished():
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert done[request_id] == greedy_tokens(model, prompt, GREEDY.max_tokens)
    assert_idle(engine)


@pytest.mark.parametrize("preset", ["int8", "int4", "snapkv@0.5", "quest@0.25", "oval@0.25"])
def test_every_config_equals_its_cache_alone(smollm2, preset: str) -> None:
    """A lossy config in the engine computes what the same cache computes alone under ``generate``."""
    model, tokenizer = smollm2
    long_prompt = tokenizer("Call me Ishmael. " * 40)["input_ids"]
    prompts = [*ids_of(tokenizer, PROMPTS[:2]), long_prompt]
    config = load_preset(preset)
    engine = Engine(model, tokenizer, config, pool_tokens=4096, max_num_batched_tokens=512)
    outputs = engine.generate(prompts, GREEDY)
    factory = KVCacheFactory(model.config, config)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == greedy_tokens(model, prompt, GREEDY.max_tokens, factory.create_cache())
    assert engine.stats()["sequences"] == 0


@pytest.mark.parametrize("preset", ["paged16", "int4"])
def test_compiled_steps_equal_the_cache_alone(smollm2, preset: str, monkeypatch) -> None:
    """The compiled decode step (``compile_step``) over plain and KIVI pages (the long prompt's packed
    groups read by the KIVI kernel, the short ones' windows alone) and the compiled prefill step give
    what the same cache computes alone under ``generate``; every decode step ran compiled, in the graph
    compiled with the engine. Prefill steps: the first batch's (three new prompts) and then four
    questions behind the cached long prompt, computing only their own tokens. Both run compiled, over
    KIVI pages too: the windows take the questions after encoding their oldest groups, as the eager step
    would, and the first batch's long prompt, which encodes some of its own tokens, reads them encoded
    and decoded as its cache then holds them. The questions' decode steps read the long prompt's shared
    packed blocks decoded once while the stores hold the same blocks, not once a step. Over KIVI pages
    the K/V a compiled step computes differ from the eager ones by summation order and may round to
    other codes: each sequence equals the cache alone up to a near tie, one step whose token the
    reference scores within ``KIVI_TIE`` of its best (``first_divergence``)."""
    model, tokenizer = smollm2
    decoded, decode = [], compiled_step.decode_blocks
    monkeypatch.setattr(compiled_step, "decode_blocks",
                        lambda *args: decoded.append(tuple(args[3].tolist())) or decode(*args))
    long_prompt = tokenizer("Call me Ishmael. " * 80)["input_ids"]
    prompts = [*ids_of(tokenizer, PROMPTS[:2]), long_prompt]
    questions = [long_prompt + tokenizer(f" Question {i}: in one sentence, {PROMPTS[i]} what? And then, "
                                         "what comes after that, and why does it matter here?")["input_ids"]
                 for i in range(4)]
    config = load_preset(preset)
    engine = Engine(model, tokenizer, config, pool_tokens=4096, compile_step=True)
    outputs = engine.generate(prompts, GREEDY)
    later = engine.generate(questions, GREEDY)
    assert sum(len(q) for q in questions) - sum(output.cached_tokens for output in later) >= GEMM_ROWS
    assert min(output.cached_tokens for output in later) >= len(long_prompt) - 64
    factory = KVCacheFactory(model.config, config)
    for prompt, output in zip(prompts + questions, outputs + later, strict=True):
        parted = first_divergence(model, prompt, output.token_ids, factory.create_cache())
        assert parted is None or (preset == "int4" and parted[1] < KIVI_TIE), parted
    compiled = engine.compiled
    assert (compiled.failure, compiled.recompiles, compiled.steps) == (None, 0, 2 * (GREEDY.max_tokens - 1))
    layers = model.config.num_hidden_layers
    if preset == "int4" and shared_fits(torch.empty(1, 1, 64)):
        _decoded_once_per_blocks(decoded, layers)  # not once a step
    assert engine.stats()["decoded_bytes"] == 0  # dropped once no sequence decodes
    prefill = engine.compiled_prefill  # on a CPU the chunk kernel runs on
    if not shared_fits(torch.empty(1, 1, 64)):
        assert prefill is None
    else:
        assert (prefill.failure, prefill.recompiles, prefill.steps) == (None, 0, 2)
    assert engine.stats()["sequences"] == 0
    if preset == "int4" and shared_fits(torch.empty(1, 1, 64)):
        _shared_blocks_decoded_once_across_flushes(engine, model, config, questions, decoded, monkeypatch)
        _a_failed_step_gives_the_kept_blocks_back(engine, questions, monkeypatch)


def _decoded_once_per_blocks(decoded: list[tuple[int, ...]], layers: int) -> None:
    """Each set of shared packed blocks the decode steps read (``decoded``: the block ids of each decode)
    was decoded once per layer, and each set extends the one before: pages the windows filled with the
    shared prompt's tokens are the prefix cache's, so the blocks every sequence reads grow."""
    counts = Counter(decoded)
    assert decoded and set(counts.values()) == {layers}, counts
    sets = list(counts)
    assert all(later[:len(earlier)] == earlier for earlier, later in zip(sets, sets[1:], strict=False)), sets


def _shared_blocks_decoded_once_across_flushes(engine, model, config, questions, decoded, monkeypatch
                                               ) -> None:
    """The questions again, decoding long enough that their windows flush groups into new packed blocks: the
    shared blocks, pinned while kept decoded, are decoded once per set (the set growing as the windows
    fill pages with the long prompt's tokens, which the prefix cache holds), not once a step, and the
    outputs still equal the cache alone; the pin is given back once no sequence decodes."""
    flushed, flush = [], compiled_step.flush_full_windows
    monkeypatch.setattr(compiled_step, "flush_full_windows",
                        lambda stores, tokens: flushed.append(len(stores)) or flush(stores, tokens))
    pool = engine.manager.pool.block_pools("packed")[0]
    held = pool.refcount.copy()
    before = len(decoded)
    kept = set(decoded)
    outputs = engine.generate(questions, SamplingParams(max_tokens=40, ignore_eos=True))
    assert sum(flushed) >= len(questions) * model.config.num_hidden_layers
    _decoded_once_per_blocks(decoded[before:], model.config.num_hidden_layers)
    assert set(decoded[before:]) - kept  # pages the windows filled with the prompt's tokens joined them
    factory = KVCacheFactory(model.config, config)
    for prompt, output in zip(questions, outputs, strict=True):
        parted = first_divergence(model, prompt, output.token_ids, factory.create_cache())
        assert parted is None or parted[1] < KIVI_TIE, parted
    cached = held > 0  # the prompts' blocks the prefix cache holds: no pin left on them
    assert (pool.refcount[:held.size][cached] <= held[cached]).all() and engine.stats()["decoded_bytes"] == 0


def _a_failed_step_gives_the_kept_blocks_back(engine, questions, monkeypatch) -> None:
    """A compiled decode step whose forward fails ends its requests alone and gives back the shared
    blocks kept decoded (their pin) at once, not at some later idle step."""
    pool = engine.manager.pool.block_pools("packed")[0]
    held = pool.refcount.copy()
    for question in questions:
        engine.add_request(question, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.stats()["decoded_bytes"] == 0 and engine.has_unfinished():
        engine.step()
    assert engine.stats()["decoded_bytes"] > 0 and engine.has_unfinished()

    def broken(*args):
        raise RuntimeError("a broken step")
    monkeypatch.setattr(engine.compiled, "forward", broken)
    failed = engine.step()
    assert sorted(o.finish_reason for o in failed) == ["error"] * len(questions)
    assert not engine.has_unfinished() and engine.stats()["decoded_bytes"] == 0
    cached = held > 0
    assert (pool.refcount[:held.size][cached] <= held[cached]).all()


@pytest.mark.parametrize("preset", ["int8", "int4"])
def test_quantized_pages_reuse_a_cached_prompt_as_computed(smollm2, preset: str) -> None:
    """A second request behind the same long prompt adopts its whole quantized pages and, for KIVI's
    int4, the full-precision window's pages seen when the first prompt was written, and computes only
    the rest; it generates what the same cache computes alone."""
    model, tokenizer = smollm2
    system = tokenizer("Call me Ishmael. " * 40)["input_ids"]
    prompts = [system + tokenizer(f" Chapter {i}: the whale")["input_ids"] for i in (1, 2)]
    config = load_preset(preset)
    engine = Engine(model, tokenizer, config, pool_tokens=4096, max_num_batched_tokens=512)
    outputs = [engine.generate([prompt], GREEDY)[0] for prompt in prompts]
    layout = engine.manager.layout
    shareable = len(prompts[1]) - layout.recompute  # quantized pages alone
    assert outputs[0].cached_tokens == 0 and 0 < outputs[1].cached_tokens
    assert (outputs[1].cached_tokens > shareable) if layout.window else outputs[1].cached_tokens <= shareable
    assert outputs[1].cached_tokens % layout.block_tokens == 0
    factory = KVCacheFactory(model.config, config)
    assert outputs[1].token_ids == greedy_tokens(model, prompts[1], GREEDY.max_tokens, factory.create_cache())
    assert_idle(engine)


def test_quantized_pages_a_window_fills_with_a_cached_prompts_tokens_are_the_cached_ones(smollm2) -> None:
    """Requests behind a cached int4 prompt adopt its quantized pages and the window pages holding its
    last tokens; the groups their windows then encode (the prompt's own tokens again) are replaced by the
    pages the prefix cache holds for those tokens, so they hold the prompt's pages as a later request
    would adopt them, and still generate what the same cache computes alone."""
    model, tokenizer = smollm2
    system = tokenizer("Call me Ishmael. " * 80)["input_ids"]
    prompts = [system + tokenizer(f" Question {i}: in one sentence, {PROMPTS[i]} what? And then, what comes "
                                  "after that, and why does it matter here?")["input_ids"] for i in range(4)]
    config = load_preset("int4")
    engine = Engine(model, tokenizer, config, pool_tokens=8192, max_num_batched_tokens=512)
    engine.generate(prompts[:1], GREEDY)
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts[1:]]
    requests = [engine.requests[request_id] for request_id in ids]
    done = {}
    while not all(request.decoding for request in requests):
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    layout, index = engine.manager.layout, engine.manager.index
    block = layout.block_tokens
    adopted = (min(request.cached_tokens for request in requests) - layout.window) // block
    names = block_hashes(system, block)
    shared = 0
    for request_id in ids:
        held = engine.manager.get(request_id).layers[0].store.sequence_blocks()[0].tolist()
        cached = [index.entries[name].ids[0] for name in names[:len(held)] if name in index.entries]
        assert held[:len(cached)] == cached
        shared = min(shared or len(cached), len(cached))
    assert shared > adopted  # pages the windows encoded again, now the cached ones
    while engine.has_unfinished():
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    factory = KVCacheFactory(model.config, config)
    for request_id, prompt in zip(ids, prompts[1:], strict=True):
        assert done[request_id] == greedy_tokens(model, prompt, GREEDY.max_tokens, factory.create_cache())
    assert_idle(engine)


def test_sequences_behind_one_quantized_prompt_read_it_once_and_answer_as_alone(smollm2, monkeypatch) -> None:
    """Four int4 requests decoding behind the same cached prompt read its shared packed blocks (decoded
    once) and the window pages they adopted with it once per step for all of them (one product for
    every query row) and generate what the same cache computes alone."""
    model, tokenizer = smollm2
    system = tokenizer("Call me Ishmael. " * 80)["input_ids"]
    prompts = [system + tokenizer(f" Chapter {i}: the whale")["input_ids"] for i in range(5)]
    config = load_preset("int4")
    engine = Engine(model, tokenizer, config, pool_tokens=8192, max_num_batched_tokens=512)
    engine.generate(prompts[:1], GREEDY)
    reads, shared = [], ragged_quantized.decode_blocks
    spy = lambda *args: reads.append(args[3].numel()) or shared(*args)  # noqa: E731 (the blocks read at once)
    monkeypatch.setattr(ragged_quantized, "decode_blocks", spy)
    outputs = engine.generate(prompts[1:], GREEDY)
    assert reads and min(reads) * engine.manager.layout.block_tokens >= 128
    factory = KVCacheFactory(model.config, config)
    for prompt, output in zip(prompts[1:], outputs, strict=True):
        assert output.token_ids == greedy_tokens(model, prompt, GREEDY.max_tokens, factory.create_cache())
    assert_idle(engine)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_preemption_keeps_outputs(smollm2, stories, preemption: str) -> None:
    model, tokenizer = smollm2
    prompts, references = stories
    params = SamplingParams(max_tokens=STORY_TOKENS, ignore_eos=True)
    need = max(len(p) for p in prompts) + params.max_tokens
    engine = Engine(model, tokenizer, {"type": "paged", "page_size": 16}, pool_tokens=3 * need,
                    preemption=preemption, prefix_caching=False)
    outputs = engine.generate(prompts, params)
    assert engine.scheduler.preemptions > 0
    assert [output.token_ids for output in outputs] == references
    assert_idle(engine)


def test_prefill_first_steps_never_mix_and_keep_outputs(smollm2, stories) -> None:
    """With ``prefill_first`` a step prefills or decodes, never both, through chunked prompts, new
    arrivals and preemption; outputs still equal each request alone."""
    model, tokenizer = smollm2
    prompts, references = stories
    params = SamplingParams(max_tokens=STORY_TOKENS, ignore_eos=True)
    need = max(len(p) for p in prompts) + params.max_tokens
    engine = Engine(model, tokenizer, {"type": "paged", "page_size": 16}, pool_tokens=3 * need,
                    max_num_batched_tokens=8, prefix_caching=False, prefill_first=True)
    kinds: list[set[bool]] = []
    schedule = engine.scheduler.schedule

    def spy():
        plan = schedule()
        kinds.append({request.decoding for request, _ in plan})
        return plan

    engine.scheduler.schedule = spy
    ids = [engine.add_request(prompt, params) for prompt in prompts[:4]]
    for _ in range(10):
        engine.step()
    ids += [engine.add_request(prompt, params) for prompt in prompts[4:]]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert all(len(step) == 1 for step in kinds if step)
    assert {True, False} <= set().union(*kinds) and engine.scheduler.preemptions > 0
    assert [done[request_id] for request_id in ids] == references
    assert_idle(engine)


def test_shared_system_prompt_is_prefilled_once(smollm2) -> None:
    model, tokenizer = smollm2
    system = "You are a helpful assistant who answers briefly and precisely. " * 4
    prompts = ids_of(tokenizer, [system + q for q in ("What is 2+2?", "Name a colour.", "Who wrote Hamlet?")])
    engine = Engine(model, tokenizer, {"type": "paged", "page_size": 16}, pool_tokens=2048)
    first = engine.generate(prompts[:1], GREEDY)[0]
    rest = engine.generate(prompts[1:], GREEDY)
    shared = len(tokenizer(system)["input_ids"]) // 16 * 16
    assert first.cached_tokens == 0 and all(o.cached_tokens >= shared - 16 for o in rest)
    for prompt, output in zip(prompts, [first, *rest], strict=True):
        assert output.token_ids == greedy_tokens(model, prompt, GREEDY.max_tokens)
    assert_idle(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(smollm2) -> None:
    model, tokenizer = smollm2
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = Engine(model, tokenizer, pool_tokens=2048).generate([PROMPTS[1]], sampled)[0].token_ids
    engine = Engine(model, tokenizer, pool_tokens=2048)
    engine.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=10, temperature=1.0, seed=3))
    again = engine.generate([PROMPTS[0], PROMPTS[1]], sampled)
    assert again[1].token_ids == alone and again[0].token_ids != alone
    top1 = SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    assert engine.generate([PROMPTS[1]], top1)[0].token_ids == \
        engine.generate([PROMPTS[1]], greedy)[0].token_ids


def test_stops_and_streaming_text(smollm2) -> None:
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, pool_tokens=2048)
    full = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=12))[0]
    stop = full.text[4:7]
    cut = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=12, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    pieces = list(engine.stream(PROMPTS[2], SamplingParams(max_tokens=12)))
    assert "".join(p.new_text for p in pieces) == full.text
    assert sum(len(p.new_token_ids) for p in pieces) == len(full.token_ids)
    assert pieces[-1].finished and not any(p.finished for p in pieces[:-1])


def test_abort_gives_blocks_back(smollm2) -> None:
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, pool_tokens=2048, prefix_caching=False)
    first = engine.add_request(PROMPTS[1], GREEDY)
    engine.add_request(PROMPTS[2], GREEDY)
    engine.step()
    assert engine.stats()["pool_blocks_used"] > 0
    output = engine.abort(first)
    assert output.finished and output.finish_reason == "abort"
    assert [o for o in engine.step() if o.request_id == first] == [output]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["pool_blocks_used"] == 0 and engine.abort(first) is None


def test_admission_errors_name_the_field(smollm2) -> None:
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, pool_tokens=256, max_waiting=1)
    with pytest.raises(AdmissionError) as err:
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=300))
    assert err.value.field == "max_tokens" and "KV pool" in str(err.value)
    with pytest.raises(AdmissionError) as err:
        engine.add_request([1] * 9000, SamplingParams(max_tokens=4))
    assert err.value.field == "prompt" and "8192" in str(err.value)
    with pytest.raises(AdmissionError):
        engine.add_request([], SamplingParams())
    for field, value in (("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5),
                         ("top_k", -2), ("seed", -1)):
        with pytest.raises(ConfigError) as err:
            SamplingParams(**{field: value})
        assert err.value.key == field
    engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(EngineFullError):
        engine.add_request(PROMPTS[1], GREEDY)
    assert engine.stats()["waiting"] == 1
