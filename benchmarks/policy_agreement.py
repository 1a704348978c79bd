"""Are kvfactory's eviction policies the methods kvpress implements? Compare answers prompt by prompt.

Reads an evaluation folder holding kvfactory's ``results.json`` (run with ``--question after`` and
caches named ``POLICY@RATIO``) and kvpress's ``kvpress.jsonl`` on the same ``prompts.jsonl``
(``benchmarks/peers/run.sh``), pairs each kvfactory policy with kvpress's press of the same name
and ratio, and prints JSON per pair: how many retrieval answers are the same text, the accuracy of
each, and each one's perplexity where both scored it.

    python benchmarks/policy_agreement.py RESULTS_DIR
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


def _key(row: dict[str, Any]) -> tuple:
    sample = row["sample"] if "sample" in row else int(row["id"].rsplit("-", 1)[1])
    return row["task"], row["context"], row.get("depth"), sample


def agreement(folder: Path) -> dict[str, Any]:
    ours = json.loads((folder / "results.json").read_text())
    if ours["settings"].get("question") != "after":
        sys.exit(f"{folder}/results.json: run kvfactory eval with --question after, as kvpress scores")
    lines = (folder / "kvpress.jsonl").read_text().splitlines()
    theirs = [json.loads(line) for line in lines if line.strip()]
    peer = {(f"{r['press']}@{r['compression_ratio']:g}", *_key(r)): r for r in theirs}
    pairs: dict[str, dict[str, Any]] = {}
    for item in ours["items"]:
        match = peer.get((item["config"], *_key(item)))
        if match is None:
            continue
        pair = pairs.setdefault(item["config"], {"answers": 0, "same_answers": 0, "correct": [0, 0],
                                                 "nll": [0.0, 0.0], "scored_tokens": 0})
        if item["task"] == "ppl":
            pair["nll"][0] += item["nll"]
            pair["nll"][1] += match["nll"]
            pair["scored_tokens"] += item["scored_tokens"]
            continue
        pair["answers"] += 1
        pair["same_answers"] += item["output"].strip() == match["generated"].strip()
        pair["correct"][0] += item["correct"]
        pair["correct"][1] += bool(match["correct"])
    out = {}
    for name, pair in sorted(pairs.items()):
        row = {"answers": pair["answers"], "same_answers": pair["same_answers"],
               "accuracy_kvfactory": pair["correct"][0] / max(pair["answers"], 1),
               "accuracy_kvpress": pair["correct"][1] / max(pair["answers"], 1)}
        if pair["scored_tokens"]:
            row |= {"ppl_kvfactory": round(math.exp(pair["nll"][0] / pair["scored_tokens"]), 4),
                    "ppl_kvpress": round(math.exp(pair["nll"][1] / pair["scored_tokens"]), 4)}
        out[name] = row
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    print(json.dumps(agreement(Path(sys.argv[1])), indent=2))
