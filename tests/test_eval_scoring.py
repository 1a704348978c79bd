"""The evaluation scorers on tiny inputs with known answers, negatives included."""

from __future__ import annotations

import math

import pytest

from kvfactory.eval.scoring import needle_correct, passkey_correct, perplexity, recall_correct

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
