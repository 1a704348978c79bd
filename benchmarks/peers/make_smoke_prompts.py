"""Write a small passkey prompts file for a smoke run of a peer (stdlib only).

Each line is one record in the peers' prompt format (see README.md):
``{"task", "context", "depth", "prompt", "question", "answer", "id"}``; the model reads
``prompt + question`` verbatim (the prompt ends with the separator). The passkey format is
the harness's (docs/evaluation.md): the filler repeated to about ``context`` tokens (approximated
by words), the key line at ``depth``, then the question.

    python benchmarks/peers/make_smoke_prompts.py OUT.jsonl [--context 512] [--depths 0.3,0.7]
"""

from __future__ import annotations

import argparse
import json
import random

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
# SmolLM2's tokenizer turns this filler into about 1.26 tokens per word (each '.' is its own token).
TOKENS_PER_WORD = 1.26


def passkey_record(context: int, depth: float, key: str, index: int = 0) -> dict:
    """One passkey prompt of about ``context`` tokens with the key line at ``depth`` (0..1)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key_line = KEY_LINE.format(key=key)
    words_per_filler = len(FILLER.split())
    budget_words = context / TOKENS_PER_WORD - len(key_line.split()) - len(QUESTION.split())
    repeats = max(1, round(budget_words / words_per_filler))
    pieces = [FILLER] * repeats
    pieces.insert(round(depth * repeats), key_line)
    return {
        "task": "passkey",
        "context": context,
        "depth": depth,
        "prompt": " ".join(pieces) + "\n",
        "question": QUESTION,
        "answer": key,
        "id": f"passkey-{context}-d{depth:g}-{index}",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON-lines file to write")
    parser.add_argument("--context", type=int, default=512, help="approximate prompt length in tokens")
    parser.add_argument("--depths", default="0.3,0.7", help="comma-separated key depths in [0, 1]")
    parser.add_argument("--keys-per-depth", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="seed for the 5-digit keys")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    records = []
    for depth in (float(d) for d in args.depths.split(",")):
        for i in range(args.keys_per_depth):
            key = str(rng.randint(10000, 99999))
            records.append(passkey_record(args.context, depth, key, i))
    with open(args.out, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
