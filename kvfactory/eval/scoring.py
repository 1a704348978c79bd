"""Pure scorers for the evaluation tasks: text (or token ids and a decoder) in, a verdict out."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence

PASSKEY_TOKENS = 10  # DESIGN.md: the key must appear within the first 10 generated tokens
# Both parts of the needle's answer must appear; either alone is what a model can guess or half-recall.
NEEDLE_KEY_PHRASES = ("sandwich", "dolores park")


def passkey_correct(generated: Sequence[int], key: str, decode: Callable[[list[int]], str],
                    tokens: int = PASSKEY_TOKENS) -> bool:
    """The exact key (not part of a longer number) is in the decoded text of the first ``tokens`` ids."""
    if not key.isdigit():
        raise ValueError(f"passkey {key!r}: expected digits")
    text = decode(list(generated[:tokens]))
    return re.search(rf"(?<!\d){key}(?!\d)", text) is not None


def needle_correct(answer: str, phrases: Sequence[str] = NEEDLE_KEY_PHRASES) -> bool:
    """Every key phrase is in ``answer``, ignoring case and runs of whitespace."""
    text = " ".join(answer.lower().split())
    return all(" ".join(phrase.lower().split()) in text for phrase in phrases)


def recall_correct(reply: str, answer: str) -> bool:
    """``answer`` is in ``reply`` as a whole word (or number), ignoring case."""
    return re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", reply, flags=re.IGNORECASE) is not None


def perplexity(nll_sum: float, tokens: int) -> float:
    """``exp(summed negative log-likelihood / tokens)``."""
    if tokens < 1:
        raise ValueError(f"perplexity of {tokens} tokens: expected at least one")
    return math.exp(nll_sum / tokens)


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean, NaN for no values (an empty table cell, not an error)."""
    return sum(values) / len(values) if values else float("nan")


def accuracy_by_depth(verdicts: Iterable[tuple[float, bool]]) -> dict[str, float]:
    """Accuracy per depth from ``(depth, correct)`` pairs, keyed ``f"{depth:g}"`` in first-seen order."""
    by_depth: dict[str, list[float]] = {}
    for depth, correct in verdicts:
        by_depth.setdefault(f"{depth:g}", []).append(float(correct))
    return {d: mean(v) for d, v in by_depth.items()}
