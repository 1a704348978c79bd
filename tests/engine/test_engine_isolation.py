"""One request's failure inside a step ends that request alone: a draw the sampler cannot make, logits
that are not finite, an admission that fails, a forward that raises. Every other request finishes
with the tokens it would have had alone, and no block stays held."""

from __future__ import annotations

import pytest
from helpers import greedy_tokens
from test_engine_smollm2 import PROMPTS, assert_idle, ids_of

from kvfactory.engine import AdmissionError, Engine, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def unchecked(**values: object) -> SamplingParams:
    """Sampling parameters past their own checks: what a validation gap would let through."""
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


@pytest.fixture(scope="module")
def expected(smollm2) -> list[list[int]]:
    model, tokenizer = smollm2
    return [greedy_tokens(model, prompt, GREEDY.max_tokens) for prompt in ids_of(tokenizer, PROMPTS[:3])]


def run(engine: Engine, ids: list[str]) -> dict[str, object]:
    """Step to the end; each request's final output."""
    final = {}
    while engine.has_unfinished():
        final |= {o.request_id: o for o in engine.step() if o.finished}
    assert set(final) == set(ids)
    return final


def finished(engine: Engine, reason: str) -> float:
    return engine.metrics.registry.get_sample_value("kvfactory_requests_finished_total", {"reason": reason})


@pytest.mark.parametrize("poison, says", [({"temperature": 1e-320}, "probability tensor"),
                                          ({"seed": 2**64}, "Overflow")])
def test_a_draw_that_fails_ends_its_request_alone(smollm2, expected, poison, says) -> None:
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, pool_tokens=2048)
    prompts = ids_of(tokenizer, PROMPTS[:3])
    ids = [engine.add_request(prompts[0], GREEDY), engine.add_request(PROMPTS[3], unchecked(**poison)),
           *(engine.add_request(p, GREEDY) for p in prompts[1:])]
    final = run(engine, ids)
    poisoned = final.pop(ids[1])
    assert poisoned.finish_reason == "error" and says in poisoned.error, poisoned
    assert [final[i].token_ids for i in ids[:1] + ids[2:]] == expected
    assert finished(engine, "error") == 1 and finished(engine, "abort") is None
    assert_idle(engine)


def test_logits_that_are_not_finite_end_their_request_alone(smollm2, expected) -> None:
    """The K/V of one sequence turned to NaN (as a memory fault would): its logits are NaN, it fails;
    the others, in the same packed forwards, decode as they would alone."""
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, pool_tokens=2048, prefix_caching=False)
    prompts = ids_of(tokenizer, PROMPTS[:3])
    ids = [engine.add_request(p, GREEDY) for p in prompts] + [engine.add_request(PROMPTS[3], GREEDY)]
    engine.step()  # every prompt prefilled, one token each
    for layer in engine.manager.get(ids[3]).layers:
        pool, blocks, _, _ = layer.store.pages_in_place()
        pool.k[:, blocks] = float("nan")
    final = run(engine, ids)
    assert final[ids[3]].finish_reason == "error" and "not finite" in final[ids[3]].error
    assert [final[i].token_ids for i in ids[:3]] == expected
    assert_idle(engine)


def test_an_admission_that_fails_ends_its_request_alone(smollm2, expected) -> None:
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, pool_tokens=2048)
    created = []

    def hook(cache) -> None:  # a watcher of new caches that breaks on the second one
        created.append(cache)
        if len(created) == 2:
            raise OSError("the watcher's disk is full")

    engine.on_new_cache(hook)
    prompts = ids_of(tokenizer, PROMPTS[:3])
    ids = [engine.add_request(prompts[0], GREEDY), engine.add_request(PROMPTS[3], GREEDY),
           *(engine.add_request(p, GREEDY) for p in prompts[1:])]
    final = run(engine, ids)
    assert final[ids[1]].finish_reason == "error" and "disk is full" in final[ids[1]].error
    assert [final[i].token_ids for i in ids[:1] + ids[2:]] == expected
    assert_idle(engine)


def test_a_forward_that_fails_ends_the_requests_in_it_only(smollm2, expected) -> None:
    """A fault in the shared forward cannot be put on one request: the requests in that forward fail,
    the one waiting for a slot runs afterwards as it would alone."""
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, pool_tokens=2048, max_num_seqs=2)
    prompts = ids_of(tokenizer, PROMPTS[:3])
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    calls = []

    def fault(module, args, output) -> None:
        calls.append(1)
        if len(calls) == 3:  # the third forward: both running requests decode in it
            raise RuntimeError("a kernel fault")

    handle = model.model.layers[5].register_forward_hook(fault)
    try:
        final = run(engine, ids)
    finally:
        handle.remove()
    assert [final[i].finish_reason for i in ids[:2]] == ["error", "error"]
    assert "a kernel fault" in final[ids[0]].error
    assert final[ids[2]].token_ids == expected[2]
    assert_idle(engine)


def test_prompts_that_are_not_unicode_are_admission_errors(smollm2) -> None:
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, pool_tokens=256)
    with pytest.raises(AdmissionError) as err:
        engine.add_request("\ud800abc", GREEDY)
    assert err.value.field == "prompt" and "surrogate" in str(err.value) and "character 0" in str(err.value)
