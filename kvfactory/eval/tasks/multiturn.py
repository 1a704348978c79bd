"""Multi-turn recall: facts stated in the first turn, filler turns, then a question per fact.

The questions are asked in order in one conversation through one cache, each turn's reply staying
in the history, as a chat application would: a cache that forgets the first turn fails them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvfactory.eval.data import ChatPrompt
from kvfactory.eval.footprint import cache_footprint
from kvfactory.eval.scoring import recall_correct
from kvfactory.eval.tasks.result import TaskResult
from kvfactory.measure import timed_generate

REPLY_TOKENS = 24


@dataclass(frozen=True)
class MultiTurnResult(TaskResult):
    """One conversation: a reply and a verdict per fact, costs summed over the turns.

    ``prefill_s`` sums every turn's time to its first token (the first turn's long prefill dominates);
    ``total_tokens`` is the conversation's length at the end.
    """

    prompt_tokens: int
    total_tokens: int
    expected: tuple[str, ...]
    replies: tuple[str, ...]
    correct: tuple[bool, ...]
    accuracy: float


def run_multiturn(model: Any, tokenizer: Any, make_cache: Callable[[], Any], prompts: Sequence[ChatPrompt],
                  max_new_tokens: int = REPLY_TOKENS) -> list[MultiTurnResult]:
    """Every conversation through a fresh cache, greedy replies scored with ``scoring.recall_correct``."""
    return [_converse(model, tokenizer, make_cache(), prompt, max_new_tokens) for prompt in prompts]


def _encode(tokenizer: Any, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def _closing(tokenizer: Any, reply: list[int], turn_end: str, eos: set[int]) -> str:
    """Text that ends the reply's turn: ``turn_end`` less the end-of-turn token the model wrote."""
    if reply and reply[-1] in eos:
        written = tokenizer.decode(reply[-1:])
        if turn_end.startswith(written):
            return turn_end[len(written):]
    return turn_end


@torch.inference_mode()
def _converse(model: Any, tokenizer: Any, cache: Any, prompt: ChatPrompt,
              max_new_tokens: int) -> MultiTurnResult:
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    ids = _encode(tokenizer, prompt.history)
    closing, replies, correct, prefill_s, decode_s, steps = "", [], [], 0.0, 0.0, 0
    for question, answer in zip(prompt.questions, prompt.answers, strict=True):
        ids = torch.cat([ids, _encode(tokenizer, closing + question)], dim=1)
        timing = timed_generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache,
                                max_new_tokens, min_new_tokens=0)
        reply = timing.sequences[0, ids.shape[1]:].tolist()
        ids = timing.sequences
        closing = _closing(tokenizer, reply, prompt.turn_end, eos)
        replies.append(tokenizer.decode(reply, skip_special_tokens=True))
        correct.append(recall_correct(replies[-1], answer))
        prefill_s += timing.prefill_s
        decode_s += timing.decode_s
        steps += len(reply) - 1
    return MultiTurnResult(task=prompt.task, context=prompt.context, sample=prompt.sample,
                           prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps,
                           footprint=cache_footprint(cache), prompt_tokens=prompt.prompt_tokens,
                           total_tokens=ids.shape[1], expected=prompt.answers, replies=tuple(replies),
                           correct=tuple(correct), accuracy=sum(correct) / len(correct))
