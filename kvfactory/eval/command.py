"""``kvfactory eval`` and ``kvfactory report``: settings from options, a progress bar, files out.

``evaluate`` loads the model, writes the prompts it will use (``prompts.jsonl``, for peers that
run in another process), runs ``runner.run_eval`` under a progress bar weighted by context length
(prefill dominates, so the ETA follows tokens, not units) and writes ``results.json``,
``report.md`` and the plots. ``rereport`` merges peer results into a finished run and writes the
report again.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from kvfactory import models
from kvfactory.eval import data, exchange, report, runner
from kvfactory.eval.settings import DEFAULT, EvalSettings


def settings_from_options(contexts: tuple[int, ...] | None, depths: tuple[float, ...] | None,
                          samples: int | None, ppl_tokens: int | None, question: str = "inside",
                          ppl_windows: int | None = None,
                          ppl_contexts: tuple[int, ...] | None = None, seed: int = 0) -> EvalSettings:
    """The default settings with the command line's overrides; ``ValueError`` names a bad one.

    Perplexity runs at ``ppl_contexts`` when given, else at ``contexts`` when given, else at the
    default ``ppl_contexts`` (2048): ``--context 6144 --tasks ppl`` scores windows after 6144 tokens.
    """
    overrides: dict[str, Any] = {"question": question, "seed": seed}
    if contexts is not None:
        overrides |= {"contexts": contexts, "ppl_contexts": None}
    if ppl_contexts is not None:
        overrides["ppl_contexts"] = ppl_contexts
    if depths is not None:
        overrides["depths"] = depths
    if samples is not None:
        overrides |= {"keys_per_depth": samples, "needles_per_depth": samples, "conversations": samples}
    if ppl_tokens is not None:
        overrides["ppl_continuation"] = ppl_tokens
    if ppl_windows is not None:
        overrides["ppl_windows"] = ppl_windows
    return dataclasses.replace(DEFAULT, **overrides)


def _merge_peers(results: dict[str, Any], out: Path, peers: Sequence[Path]) -> dict[str, Any]:
    for path in peers:
        results = exchange.merge_peer_rows(results, path, out / exchange.PROMPTS_FILE)
    return results


def _say_written(console: Console, paths: dict[str, Path], results: dict[str, Any]) -> None:
    console.print(report.summary(results), markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {paths['results']}, {paths['report']} and {len(paths) - 2} plot(s); "
                  f"the run took {results['wall_s']:.1f} s", soft_wrap=True)


def evaluate(specs: Sequence[runner.CacheSpec], tasks: Sequence[str], settings: EvalSettings, model_name: str,
             out: Path, threads: int, command: str, peers: Sequence[Path] = (), prompts_only: bool = False,
             console: Console | None = None, text: str = "wikitext") -> dict[str, Path]:
    """Run the evaluation (or only write its prompts) into ``out``; return the written files.

    ``text`` is the evaluation text (``data.load_text``: ``wikitext``, ``alice`` or a file path).
    """
    from transformers.utils import logging

    console = console or Console()
    start, started = time.perf_counter(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    logging.disable_progress_bar()
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    try:
        corpus = data.load_text(text)
    except FileNotFoundError as exc:
        raise runner.EvalError(str(exc)) from exc
    plan = runner.unit_plan(specs, tasks, settings)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=console) as progress:
        bar = progress.add_task(f"loading {model_name}", total=sum(c for c, _, _ in plan))
        model, tokenizer = models.load_model(model_name)
        runner.check_contexts(model, tasks, settings)
        progress.update(bar, description="building prompts")
        prompt_sets = runner.build_prompts(tokenizer, tasks, settings, corpus)
        prompts = exchange.write_prompts(prompt_sets, out / exchange.PROMPTS_FILE)
        if prompts_only:
            console.print(f"wrote {prompts}")
            return {"prompts": prompts}

        def on_unit(unit: tuple, done: bool) -> None:
            context, task, name = unit
            if done:
                progress.advance(bar, context)
            else:
                progress.update(bar, description=f"{task} @ {context}: {name}")
                if not console.is_terminal:  # no live bar in a file or a pipe: a line per unit
                    console.print(f"{task} @ {context}: {name}", soft_wrap=True, highlight=False)

        results = runner.run_eval(model, tokenizer, specs, tasks, settings, corpus, on_unit, prompt_sets)
    results = {"command": command, "model": model_name, "threads": threads, "started": started,
               "wall_s": time.perf_counter() - start} | results
    paths = report.write_report(_merge_peers(results, out, peers), out)
    _say_written(console, paths, results)
    return paths | {"prompts": prompts}


def rereport(out: Path, peers: Sequence[Path], console: Console | None = None) -> dict[str, Path]:
    """Merge peer results into the finished run in ``out`` and write its report again."""
    console = console or Console()
    path = out / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise exchange.PeerResultsError(f"{path}: not a finished kvfactory eval run ({exc})") from exc
    paths = report.write_report(_merge_peers(results, out, peers), out)
    _say_written(console, paths, results)
    return paths
