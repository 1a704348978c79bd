"""Pure scorers for the evaluation tasks: text (or token ids and a decoder) in, a verdict out."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence

PASSKEY_TOKENS = 10  # the protocol: the key must appear within the first 10 generated tokens
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


# Two-sided 95 % quantiles of Student's t, t_{0.975}(df), df = 1..30.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t975(df: int) -> float:
    """Student's t quantile ``t_{0.975}(df)``: a table to df 30, then the Cornish-Fisher expansion."""
    if df < 1:
        raise ValueError(f"df={df}: expected at least 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean and its t-based 95 % confidence interval.

    ``mean ± t_{0.975}(n − 1) · s / √n`` with ``s`` the sample standard deviation (n − 1 in the
    denominator). One value gives NaN bounds (no spread to estimate), no values NaN throughout.
    """
    n = len(values)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    centre = sum(values) / n
    if n == 1:
        return centre, float("nan"), float("nan")
    sd = math.sqrt(sum((v - centre) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return centre, centre - half, centre + half


def paired_ppl(nlls: Sequence[float], base_nlls: Sequence[float], tokens: Sequence[int]) -> dict[str, object]:
    """ΔPPL of a config against the baseline on the same windows, paired window by window.

    ``nlls[i]`` and ``base_nlls[i]`` are the summed NLL (nats) of the same ``tokens[i]`` scored
    tokens of window ``i``. Returned (percent):

    - ``window_delta_ppl_pct``: each window's relative ΔPPL, ``100 · (PPL_i / PPL_base,i − 1)`` =
      ``100 · (exp((nll_i − base_i) / tokens_i) − 1)``;
    - ``delta_ppl_pct_mean`` and ``delta_ppl_pct_ci`` (``[low, high]``): their mean and its paired
      t-based 95 % confidence interval (``mean_ci``, ``n − 1`` degrees of freedom, windows as the
      unit of sampling);
    - ``delta_ppl_pct``: the pooled relative ΔPPL, ``100 · (exp((Σ nll − Σ base) / Σ tokens) − 1)``,
      the ratio of the perplexities over all scored tokens.
    """
    if not len(nlls) == len(base_nlls) == len(tokens) or not nlls:
        raise ValueError(f"{len(nlls)} windows against {len(base_nlls)} baseline windows "
                         f"({len(tokens)} token counts): expected the same windows, at least one")
    per_window = [100.0 * math.expm1((n - b) / t) for n, b, t in zip(nlls, base_nlls, tokens, strict=True)]
    centre, low, high = mean_ci(per_window)
    pooled = 100.0 * math.expm1((sum(nlls) - sum(base_nlls)) / sum(tokens))
    return {"delta_ppl_pct": pooled, "delta_ppl_pct_mean": centre, "delta_ppl_pct_ci": [low, high],
            "window_delta_ppl_pct": per_window}
