"""Passkey and needle retrieval: greedy generation after a long plain prompt, scored by ``scoring``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvfactory.eval.data import RetrievalPrompt, split_question
from kvfactory.eval.footprint import cache_footprint
from kvfactory.eval.scoring import PASSKEY_TOKENS, needle_correct, passkey_correct
from kvfactory.eval.tasks.result import TaskResult
from kvfactory.measure import timed_generate

NEEDLE_NEW_TOKENS = 24  # the answer "eat a sandwich and sit in Dolores Park" takes about 12


@dataclass(frozen=True)
class RetrievalResult(TaskResult):
    """One prompt's generated text and its verdict."""

    depth: float
    prompt_tokens: int
    expected: str
    output: str
    correct: bool


def run_passkey(model: Any, tokenizer: Any, make_cache: Callable[[], Any], prompts: Sequence[RetrievalPrompt],
                max_new_tokens: int = PASSKEY_TOKENS, question_after: bool = False) -> list[RetrievalResult]:
    """Greedy answers to passkey prompts; correct when the key is in the first 10 generated tokens."""

    def score(generated: list[int], prompt: RetrievalPrompt) -> bool:
        return passkey_correct(generated, prompt.answer, tokenizer.decode)

    return [_retrieve(model, tokenizer, make_cache(), p, "passkey", max_new_tokens, score, question_after)
            for p in prompts]


def run_needle(model: Any, tokenizer: Any, make_cache: Callable[[], Any], prompts: Sequence[RetrievalPrompt],
               max_new_tokens: int = NEEDLE_NEW_TOKENS,
               question_after: bool = False) -> list[RetrievalResult]:
    """Greedy answers to needle prompts; correct when the answer holds ``scoring.NEEDLE_KEY_PHRASES``."""

    def score(generated: list[int], prompt: RetrievalPrompt) -> bool:
        return needle_correct(tokenizer.decode(generated, skip_special_tokens=True))

    return [_retrieve(model, tokenizer, make_cache(), p, "needle", max_new_tokens, score, question_after)
            for p in prompts]


@torch.inference_mode()
def _retrieve(model: Any, tokenizer: Any, cache: Any, prompt: RetrievalPrompt, task: str, max_new_tokens: int,
              score: Callable[[list[int], RetrievalPrompt], bool], question_after: bool) -> RetrievalResult:
    """One answer. ``question_after``: the context is prefilled (and compressed) first, then the
    question is fed as kvpress's pipeline does (context and question tokenised apart)."""
    if prompt.task != task:
        raise ValueError(f"a {prompt.task} prompt given to the {task} task")
    start = time.perf_counter()
    if question_after:
        context, question = split_question(prompt)
        context_ids = tokenizer(context, return_tensors="pt", add_special_tokens=False).input_ids
        question_ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids
        model(input_ids=context_ids, cache=cache, use_cache=True, logits_to_keep=1)
        end_prefill = getattr(cache, "end_prefill", None)
        if end_prefill is not None:
            end_prefill()
        inputs = {"input_ids": torch.cat([context_ids, question_ids], dim=1)}
    else:
        inputs = dict(tokenizer(prompt.prompt, return_tensors="pt"))
    context_s = time.perf_counter() - start
    timing = timed_generate(model, inputs, cache, max_new_tokens, min_new_tokens=0)
    generated = timing.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return RetrievalResult(task=task, context=prompt.context, sample=prompt.sample,
                           prefill_s=context_s + timing.prefill_s, decode_s=timing.decode_s,
                           decode_steps=timing.new_tokens - 1, footprint=cache_footprint(cache),
                           depth=prompt.depth, prompt_tokens=inputs["input_ids"].shape[1],
                           expected=prompt.answer, correct=score(generated, prompt),
                           output=tokenizer.decode(generated, skip_special_tokens=True))
