"""Exchange with peers that run in another process (NVIDIA kvpress): the prompts out, their rows in.

kvpress needs ``transformers<5.3`` and runs in its own virtualenv (``benchmarks/peers/``). A run
writes every prompt it used to ``prompts.jsonl`` (one JSON object a line, with a stable ``id`` and
the ``sha256`` of the record); the peer answers the same prompts and writes one row per prompt x
press x ratio. ``merge_peer_rows`` checks that each row answers a prompt of this run (same id, same
hash: the same text, not just the same name), aggregates rows into report rows per (context, task,
config) and adds them beside kvfactory's configs.

Peer rows compare against the peer's own no-press run from the same process (``kvpress/none``):
ΔPPL and the KV-bytes ratio are relative to it. Speed is not compared across processes (another
transformers version and no shared warm-up), so speed cells of peer rows stay empty.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvfactory.eval.scoring import PASSKEY_TOKENS, accuracy_by_depth, mean, paired_ppl, perplexity
from kvfactory.eval.tasks import NEEDLE_NEW_TOKENS

PROMPTS_FILE = "prompts.jsonl"
PEER_TASKS = ("ppl", "passkey", "needle")  # multi-turn recall is not run by the kvpress peer
NO_PRESS = "none"
EXTERNAL = "external"  # the config kind of merged peer rows
MAX_NEW_TOKENS = {"passkey": PASSKEY_TOKENS, "needle": NEEDLE_NEW_TOKENS}


class PeerResultsError(ValueError):
    """A peer results file that does not answer this run's prompts, or cannot be read."""


def record_id(record: Any) -> str:
    """A prompt's stable name: ``TASK-CONTEXT-dDEPTH-SAMPLE`` (retrieval) or ``ppl-CONTEXT-SAMPLE``."""
    if record.task == "ppl":
        return f"ppl-{record.context}-{record.sample}"
    return f"{record.task}-{record.context}-d{record.depth:g}-{record.sample}"


def record_line(record: Any) -> dict[str, Any]:
    """A prompt record as a peer reads it: its fields, ``id``, ``max_new_tokens`` and ``sha256``."""
    line = asdict(record) | {"id": record_id(record)}
    if record.task in MAX_NEW_TOKENS:
        line["max_new_tokens"] = MAX_NEW_TOKENS[record.task]
    line["sha256"] = hashlib.sha256(json.dumps(line, sort_keys=True).encode()).hexdigest()
    return line


def write_prompts(prompt_sets: Mapping[tuple[str, int], Sequence[Any]], path: str | Path) -> Path:
    """Write the prompts of the tasks a peer runs (``PEER_TASKS``) to ``path`` as JSON lines."""
    path = Path(path)
    lines = [record_line(r) for (task, _), records in prompt_sets.items() if task in PEER_TASKS
             for r in records]
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a peer's JSON-lines results file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PeerResultsError(f"{path}: cannot read peer results ({exc.strerror})") from exc
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise PeerResultsError(f"{path}:{number}: not JSON ({exc.msg})") from exc
    if not rows:
        raise PeerResultsError(f"{path}: no rows")
    return rows


def config_name(row: Mapping[str, Any]) -> str:
    """``kvpress/PRESS@RATIO`` (``kvpress/none`` for the no-press run)."""
    if row["press"] == NO_PRESS:
        return f"{row['peer']}/{NO_PRESS}"
    return f"{row['peer']}/{row['press']}@{row['compression_ratio']:g}"


def _check(rows: Iterable[dict[str, Any]], prompts: Mapping[str, dict[str, Any]], source: str) -> None:
    for row in rows:
        missing = {"peer", "press", "compression_ratio", "task", "context", "id"} - set(row)
        if missing:
            raise PeerResultsError(f"{source}: row {row.get('id', '?')} lacks {', '.join(sorted(missing))}")
        line = prompts.get(row["id"])
        if line is None:
            raise PeerResultsError(f"{source}: row {row['id']} ({config_name(row)}) answers no prompt of "
                                   f"this run; run the peer on this run's {PROMPTS_FILE}")
        if row.get("sha256") != line["sha256"]:
            raise PeerResultsError(f"{source}: row {row['id']} ({config_name(row)}) answers a different "
                                   f"prompt text (sha256 {row.get('sha256')!r}, this run's "
                                   f"{line['sha256']!r}); run the peer on this run's {PROMPTS_FILE}")


def _aggregate(name: str, task: str, context: int, items: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "context": context, "task": task, "config": name, "items": len(items),
        "tokens_seen": mean([r["tokens_seen"] for r in items]),
        "kv_bytes": mean([r["kv_bytes"] for r in items]),
        "bytes_per_token": mean([r["kv_bytes"] / r["tokens_seen"] for r in items]), "read_budget": 1.0,
        "prefill_s": None, "decode_tokens_per_s": None,
        "prefill_ratio": None, "decode_ratio": None,
        "target_compression_ratio": items[0]["compression_ratio"],
        "measured_compression_ratio": mean([r["measured_compression_ratio"] for r in items]),
    }
    if task == "ppl":
        items = sorted(items, key=lambda r: (len(r["id"]), r["id"]))  # ppl-CONTEXT-SAMPLE, by sample
        row["ppl"] = perplexity(sum(r["nll"] for r in items), sum(r["scored_tokens"] for r in items))
        row |= {"window_ids": [r["id"] for r in items], "window_nll": [r["nll"] for r in items],
                "window_tokens": [r["scored_tokens"] for r in items],
                "window_ppl": [perplexity(r["nll"], r["scored_tokens"]) for r in items]}
    else:
        row["accuracy"] = mean([float(r["correct"]) for r in items])
        row["accuracy_by_depth"] = accuracy_by_depth((r["depth"], r["correct"]) for r in items)
    return row


def _compare(rows: list[dict[str, Any]], peer: str, source: str) -> None:
    """Compression, KV-bytes ratio and ΔPPL of each peer row against the peer's own no-press row."""
    base = {(r["context"], r["task"]): r for r in rows if r["config"] == f"{peer}/{NO_PRESS}"}
    for row in rows:
        ref = base.get((row["context"], row["task"]))
        if ref is None:
            raise PeerResultsError(f"{source}: no {peer}/{NO_PRESS} rows for {row['task']} at "
                                   f"{row['context']}: rerun the peer with its baseline")
        full = ref["bytes_per_token"]
        row["compression_ratio"] = 1.0 - row["bytes_per_token"] / full if full else float("nan")
        row["kv_bytes_ratio"] = row["kv_bytes"] / ref["kv_bytes"] if ref["kv_bytes"] else float("nan")
        row["bytes_per_token_ratio"] = row["bytes_per_token"] / full if full else float("nan")
        if "ppl" in row:
            row["delta_ppl"] = row["ppl"] - ref["ppl"]
            if row["window_ids"] != ref["window_ids"]:
                raise PeerResultsError(f"{source}: {row['config']} answers other ppl windows than "
                                       f"{peer}/{NO_PRESS} at {row['context']}")
            row |= paired_ppl(row["window_nll"], ref["window_nll"], row["window_tokens"])


def merge_peer_rows(results: dict[str, Any], path: str | Path, prompts_path: str | Path) -> dict[str, Any]:
    """``results`` with the peer rows of ``path`` (checked against ``prompts_path``) added; a new dict.

    Only tasks and contexts of this run are accepted; a second file of the same peer replaces the rows
    of the first.
    """
    if results.get("settings", {}).get("question", "inside") != "after":
        raise PeerResultsError(f"{path}: kvpress compresses the context before the question; merge its rows "
                               f"into a run with `--question after` (this run has the question inside the "
                               f"compressed prompt)")
    prompts = {line["id"]: line for line in read_rows(prompts_path)}
    rows = read_rows(path)
    _check(rows, prompts, str(path))
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((config_name(r), r["task"], r["context"]), []).append(r)
    peers = {r["peer"] for r in rows}
    merged = [_aggregate(name, task, context, items) for (name, task, context), items in groups.items()]
    for peer in peers:
        _compare([r for r in merged if r["config"].startswith(peer + "/")], peer, str(path))
    names = list(dict.fromkeys(name for name, _, _ in groups))
    params = {config_name(r): r.get("press_params") or {} for r in rows}
    configs = [c for c in results["configs"] if not any(c["name"].startswith(p + "/") for p in peers)]
    configs += [{"name": n, "kind": EXTERNAL, "config": params[n] or None,
                 "source": f"{n.split('/')[0]} ({Path(path).name})"} for n in names]
    kept = [r for r in results["rows"] if not any(r["config"].startswith(p + "/") for p in peers)]
    order = {n: i for i, n in enumerate(names)}
    merged.sort(key=lambda r: (r["context"], r["task"], order[r["config"]]))
    out = dict(results)
    out["configs"], out["rows"] = configs, kept + merged
    out["peer_results"] = sorted(set(results.get("peer_results", [])) | {str(path)})
    return out

