"""The evaluation scorers on tiny inputs with known answers, negatives included."""

from __future__ import annotations

import math

import pytest

from kvfactory.eval.scoring import (
    mean_ci,
    needle_correct,
    paired_ppl,
    passkey_correct,
    perplexity,
    recall_correct,
    t975,
)

# a toy tokenizer: token id i decodes to PIECES[i]
PIECES = [" The", " pass", " key", " is", " 12", "345", ".", " 67", "890", " Remember", " it", "!", "6"]


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def ids(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def test_passkey_found_across_tokens() -> None:
    assert passkey_correct(ids(" 12", "345", "."), "12345", decode)
    assert passkey_correct(ids(" The", " pass", " key", " is", " 12", "345"), "12345", decode)


@pytest.mark.parametrize("generated", [
    ids(" 67", "890", "."),  # another key
    ids(" 12", "345", "6"),  # the key inside a longer number
    ids(" 12", "."),  # only a prefix of the key
    [],
])
def test_passkey_wrong_answers(generated: list[int]) -> None:
    assert not passkey_correct(generated, "12345", decode)


def test_passkey_only_counts_the_first_ten_tokens() -> None:
    late = ids(" The", " pass", " key", " is", " Remember", " it", "!", " Remember", " it", "!", " 12", "345")
    assert not passkey_correct(late, "12345", decode)  # the key starts at token 11
    assert passkey_correct(late[2:], "12345", decode)  # the key within tokens 9-10
    assert not passkey_correct(ids(" 12", "345"), "12345", decode, tokens=1)


def test_passkey_rejects_a_non_numeric_key() -> None:
    with pytest.raises(ValueError, match="digits"):
        passkey_correct(ids(" 12"), "12.45", decode)


@pytest.mark.parametrize(("answer", "correct"), [
    (" to eat a sandwich and sit in Dolores Park on a sunny day.", True),
    ("EAT A SANDWICH in\nDolores   park", True),
    ("eat a sandwich and go to the beach", False),  # half the answer
    ("sit in Dolores Park", False),
    ("Dolores and a park, with a sandwich", False),  # the words, not the phrase
    ("", False),
])
def test_needle(answer: str, correct: bool) -> None:
    assert needle_correct(answer) is correct


@pytest.mark.parametrize(("reply", "answer", "correct"), [
    (" Chloe.", "Chloe", True),
    ("Your sister is called CHLOE, I think", "Chloe", True),
    (" 4721.", "4721", True),
    (" Emily.", "Chloe", False),
    (" Chloes.", "Chloe", False),  # not the whole word
    (" 47210", "4721", False),  # not the whole number
    (" 472", "4721", False),
    ("", "teal", False),
])
def test_recall(reply: str, answer: str, correct: bool) -> None:
    assert recall_correct(reply, answer) is correct


def test_perplexity() -> None:
    assert perplexity(10 * math.log(5.0), 10) == pytest.approx(5.0)
    assert perplexity(0.0, 3) == 1.0
    with pytest.raises(ValueError, match="at least one"):
        perplexity(1.0, 0)


def test_t_quantiles() -> None:
    assert t975(1) == 12.706 and t975(3) == 3.182 and t975(30) == 2.042
    assert t975(40) == pytest.approx(2.021, abs=1e-3) and t975(120) == pytest.approx(1.980, abs=1e-3)
    with pytest.raises(ValueError):
        t975(0)


def test_mean_ci_on_known_numbers() -> None:
    centre, low, high = mean_ci([0.23, 0.73, 0.84, 1.19])  # per-window ΔPPL % of 4 windows
    sd = 0.396852  # sample standard deviation (n - 1)
    assert centre == pytest.approx(0.7475)
    assert (low, high) == pytest.approx((0.7475 - 3.182 * sd / 2, 0.7475 + 3.182 * sd / 2), abs=1e-4)
    assert (low, high) == pytest.approx((0.1161, 1.3789), abs=1e-4)
    assert mean_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    assert mean_ci([1.0])[0] == 1.0 and math.isnan(mean_ci([1.0])[1]) and math.isnan(mean_ci([])[0])


def test_paired_ppl() -> None:
    tokens = [512, 512, 512, 512]
    base = [1000.0, 1200.0, 900.0, 1100.0]
    nll = [b + t * math.log(1 + d / 100) for b, t, d in zip(base, tokens, [1.0, 2.0, 3.0, 4.0], strict=True)]
    out = paired_ppl(nll, base, tokens)
    assert out["window_delta_ppl_pct"] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert out["delta_ppl_pct_mean"] == pytest.approx(2.5)
    half = 3.182 * math.sqrt(5 / 3) / 2  # t(0.975, 3) * sd / sqrt(4), sd of 1, 2, 3, 4
    assert out["delta_ppl_pct_ci"] == pytest.approx([2.5 - half, 2.5 + half])
    pooled = 100 * (math.exp((sum(nll) - sum(base)) / 2048) - 1)
    assert out["delta_ppl_pct"] == pytest.approx(pooled) and 2.4 < pooled < 2.5  # geometric, not arithmetic
    same = paired_ppl(base, base, tokens)
    assert same["delta_ppl_pct"] == 0 and same["delta_ppl_pct_ci"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="same windows"):
        paired_ppl(nll[:3], base, tokens)
