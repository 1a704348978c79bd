"""Evaluation text and prompts: WikiText-2 test, a held-out book, and deterministic prompt builders.

Two evaluation texts, neither used by any training in this project (the router trains on the
books in ``shared/data``): ``wikitext`` (the WikiText-2 test split, ``load_wikitext``) and
``alice`` (Lewis Carroll, *Alice's Adventures in Wonderland*, shipped in ``kvfactory/data``;
``load_alice``). ``load_text`` takes either name or a path to a UTF-8 file.

Builders return frozen dataclass records (prompt text or token ids, the expected answer, depth and
context) that ``dump_prompts`` writes as JSON lines, so a script in another virtualenv (NVIDIA
kvpress) can feed the very same prompts to its own caches. Every builder is a pure function of its
arguments: random values come from ``random.Random`` seeded with a string naming the task, seed,
context and sample, so asking for more samples never changes the ones already drawn.

Lengths are counted with the tokenizer: a passkey or needle prompt holds at most ``context`` tokens
(short of it by less than one filler repetition, or a few tokens), a conversation with all its
questions and replies at most ``context`` (short of it by less than a word).
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvfactory.texts import shipped_text

DATA_ENV = "KVFACTORY_DATA_DIR"
WIKITEXT_FILE = "wikitext2_test.txt"
ALICE_FILE = "alice_in_wonderland.txt"  # in kvfactory/data: Project Gutenberg #11, public domain
# ``<repo>/../shared/data`` for a source checkout (``kvfactory/eval/data.py`` is three levels down).
_REPO_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"

# Passkey retrieval in the landmark-attention format (Mohtashami & Jaggi, 2023), plain prompt.
PASSKEY_TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                "them. I will quiz you about the important information there.")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"

# Needle in a haystack (Kamradt, 2023) in WikiText, with an answer prefix as the passkey prompt has.
NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
NEEDLE_ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
NEEDLE_QUESTION = ("\nQuestion: What is the best thing to do in San Francisco?\n"
                   "Answer: The best thing to do in San Francisco is")

# Multi-turn recall: (statement, question, answer prefix, values); ``None`` values mean a random
# 4-digit code. Values avoid what SmolLM2 answers unprompted ("Emily", "London", "blue"). Like the
# passkey and needle prompts, each question ends with an answer prefix (written after the assistant
# header): without it SmolLM2-135M declines to answer even with no filler at all.
FACTS: tuple[tuple[str, str, str, tuple[str, ...] | None], ...] = (
    ("My sister's name is {}.", "What is my sister's name?", "Your sister's name is",
     ("Ingrid", "Maria", "Chloe", "Hannah", "Sofia")),
    ("My locker code is {}.", "What is my locker code?", "Your locker code is", None),
    ("My dog is called {}.", "What is my dog called?", "Your dog is called",
     ("Biscuit", "Pepper", "Rocky", "Milo", "Ziggy")),
    ("I was born in {}.", "In which city was I born?", "You were born in",
     ("Lisbon", "Oslo", "Nairobi", "Osaka", "Lima")),
    ("My favourite colour is {}.", "What is my favourite colour?", "Your favourite colour is",
     ("teal", "purple", "orange", "maroon")),
    ("I work as a {}.", "What is my job?", "You work as a",
     ("baker", "pilot", "nurse", "plumber", "librarian")),
)
FACTS_TURN = "Please remember these facts about me:\n{facts}"
FACTS_REPLY = "Got it, I will remember them."
FILLER_TURN = "Here is a passage to read:\n{paragraph}"
FILLER_REPLY = "Thank you, I have read it."

_HEADING = re.compile(r"^ = [^=].* = $")  # a WikiText article title line
_SENTENCE_START = re.compile(r"(?: \. |\n ?)(?=\S)")  # WikiText writes "word . Next"


@dataclass(frozen=True)
class Corpus:
    """Evaluation text and where it came from (a file path, or the excerpt shipped in the package)."""

    text: str
    source: str

    def articles(self) -> list[int]:
        """Character offsets at which WikiText articles (their title lines) start."""
        starts, offset = [], 0
        for line in self.text.splitlines(keepends=True):
            if _HEADING.match(line.rstrip("\n")):
                starts.append(offset)
            offset += len(line)
        return starts or [0]


@dataclass(frozen=True)
class RetrievalPrompt:
    """A passkey or needle prompt: plain text (no chat template), tokenized with the tokenizer's defaults."""

    task: str
    context: int
    depth: float
    sample: int
    prompt: str
    answer: str
    prompt_tokens: int


@dataclass(frozen=True)
class ChatPrompt:
    """A multi-turn conversation, every piece already rendered with the tokenizer's chat template.

    ``history`` holds the facts turn and the filler turns; ``questions[i]`` is a user turn, the
    assistant header and an answer prefix ("Your locker code is"). The questions are asked in
    order in one conversation: after each reply, append ``turn_end`` (without its end-of-turn token
    if the reply ended with it) and the next question. Tokenize the pieces without special tokens
    (the template wrote them).
    """

    task: str
    context: int
    sample: int
    history: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    turn_end: str
    prompt_tokens: int


@dataclass(frozen=True)
class PerplexityWindow:
    """Token ids of one window of the text: ``prefill`` tokens of context, then the tokens to score.

    ``offset`` is the token index of the window's first token in the whole text (tokenized as one
    document) and ``text_tokens`` that text's length in tokens: where in the text the window lies.
    """

    task: str
    context: int
    sample: int
    input_ids: tuple[int, ...]
    prefill: int
    offset: int = 0
    text_tokens: int = 0


def load_wikitext(path: str | Path | None = None) -> Corpus:
    """The WikiText-2 test text.

    ``path`` is the file or a folder holding ``wikitext2_test.txt``. Without it: ``$KVFACTORY_DATA_DIR``,
    then ``shared/data`` next to a source checkout, then the excerpt shipped in the package
    (``kvfactory.texts.shipped_text()``, about 18k tokens). An explicit path or environment variable
    that does not hold the file raises ``FileNotFoundError``.
    """
    chosen = path if path is not None else os.environ.get(DATA_ENV)
    if chosen is not None:
        file = Path(chosen)
        file = file / WIKITEXT_FILE if file.is_dir() else file
        if not file.is_file():
            origin = "path" if path is not None else f"${DATA_ENV}"
            raise FileNotFoundError(f"{origin} {chosen}: no file {file} (expected {WIKITEXT_FILE} "
                                    f"or the folder holding it)")
        return Corpus(file.read_text(encoding="utf-8"), str(file))
    if (_REPO_DATA / WIKITEXT_FILE).is_file():
        file = _REPO_DATA / WIKITEXT_FILE
        return Corpus(file.read_text(encoding="utf-8"), str(file))
    return Corpus(shipped_text(), "kvfactory/data/wikitext2_excerpt.txt (shipped excerpt)")


def load_alice() -> Corpus:
    """*Alice's Adventures in Wonderland* (Project Gutenberg #11), shipped in ``kvfactory/data``.

    Public domain; the Project Gutenberg header and footer are removed (``kvfactory/data/README.md``
    says where the file comes from). About 39k SmolLM2 tokens (WikiText-2 test: 302k), room for
    15 windows of 2048 + 512.
    """
    from importlib import resources

    text = resources.files("kvfactory").joinpath("data", ALICE_FILE).read_text(encoding="utf-8")
    return Corpus(text, f"Alice's Adventures in Wonderland (Lewis Carroll, Project Gutenberg #11), "
                        f"kvfactory/data/{ALICE_FILE}")


TEXTS: dict[str, Callable[[], Corpus]] = {"wikitext": load_wikitext, "alice": load_alice}


def load_text(name: str | Path = "wikitext") -> Corpus:
    """An evaluation text by name (``wikitext``, ``alice``) or the UTF-8 file at path ``name``."""
    if str(name) in TEXTS:
        return TEXTS[str(name)]()
    file = Path(name)
    if not file.is_file():
        raise FileNotFoundError(f"text {str(name)!r}: expected one of {', '.join(TEXTS)} or a UTF-8 file")
    return Corpus(file.read_text(encoding="utf-8"), str(file))


def dump_prompts(records: Iterable[Any], path: str | Path) -> None:
    """Write prompt (or result) dataclass records to ``path`` as JSON lines, one record a line."""
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")


def _count(tokenizer: Any, text: str, special: bool = True) -> int:
    return len(tokenizer(text, add_special_tokens=special)["input_ids"])


def _largest(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The largest ``n`` in ``[low, high]`` found by bisection with ``fits(n)``, given ``fits(low)``."""
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def split_question(prompt: RetrievalPrompt) -> tuple[str, str]:
    """``(context, question)`` of a passkey or needle prompt: the task's question (with its answer
    prefix) is the prompt's end, as kvpress's pipeline feeds it after the compressed context."""
    question = {"passkey": PASSKEY_QUESTION, "needle": NEEDLE_QUESTION}[prompt.task]
    if not prompt.prompt.endswith(question):
        raise ValueError(f"{prompt.task} prompt (sample {prompt.sample}) does not end with its question")
    return prompt.prompt[:-len(question)], question


def _check_depth(depth: float) -> None:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth}: expected a fraction of the context in [0, 1]")


def _passkey_text(repetitions: int, depth: float, key: str) -> str:
    before = round(depth * repetitions)
    return "\n".join([PASSKEY_TASK, " ".join([PASSKEY_FILLER] * before), PASSKEY_LINE.format(key=key),
                      " ".join([PASSKEY_FILLER] * (repetitions - before)), PASSKEY_QUESTION])


def passkey_prompts(tokenizer: Any, context: int, depths: Iterable[float], keys_per_depth: int = 1,
                    seed: int = 0) -> list[RetrievalPrompt]:
    """Passkey prompts of at most ``context`` tokens: ``keys_per_depth`` random 5-digit keys per depth.

    The filler is repeated whole; the key line sits after ``round(depth * repetitions)`` of them.
    """
    unit = _count(tokenizer, " " + PASSKEY_FILLER, special=False)
    records = []
    for depth in depths:
        _check_depth(depth)
        for sample in range(keys_per_depth):
            key = str(random.Random(f"passkey/{seed}/{context}/{depth}/{sample}").randint(10000, 99999))
            if _count(tokenizer, _passkey_text(0, depth, key)) > context:
                raise ValueError(f"context {context}: too short for the passkey task and question")
            reps = _largest(0, context // unit + 1,
                            lambda n, d=depth, k=key: _count(tokenizer, _passkey_text(n, d, k)) <= context)
            prompt = _passkey_text(reps, depth, key)
            records.append(RetrievalPrompt("passkey", context, depth, sample, prompt, key,
                                           _count(tokenizer, prompt)))
    return records


def _tokens(tokenizer: Any, corpus: Corpus, start: int, tokens: int) -> tuple[list[int], list[int]]:
    """Ids and end offsets (relative to ``start``) of the first ``tokens`` tokens from character ``start``."""
    margin, chars = 16, 8 * tokens  # tokens near the cut may differ from the whole text's: keep a margin
    while True:
        encoded = tokenizer(corpus.text[start:start + chars], return_offsets_mapping=True,
                            add_special_tokens=False)
        complete = start + chars >= len(corpus.text)
        if len(encoded["input_ids"]) >= tokens + margin or complete:
            break
        chars *= 2
    available = len(encoded["input_ids"]) - (0 if complete else margin)
    if available < tokens:
        raise ValueError(f"{corpus.source}: only {available} tokens from character {start}, {tokens} needed")
    return encoded["input_ids"][:tokens], [end for _, end in encoded["offset_mapping"][:tokens]]


class _Haystack:
    """WikiText from one article on, with the needle inserted at a sentence start."""

    def __init__(self, tokenizer: Any, corpus: Corpus, start: int, context: int):
        self.tokenizer, self.context = tokenizer, context
        _, self.ends = _tokens(tokenizer, corpus, start, context)
        self.text = corpus.text[start:start + self.ends[-1]]
        self.starts = [0] + [m.end() for m in _SENTENCE_START.finditer(self.text)]

    def prompt(self, tokens: int, depth: float) -> str:
        """The first ``tokens`` tokens, the needle at the sentence start nearest ``depth``, the question."""
        end = self.ends[tokens - 1]
        target = self.ends[round(depth * (tokens - 1))]
        at = min((s for s in self.starts if s <= end), key=lambda s: abs(s - target))
        return self.text[:at] + NEEDLE + " " + self.text[at:end] + NEEDLE_QUESTION

    def fitted(self, depth: float) -> str:
        """The longest prompt at ``depth`` within the context."""
        def fits(tokens: int) -> bool:
            return _count(self.tokenizer, self.prompt(tokens, depth)) <= self.context

        if not fits(1):
            raise ValueError(f"context {self.context}: too short for the needle and question")
        return self.prompt(_largest(1, self.context, fits), depth)


NEEDLE_SEED_STRIDE = 10  # articles between the first haystacks of consecutive seeds


def needle_prompts(tokenizer: Any, corpus: Corpus, context: int, depths: Iterable[float],
                   samples_per_depth: int = 1, seed: int = 0) -> list[RetrievalPrompt]:
    """Needle prompts of at most ``context`` tokens; sample ``i``'s haystack starts at WikiText article
    ``seed * NEEDLE_SEED_STRIDE + i``.

    The needle goes in at the sentence start nearest to ``depth`` of the haystack (by tokens), and
    the question with its answer prefix (``NEEDLE_QUESTION``) follows the haystack. Seeds draw
    their haystacks from different articles (apart for up to ``NEEDLE_SEED_STRIDE`` samples), so a
    set reported as held out shares no prompt with the set defaults were chosen on (seed 0).
    """
    if seed < 0:
        raise ValueError(f"seed={seed}: expected a seed >= 0")
    articles = corpus.articles()[seed * NEEDLE_SEED_STRIDE:]
    if samples_per_depth > len(articles):
        raise ValueError(f"{samples_per_depth} needle samples at seed {seed}: {corpus.source} holds only "
                         f"{len(articles)} articles from article {seed * NEEDLE_SEED_STRIDE}")
    depths = list(depths)
    for depth in depths:
        _check_depth(depth)
    records = []
    for sample in range(samples_per_depth):
        haystack = _Haystack(tokenizer, corpus, articles[sample], context)
        for depth in depths:
            prompt = haystack.fitted(depth)
            records.append(RetrievalPrompt("needle", context, depth, sample, prompt, NEEDLE_ANSWER,
                                           _count(tokenizer, prompt)))
    return records


def _fact_values(rng: random.Random, facts: int) -> list[tuple[str, str, str, str]]:
    """``facts`` (statement, question, answer prefix, answer) with random values."""
    if not 1 <= facts <= len(FACTS):
        raise ValueError(f"facts={facts}: expected 1..{len(FACTS)}")
    chosen = []
    for statement, question, prefix, values in FACTS[:facts]:
        value = str(rng.randint(1000, 9999)) if values is None else rng.choice(values)
        chosen.append((statement.format(value), question, prefix, value))
    return chosen


def _turn(user: str, assistant: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def _cut_to_fit(paragraph: str, fits: Callable[[list[dict[str, str]]], bool]) -> list[dict[str, str]]:
    """The filler turn with the most words of ``paragraph`` that ``fits`` (none if not even one word)."""
    words = paragraph.split()

    def turn(n: int) -> list[dict[str, str]]:
        return _turn(FILLER_TURN.format(paragraph=" ".join(words[:n])), FILLER_REPLY)

    return turn(_largest(1, len(words), lambda n: fits(turn(n)))) if fits(turn(1)) else []


def _conversation(tokenizer: Any, corpus: Corpus, start: int, context: int, sample: int, facts: int,
                  reply_tokens: int, seed: int) -> ChatPrompt:
    def render(messages: list[dict[str, str]], prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    chosen = _fact_values(random.Random(f"multiturn/{seed}/{context}/{sample}"), facts)
    opening = _turn(FACTS_TURN.format(facts="\n".join("- " + s for s, _, _, _ in chosen)), FACTS_REPLY)
    base = render(opening)
    questions = []
    for _, question, prefix, _ in chosen:
        asked = render(opening + [{"role": "user", "content": question}], prompt=True)
        if not asked.startswith(base):
            raise ValueError("the chat template does not render a conversation as a prefix of its sequel")
        questions.append(asked[len(base):] + prefix)
    marker = "\x00REPLY\x00"
    turn_end = render(opening + _turn("?", marker)).split(marker, 1)[1]
    budget = context - sum(_count(tokenizer, q + turn_end, special=False) + reply_tokens for q in questions)

    def fits(filler: list[dict[str, str]]) -> bool:
        return _count(tokenizer, render(opening + filler), special=False) <= budget

    if not fits([]):
        raise ValueError(f"context {context}: too short for {facts} facts and their questions")
    filler: list[dict[str, str]] = []
    lines = corpus.text[start:].splitlines()
    for paragraph in (line.strip() for line in lines if line.strip() and not _HEADING.match(line)):
        turn = _turn(FILLER_TURN.format(paragraph=paragraph), FILLER_REPLY)
        if fits(filler + turn):
            filler += turn
            continue
        filler += _cut_to_fit(paragraph, lambda turn, done=filler: fits(done + turn))
        break
    else:
        raise ValueError(f"{corpus.source}: not enough text to fill a {context}-token conversation")
    history = render(opening + filler)
    return ChatPrompt("multiturn", context, sample, history, tuple(questions),
                      tuple(value for _, _, _, value in chosen), turn_end,
                      _count(tokenizer, history + questions[0], special=False))


def chat_prompts(tokenizer: Any, corpus: Corpus, context: int, facts: int = 5, conversations: int = 1,
                 reply_tokens: int = 24, seed: int = 0) -> list[ChatPrompt]:
    """Multi-turn conversations of at most ``context`` tokens in all, rendered with the chat template.

    The first user turn states ``facts`` facts, filler turns carry WikiText paragraphs (conversation
    ``i`` reads from article ``i``) with a short canned reply, then one question per fact. The
    filler stops (the last paragraph cut at a word) where history, every question and a
    ``reply_tokens`` reply to each still fit in ``context``.
    """
    articles = corpus.articles()
    if conversations > len(articles):
        raise ValueError(f"{conversations} conversations: {corpus.source} holds {len(articles)} articles")
    return [_conversation(tokenizer, corpus, articles[i], context, i, facts, reply_tokens, seed)
            for i in range(conversations)]


def window_starts(text_tokens: int, size: int, windows: int) -> list[int]:
    """Start tokens of ``windows`` windows of ``size`` tokens spread over a text of ``text_tokens``.

    The text is cut into ``windows`` equal parts and window ``i`` is centred in part ``i``, so the
    windows never overlap and cover the text from its beginning to its end (one window: the middle).
    """
    if windows < 1 or size < 1:
        raise ValueError(f"windows={windows}, size={size}: expected >= 1")
    if windows * size > text_tokens:
        raise ValueError(f"{windows} windows of {size} tokens need {windows * size} tokens, the text "
                         f"holds {text_tokens}")
    part = text_tokens / windows
    return [min(text_tokens - size, max(0, round((i + 0.5) * part - size / 2))) for i in range(windows)]


def perplexity_windows(tokenizer: Any, corpus: Corpus, context: int, continuation: int,
                       windows: int = 1) -> list[PerplexityWindow]:
    """``windows`` windows of ``context + continuation`` tokens, spread over the whole text.

    The text is tokenized as one document (no special tokens); ``window_starts`` places the
    windows (one in each of ``windows`` equal parts of the text, not adjacent). Window ``i``
    prefills ``context`` tokens and scores the next ``continuation``.
    """
    if context < 1 or continuation < 1 or windows < 1:
        raise ValueError(f"context={context}, continuation={continuation}, windows={windows}: expected >= 1")
    size = context + continuation
    ids = tokenizer(corpus.text, add_special_tokens=False)["input_ids"]
    try:
        starts = window_starts(len(ids), size, windows)
    except ValueError as exc:
        raise ValueError(f"{corpus.source}: {exc}") from exc
    return [PerplexityWindow("ppl", context, i, tuple(ids[start:start + size]), context, start, len(ids))
            for i, start in enumerate(starts)]
