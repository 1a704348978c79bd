"""Are kvfactory's eviction policies the methods kvpress implements? Compare answers prompt by prompt.

Reads an evaluation folder holding kvfactory's ``results.json`` (caches named ``POLICY@RATIO``) and
kvpress's ``kvpress.jsonl`` on the same ``prompts.jsonl`` (``benchmarks/peers/run.sh``), run in the
same setting: ``--question after`` for both (the context compressed, then the question fed), or
kvfactory's default ``--question inside`` with ``run.sh ... --question inside`` (the question inside
the compressed prefill). Pairs each kvfactory policy with kvpress's press of the same name and ratio
(``PEER_NAMES`` maps the two whose names differ), and the ``DynamicCache`` baseline with kvpress's
no-press run, and prints JSON per pair: how many retrieval answers are the same text, the accuracy
of each, each one's perplexity where both scored it, and per prompt (``--markdown``: a table).

    python benchmarks/policy_agreement.py RESULTS_DIR [--markdown]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

BASELINE = "DynamicCache"
# kvfactory policy -> kvpress press where the names differ. H2O is not kvpress's ObservedAttentionPress
# (that one scores by the *mean* attention a token received and keeps no recent window), so the pair
# shows how far apart the two methods are, not an implementation check.
PEER_NAMES = {"h2o": "observed_attention"}


def _key(row: dict[str, Any]) -> tuple:
    sample = row["sample"] if "sample" in row else int(row["id"].rsplit("-", 1)[1])
    return row["task"], row["context"], row.get("depth"), sample


def _peer_config(config: str) -> str:
    if config == BASELINE:
        return "none@0"
    policy, _, ratio = config.partition("@")
    return f"{PEER_NAMES.get(policy, policy)}@{ratio}"


def _read_peer(folder: Path, question: str) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(folder.glob("kvpress*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        sys.exit(f"{folder}: no kvpress*.jsonl (benchmarks/peers/run.sh)")
    other = {r.get("question", "after") for r in rows if r["task"] != "ppl"} - {question}
    if other:
        sys.exit(f"{folder}: kvfactory ran with --question {question}, kvpress rows with --question "
                 f"{', '.join(sorted(other))}: compare one setting at a time")
    return rows


def agreement(folder: Path) -> dict[str, Any]:
    ours = json.loads((folder / "results.json").read_text())
    question = ours["settings"].get("question", "inside")
    theirs = _read_peer(folder, question)
    peer = {(f"{r['press']}@{r['compression_ratio']:g}", *_key(r)): r for r in theirs}
    pairs: dict[str, dict[str, Any]] = {}
    for item in ours["items"]:
        match = peer.get((_peer_config(item["config"]), *_key(item)))
        if match is None:
            continue
        pair = pairs.setdefault(item["config"], {"answers": 0, "same_answers": 0, "correct": [0, 0],
                                                 "nll": [0.0, 0.0], "scored_tokens": 0, "prompts": []})
        if item["task"] == "ppl":
            pair["nll"][0] += item["nll"]
            pair["nll"][1] += match["nll"]
            pair["scored_tokens"] += item["scored_tokens"]
            continue
        same = item["output"].strip() == match["generated"].strip()
        pair["answers"] += 1
        pair["same_answers"] += same
        pair["correct"][0] += item["correct"]
        pair["correct"][1] += bool(match["correct"])
        pair["prompts"].append({"prompt": f"{item['task']} d{item['depth']:g}-{_key(item)[3]}",
                                "kvfactory": bool(item["correct"]), "kvpress": bool(match["correct"]),
                                "same_text": same})
    out = {}
    for name, pair in sorted(pairs.items(), key=lambda kv: (kv[0] != BASELINE, kv[0])):
        row = {"kvpress": _peer_config(name), "question": question, "answers": pair["answers"],
               "same_answers": pair["same_answers"],
               "correct_kvfactory": pair["correct"][0], "correct_kvpress": pair["correct"][1]}
        if pair["scored_tokens"]:
            row |= {"ppl_kvfactory": round(math.exp(pair["nll"][0] / pair["scored_tokens"]), 4),
                    "ppl_kvpress": round(math.exp(pair["nll"][1] / pair["scored_tokens"]), 4)}
        out[name] = row | {"prompts": sorted(pair["prompts"], key=lambda p: p["prompt"])}
    return out


def markdown(pairs: dict[str, Any]) -> str:
    """One row per pair: each prompt's verdicts as kvfactory/kvpress (1 = correct), ``*`` where the two
    answers are different text, then the totals."""
    if not pairs:
        return "(no pairs)"
    prompts = [p["prompt"] for p in next(iter(pairs.values()))["prompts"]]
    head = "| kvfactory | kvpress | " + " | ".join(prompts) + " | correct (kvfactory / kvpress) | same text |"
    lines = [head, "|" + "---|" * (len(prompts) + 4)]
    for name, row in pairs.items():
        cells = {p["prompt"]: f"{p['kvfactory']:d}/{p['kvpress']:d}{'' if p['same_text'] else '*'}"
                 for p in row["prompts"]}
        lines.append(f"| {name} | {row['kvpress']} | " + " | ".join(cells.get(p, "") for p in prompts)
                     + f" | {row['correct_kvfactory']} / {row['correct_kvpress']} of {row['answers']}"
                     f" | {row['same_answers']} of {row['answers']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--markdown"]
    if len(args) != 1:
        sys.exit(__doc__.strip().splitlines()[-1])
    result = agreement(Path(args[0]))
    print(markdown(result) if "--markdown" in sys.argv else json.dumps(result, indent=2))
