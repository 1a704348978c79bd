"""Evaluation text loading and the prompt builders (byte-level tiny tokenizer: one token per byte)."""

from __future__ import annotations

import json
import re

import pytest
from tiny_tokenizer import tiny_tokenizer

from kvfactory.eval import data
from kvfactory.eval.data import (
    NEEDLE,
    Corpus,
    chat_prompts,
    dump_prompts,
    load_wikitext,
    needle_prompts,
    passkey_prompts,
    perplexity_windows,
)
from kvfactory.texts import shipped_text

DEPTHS = [0.0, 0.1, 0.5, 0.9, 1.0]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(shipped_text(), "shipped")


def test_load_wikitext_order(tmp_path, monkeypatch) -> None:
    (tmp_path / data.WIKITEXT_FILE).write_text(" = A = \n text .\n")
    assert load_wikitext(tmp_path).text == " = A = \n text .\n"
    assert load_wikitext(tmp_path / data.WIKITEXT_FILE).source == str(tmp_path / data.WIKITEXT_FILE)
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    assert load_wikitext().source == str(tmp_path / data.WIKITEXT_FILE)
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="KVFACTORY_DATA_DIR"):
        load_wikitext()
    with pytest.raises(FileNotFoundError, match="path"):
        load_wikitext(tmp_path / "missing.txt")
    monkeypatch.delenv(data.DATA_ENV)
    monkeypatch.setattr(data, "_REPO_DATA", tmp_path / "nowhere")
    assert load_wikitext().text == shipped_text()


def test_articles(corpus: Corpus) -> None:
    starts = corpus.articles()
    assert starts[0] == 0 and len(starts) == 5
    assert all(corpus.text[s:].startswith(" = ") and corpus.text[s + 3] != "=" for s in starts)


def test_passkey_prompts() -> None:
    tok = tiny_tokenizer()
    records = passkey_prompts(tok, 700, DEPTHS, keys_per_depth=2, seed=3)
    assert [(r.depth, r.sample) for r in records] == [(d, s) for d in DEPTHS for s in range(2)]
    unit = len(data.PASSKEY_FILLER) + 1
    for r in records:
        assert r.task == "passkey" and re.fullmatch(r"\d{5}", r.answer)
        assert r.prompt_tokens == len(tok(r.prompt).input_ids) and 700 - unit < r.prompt_tokens <= 700
        assert r.prompt.startswith(data.PASSKEY_TASK) and r.prompt.endswith(data.PASSKEY_QUESTION)
        line = data.PASSKEY_LINE.format(key=r.answer)
        before, after = r.prompt.split(line)
        reps_before, reps_after = before.count(data.PASSKEY_FILLER), after.count(data.PASSKEY_FILLER)
        assert reps_before == round(r.depth * (reps_before + reps_after))
    assert len({r.answer for r in records}) == len(records)
    assert passkey_prompts(tok, 700, DEPTHS, keys_per_depth=2, seed=3) == records  # deterministic
    assert passkey_prompts(tok, 700, DEPTHS, keys_per_depth=1, seed=3) == records[::2]  # a stable subset
    assert passkey_prompts(tok, 700, DEPTHS, keys_per_depth=1, seed=4)[0].answer != records[0].answer
    with pytest.raises(ValueError, match="too short"):
        passkey_prompts(tok, 100, [0.5])
    with pytest.raises(ValueError, match="depth"):
        passkey_prompts(tok, 700, [1.5])


def test_needle_prompts(corpus: Corpus) -> None:
    tok = tiny_tokenizer()
    records = needle_prompts(tok, corpus, 3000, DEPTHS, samples_per_depth=2)
    assert [(r.depth, r.sample) for r in records] == [(d, s) for s in range(2) for d in DEPTHS]
    starts = corpus.articles()
    for r in records:
        assert r.task == "needle" and r.answer == data.NEEDLE_ANSWER
        assert r.prompt_tokens == len(tok(r.prompt).input_ids) and 2900 < r.prompt_tokens <= 3000
        assert r.prompt.count(NEEDLE) == 1 and r.prompt.endswith(data.NEEDLE_QUESTION)
        haystack = r.prompt.removesuffix(data.NEEDLE_QUESTION).replace(NEEDLE + " ", "")
        assert corpus.text[starts[r.sample]:].startswith(haystack)
        at = r.prompt.index(NEEDLE)
        assert at == 0 or r.prompt[:at].endswith((" . ", "\n ")), r.prompt[at - 10:at]  # a sentence start
        assert abs(at / len(haystack) - r.depth) < 0.1
    first = [r.prompt.index(NEEDLE) for r in records[:len(DEPTHS)]]
    assert first == sorted(first) and first[0] == 0
    assert needle_prompts(tok, corpus, 3000, DEPTHS, samples_per_depth=2) == records
    with pytest.raises(ValueError, match="articles"):
        needle_prompts(tok, corpus, 900, [0.5], samples_per_depth=6)


def test_needle_seeds_take_their_haystacks_from_other_articles() -> None:
    tok = tiny_tokenizer()
    text = "".join(f" = Article {i} = \n Sentence {i} one . Sentence {i} two .\n" +
                   "".join(f" Line {i}.{j} of the article goes on . And on .\n" for j in range(12))
                   for i in range(25))
    corpus = Corpus(text, "articles")
    starts = corpus.articles()
    assert len(starts) == 25
    for seed in (0, 1, 2):
        records = needle_prompts(tok, corpus, 400, [0.5], samples_per_depth=3, seed=seed)
        for r in records:
            haystack = r.prompt.removesuffix(data.NEEDLE_QUESTION).replace(NEEDLE + " ", "")
            assert text[starts[seed * data.NEEDLE_SEED_STRIDE + r.sample]:].startswith(haystack)
    assert needle_prompts(tok, corpus, 400, [0.5], 3, seed=1) != needle_prompts(tok, corpus, 400, [0.5], 3)
    with pytest.raises(ValueError, match="from article 20"):
        needle_prompts(tok, corpus, 400, [0.5], samples_per_depth=6, seed=2)
    with pytest.raises(ValueError, match="seed"):
        needle_prompts(tok, corpus, 400, [0.5], seed=-1)


def test_chat_prompts(corpus: Corpus) -> None:
    tok = tiny_tokenizer()
    (record,) = chat_prompts(tok, corpus, 3000, facts=5, reply_tokens=24, seed=1)
    assert record.task == "multiturn" and len(record.questions) == len(record.answers) == 5
    assert record.turn_end == "<|im_end|>\n"
    assert record.history.startswith("<|im_start|>user\nPlease remember")
    for answer in record.answers:
        assert answer in record.history.split("<|im_end|>")[0]  # stated in the first turn
    for question in record.questions:
        assert question.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in question
    assert record.history.count(data.FILLER_REPLY) >= 2
    full = sum(len(tok(q + record.turn_end).input_ids) + 24 for q in record.questions)
    assert 3000 - 20 < record.prompt_tokens - len(tok(record.questions[0]).input_ids) + full <= 3000
    assert chat_prompts(tok, corpus, 3000, facts=5, reply_tokens=24, seed=1) == [record]
    assert chat_prompts(tok, corpus, 3000, facts=5, reply_tokens=24, seed=2)[0].answers != record.answers
    assert len(chat_prompts(tok, corpus, 1500, facts=2)[0].answers) == 2
    with pytest.raises(ValueError, match="too short"):
        chat_prompts(tok, corpus, 300)
    with pytest.raises(ValueError, match="facts"):
        chat_prompts(tok, corpus, 1500, facts=len(data.FACTS) + 1)


def test_window_starts_spread_over_the_text() -> None:
    assert data.window_starts(1000, 100, 4) == [75, 325, 575, 825]  # centred in each quarter
    assert data.window_starts(1000, 250, 4) == [0, 250, 500, 750]  # exactly filled: adjacent, no overlap
    assert data.window_starts(1000, 100, 1) == [450]
    with pytest.raises(ValueError, match="need 1004 tokens, the text holds 1000"):
        data.window_starts(1000, 251, 4)


def test_perplexity_windows(corpus: Corpus) -> None:
    tok = tiny_tokenizer()
    windows = perplexity_windows(tok, corpus, 2048, 512, windows=4)
    ids = tok(corpus.text, add_special_tokens=False)["input_ids"]  # the text as one document
    total = len(ids)
    assert [(w.sample, w.prefill, len(w.input_ids), w.text_tokens) for w in windows] == [
        (i, 2048, 2560, total) for i in range(4)]
    starts = [w.offset for w in windows]
    assert all(b - a >= 2560 for a, b in zip(starts, starts[1:], strict=False))  # no overlap
    assert all(i * total / 4 <= s and s + 2560 <= (i + 1) * total / 4 for i, s in enumerate(starts))  # spread
    assert starts[-1] - starts[0] > total / 2  # not adjacent: from the first quarter to the last
    assert all(w.input_ids == tuple(ids[w.offset:w.offset + 2560]) for w in windows)
    assert perplexity_windows(tok, corpus, 2048, 512, windows=4) == windows  # a pure function
    with pytest.raises(ValueError, match="tokens"):
        perplexity_windows(tok, Corpus("short text", "tiny"), 100, 20)
    with pytest.raises(ValueError, match="the text holds"):
        perplexity_windows(tok, corpus, 2048, 512, windows=40)


def test_second_text_loads() -> None:
    alice = data.load_alice()
    assert alice.text.startswith("ALICE'S ADVENTURES IN WONDERLAND")
    assert alice.text.rstrip().endswith("THE END")
    assert "gutenberg" not in alice.text.lower()  # the licence header and footer removed
    assert "Alice" in alice.source
    assert data.load_text("alice") == alice and data.load_text("wikitext") == load_wikitext()
    windows = perplexity_windows(tiny_tokenizer(), alice, 2048, 512, windows=4)
    assert len(windows) == 4 and windows[0].text_tokens > 100_000


def test_load_text_path_and_errors(tmp_path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("Call me Ishmael.\n", encoding="utf-8")
    assert data.load_text(path) == Corpus("Call me Ishmael.\n", str(path))
    assert data.load_text(str(path)).text == "Call me Ishmael.\n"
    with pytest.raises(FileNotFoundError, match="wikitext, alice"):
        data.load_text("no-such-text")


def test_dump_prompts(tmp_path, corpus: Corpus) -> None:
    tok = tiny_tokenizer()
    records = passkey_prompts(tok, 400, [0.5]) + chat_prompts(tok, corpus, 1200, facts=2)
    path = tmp_path / "prompts.jsonl"
    dump_prompts(records, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["task"] for row in rows] == ["passkey", "multiturn"]
    assert rows[0]["prompt"] == records[0].prompt and rows[1]["answers"] == list(records[1].answers)
