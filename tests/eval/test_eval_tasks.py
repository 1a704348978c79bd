"""The evaluation tasks end to end: a tiny random Llama through several caches, a scripted stand-in
model with known answers (does each task score what the model said against the right answer?), and
one real SmolLM2 passkey."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch
from tiny_models import tiny_model
from tiny_tokenizer import VOCAB, tiny_tokenizer
from transformers import DynamicCache, GenerationConfig

from kvfactory import KVCacheFactory
from kvfactory.eval.data import (
    Corpus,
    chat_prompts,
    needle_prompts,
    passkey_prompts,
    perplexity_windows,
    split_question,
)
from kvfactory.eval.tasks import run_multiturn, run_needle, run_passkey, run_perplexity
from kvfactory.texts import shipped_text

CACHES = {"dynamic": None, "dense": {"type": "dense"}, "paged16": {"type": "paged", "page_size": 16}}
TIMINGS = ("prefill_s", "decode_s")


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(shipped_text(), "shipped")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=4096)


def make_cache(model, name: str):
    if CACHES[name] is None:
        return lambda: DynamicCache(config=model.config)
    return KVCacheFactory(model.config, CACHES[name]).create_cache


def quality(records) -> list[dict]:
    """Records without their timings: what must repeat exactly."""
    return [{k: v for k, v in asdict(r).items() if k not in TIMINGS} for r in records]


def test_perplexity_matches_one_forward_and_every_cache(model, corpus) -> None:
    windows = perplexity_windows(tiny_tokenizer(), corpus, 200, 40, windows=2)
    results = {name: run_perplexity(model, make_cache(model, name), windows) for name in CACHES}
    for window, result in zip(windows, results["dynamic"], strict=True):
        ids = torch.tensor([window.input_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, 199:239].double()
        nll = -torch.log_softmax(logits, -1).gather(1, ids[0, 200:, None]).sum().item()
        assert result.nll == pytest.approx(nll, abs=1e-3)
        assert result.ppl == pytest.approx(math.exp(nll / 40), rel=1e-5)
        assert (result.prefill_tokens, result.scored_tokens, result.decode_steps) == (200, 40, 39)
        assert result.footprint.tokens_seen == 239 and result.footprint.tokens_stored == 239
        assert result.footprint.compression_ratio == 0 and result.footprint.bytes > 0
    for name in ("dense", "paged16"):
        for ref, out in zip(results["dynamic"], results[name], strict=True):
            assert abs(out.ppl - ref.ppl) < 1e-4, name
    assert quality(run_perplexity(model, make_cache(model, "dense"), windows)) == quality(results["dense"])


def test_passkey_and_needle_on_tiny_model(model, corpus) -> None:
    tok = tiny_tokenizer()
    runs = [(run_passkey, passkey_prompts(tok, 400, [0.2, 0.8], keys_per_depth=2)),
            (run_needle, needle_prompts(tok, corpus, 600, [0.2, 0.8]))]
    for run, prompts in runs:
        results = {name: run(model, tok, make_cache(model, name), prompts) for name in ("dynamic", "dense")}
        assert quality(results["dense"]) == quality(run(model, tok, make_cache(model, "dense"), prompts))
        for prompt, ref, out in zip(prompts, results["dynamic"], results["dense"], strict=True):
            assert (out.task, out.depth, out.sample) == (prompt.task, prompt.depth, prompt.sample)
            assert out.expected == prompt.answer
            assert out.output == ref.output and out.correct == ref.correct  # a lossless cache
            assert out.prompt_tokens == prompt.prompt_tokens
            assert out.footprint.tokens_seen == prompt.prompt_tokens + out.decode_steps
            assert out.footprint.bytes > 0 and out.prefill_s > 0


def test_the_question_after_a_compressed_context_is_kept_whole(model, corpus) -> None:
    """kvpress's pipeline: the context is prefilled and compressed, then the question is fed; a
    lossless cache answers the same in both settings."""
    tok = tiny_tokenizer()
    prompts = passkey_prompts(tok, 400, [0.5])
    inside, after = (run_passkey(model, tok, make_cache(model, "dense"), prompts, question_after=flag)
                     for flag in (False, True))
    assert [r.output for r in inside] == [r.output for r in after]
    snap = {"type": "composite", "strategies": [{"name": "dense"}, {"name": "eviction", "policy": "snapkv",
                                                                     "compression_ratio": 0.5}]}
    caches = []

    def make():
        caches.append(KVCacheFactory(model.config, snap).create_cache())
        return caches[-1]

    model.set_attn_implementation("kvfactory")
    try:
        (result,) = run_passkey(model, tok, make, prompts, question_after=True)
    finally:
        model.set_attn_implementation("sdpa")
    context, question = split_question(prompts[0])
    context_tokens = len(tok(context, add_special_tokens=False).input_ids)
    question_tokens = len(tok(question, add_special_tokens=False).input_ids)
    assert caches[0].size(0) == context_tokens // 2 + question_tokens + result.decode_steps
    assert caches[0].get_seq_length() == context_tokens + question_tokens + result.decode_steps


def test_multiturn_on_tiny_model(model, corpus) -> None:
    tok = tiny_tokenizer()
    prompts = chat_prompts(tok, corpus, 1500, facts=3, reply_tokens=8)
    results = {name: run_multiturn(model, tok, make_cache(model, name), prompts, max_new_tokens=8)
               for name in ("dynamic", "paged16")}
    again = run_multiturn(model, tok, make_cache(model, "dynamic"), prompts, max_new_tokens=8)
    assert quality(results["dynamic"]) == quality(again)
    (ref,), (out,) = results["dynamic"], results["paged16"]
    assert out.replies == ref.replies and len(out.replies) == 3 and out.expected == prompts[0].answers
    assert out.total_tokens <= 1500 and out.footprint.tokens_seen == out.total_tokens - 1
    assert out.accuracy == sum(out.correct) / 3


class ScriptedModel:
    """Stands in for a model: each ``generate`` call appends the next scripted reply, recording its input."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies, self.inputs = tokenizer, list(replies), []
        self.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        self.inputs.append(input_ids)
        reply = self.tokenizer(self.replies.pop(0), add_special_tokens=False, return_tensors="pt").input_ids
        return torch.cat([input_ids, reply[:, :max_new_tokens]], dim=1)


def test_passkey_scores_what_the_model_said() -> None:
    tok = tiny_tokenizer()
    prompts = passkey_prompts(tok, 400, [0.5], keys_per_depth=3)
    keys = [p.answer for p in prompts]
    model = ScriptedModel(tok, [f" {keys[0]}.", f" {keys[0]}.", f"{'.' * 10}{keys[2]}"])
    results = run_passkey(model, tok, DynamicCache, prompts)
    assert [r.correct for r in results] == [True, False, False]  # right, another prompt's key, too late
    assert [r.output for r in results] == [f" {keys[0]}.", f" {keys[0]}.", f"{'.' * 10}{keys[2]}"[:10]]


def test_needle_scores_what_the_model_said(corpus) -> None:
    tok = tiny_tokenizer()
    prompts = needle_prompts(tok, corpus, 500, [0.3, 0.6])
    model = ScriptedModel(tok, [" to eat a sandwich and sit in Dolores Park.", " to eat a sandwich."])
    results = run_needle(model, tok, DynamicCache, prompts, max_new_tokens=64)
    assert [r.correct for r in results] == [True, False]


def test_multiturn_scores_each_reply_and_continues_the_conversation(corpus) -> None:
    tok = tiny_tokenizer()
    (prompt,) = chat_prompts(tok, corpus, 1500, facts=3, reply_tokens=24)
    a, b, c = prompt.answers
    replies = [f" {a}.<|im_end|>", " nobody.<|im_end|>", f" a long reply that never ends {c}"]
    model = ScriptedModel(tok, replies)
    (result,) = run_multiturn(model, tok, DynamicCache, [prompt], max_new_tokens=24)
    assert result.correct == (True, False, False)  # the third answer comes after 24 tokens
    assert result.replies == (f" {a}.", " nobody.", " a long reply that never")
    assert result.accuracy == pytest.approx(1 / 3)
    q1, q2, q3 = prompt.questions
    expected = (prompt.history + q1 + replies[0] + "\n" + q2 + replies[1] + "\n" + q3)
    assert tok.decode(model.inputs[2][0]) == expected
    assert result.total_tokens == len(tok(expected + " a long reply that never").input_ids)


@pytest.mark.slow
def test_smollm2_finds_a_passkey_at_512_tokens(smollm2) -> None:
    model, tokenizer = smollm2
    prompts = passkey_prompts(tokenizer, 512, [0.5])
    (result,) = run_passkey(model, tokenizer, lambda: DynamicCache(config=model.config), prompts)
    assert result.correct, result.output
    assert result.footprint.tokens_seen == result.prompt_tokens + 9
