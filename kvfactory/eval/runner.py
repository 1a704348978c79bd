"""Orchestration of ``kvfactory eval``: every context x task x config, the baseline first.

Each unit (context, task, config) builds prompts once per (task, context), runs the task from
``kvfactory.eval.tasks`` through fresh caches of the config and aggregates the items into a row:
accuracy (overall and per depth), perplexity and its difference to the baseline, KV bytes held,
bytes per token, compression ratio, read budget, prefill seconds and decode tokens/s, each speed
and memory number also as a ratio to ``DynamicCache`` of the same unit in the same run.

Perplexity rows keep every window (``window_ppl``, ``window_nll``, ``window_tokens``,
``window_offsets``) and compare with the baseline window by window (``scoring.paired_ppl``):
the pooled ΔPPL (absolute ``delta_ppl`` and relative ``delta_ppl_pct``), each window's relative
ΔPPL and their mean with a paired t-based 95 % confidence interval.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from kvfactory.config import load_yaml, parse_config
from kvfactory.errors import ConfigError
from kvfactory.eval import data
from kvfactory.eval.peers import PeerError, check_peer, is_peer, peer_footprint, peer_maker
from kvfactory.eval.scoring import accuracy_by_depth, mean, paired_ppl
from kvfactory.eval.settings import EvalSettings
from kvfactory.eval.tasks import run_multiturn, run_needle, run_passkey, run_perplexity
from kvfactory.factory import KVCacheFactory
from kvfactory.presets import is_preset, load_preset, preset_names

BASELINE = "DynamicCache"
TASKS = ("ppl", "passkey", "needle", "multiturn")
RETRIEVAL = ("passkey", "needle")


class EvalError(ValueError):
    """Settings the evaluation cannot honour: a bad ``--cache``, task or context."""


@dataclass(frozen=True)
class CacheSpec:
    """One config of a run: ``kind`` is ``baseline``, ``kvfactory`` (with ``config``) or ``peer``."""

    name: str
    kind: str
    config: dict[str, Any] | None = None
    source: str = ""

    def maker(self, model: Any) -> Callable[[], Any]:
        """A ``make_cache`` callable of fresh caches for ``model``."""
        if self.kind == "baseline":
            from transformers import DynamicCache

            return lambda: DynamicCache(config=model.config)
        if self.kind == "peer":
            return peer_maker(self.name, model)
        return KVCacheFactory(model.config, self.config).create_cache


BASELINE_SPEC = CacheSpec(BASELINE, "baseline", None, "transformers.DynamicCache")


def _check(value: str, config: Any) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise EvalError(f"--cache {value!r}: expected a preset ({', '.join(preset_names())}, "
                        f"POLICY@RATIO, SELECTOR@BUDGET, both joined by +), a peer (transformers/...), "
                        f"a YAML file or an inline config such as "
                        f"'{{\"type\": \"paged\", \"page_size\": 64}}'")
    try:
        parse_config(config)
    except ConfigError as exc:
        raise EvalError(f"--cache {value!r}: {exc}") from exc
    return config


def resolve_cache(value: str) -> CacheSpec:
    """``--cache VALUE``: a preset name, a peer name, a YAML path, or an inline JSON/YAML config."""
    value = value.strip()
    if value == BASELINE:
        return BASELINE_SPEC
    if is_peer(value):
        try:
            check_peer(value)
        except PeerError as exc:
            raise EvalError(f"--cache {value!r}: {exc}") from exc
        return CacheSpec(value, "peer", None, "transformers")
    if is_preset(value):
        try:
            return CacheSpec(value, "kvfactory", load_preset(value), f"preset {value}")
        except ConfigError as exc:  # a POLICY@RATIO or SELECTOR@BUDGET out of range
            raise EvalError(f"--cache {value!r}: {exc}") from exc
    path = Path(value)
    if value.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise EvalError(f"--cache {value!r}: no such YAML file")
        try:
            config = load_yaml(path)
        except ConfigError as exc:
            raise EvalError(f"--cache {value!r}: {exc}") from exc
        return CacheSpec(path.stem, "kvfactory", _check(value, config), str(path))
    try:
        config = yaml.safe_load(value)  # JSON is YAML
    except yaml.YAMLError:
        config = None
    config = _check(value, config)
    return CacheSpec(json.dumps(config, separators=(",", ":"), sort_keys=True), "kvfactory", config, "inline")


def resolve_caches(values: Sequence[str]) -> list[CacheSpec]:
    """The baseline, then each ``--cache`` value once (in order)."""
    specs = [BASELINE_SPEC]
    for value in values:
        spec = resolve_cache(value)
        if spec.name not in {s.name for s in specs}:
            specs.append(spec)
    return specs


def parse_tasks(text: str) -> tuple[str, ...]:
    tasks = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise EvalError(f"--tasks {text!r}: expected a comma-separated subset of {','.join(TASKS)}")
    return tuple(dict.fromkeys(tasks))


@dataclass
class Unit:
    """One (context, task, config) unit: its raw items and aggregated row."""

    context: int
    task: str
    config: str
    items: list[Any] = field(default_factory=list)
    row: dict[str, Any] = field(default_factory=dict)


def _prompts(task: str, context: int, tokenizer: Any, corpus: data.Corpus, s: EvalSettings) -> list[Any]:
    if task == "ppl":
        return data.perplexity_windows(tokenizer, corpus, context, s.ppl_continuation, s.ppl_windows)
    if task == "passkey":
        return data.passkey_prompts(tokenizer, context, s.depths, s.keys_per_depth, s.seed)
    if task == "needle":
        return data.needle_prompts(tokenizer, corpus, context, s.depths, s.needles_per_depth, s.seed)
    return data.chat_prompts(tokenizer, corpus, context, s.facts, s.conversations, seed=s.seed)


def _run_task(task: str, model: Any, tokenizer: Any, make_cache: Callable[[], Any],
              prompts: list[Any], question: str = "inside") -> list:
    if task == "ppl":
        return run_perplexity(model, make_cache, prompts)
    if task == "passkey":
        return run_passkey(model, tokenizer, make_cache, prompts, question_after=question == "after")
    if task == "needle":
        return run_needle(model, tokenizer, make_cache, prompts, question_after=question == "after")
    return run_multiturn(model, tokenizer, make_cache, prompts)


class _Recorder:
    """Wraps ``make_cache`` to measure each cache with ``peer_footprint`` when the next one is made."""

    def __init__(self, make_cache: Callable[[], Any]):
        self.make_cache, self.footprints, self.current = make_cache, [], None

    def __call__(self) -> Any:
        self.finish()
        self.current = self.make_cache()
        return self.current

    def finish(self) -> None:
        if self.current is not None:
            self.footprints.append(peer_footprint(self.current))
            self.current = None


def _aggregate(unit: Unit) -> dict[str, Any]:
    items = unit.items
    prints = [i.footprint for i in items]
    steps, decode_s = sum(i.decode_steps for i in items), sum(i.decode_s for i in items)
    row: dict[str, Any] = {
        "context": unit.context, "task": unit.task, "config": unit.config, "items": len(items),
        "tokens_seen": mean([p.tokens_seen for p in prints]),
        "kv_bytes": mean([p.bytes for p in prints]),
        "bytes_per_token": mean([p.bytes_per_token for p in prints]),
        "compression_ratio": mean([p.compression_ratio for p in prints]),
        "read_budget": mean([p.read_fraction for p in prints]),  # KV bytes decode read / all stored
        "prefill_s": statistics.median(i.prefill_s for i in items) if items else float("nan"),
        "decode_tokens_per_s": steps / decode_s if decode_s > 0 else float("nan"),
    }
    for field_name in ("key_rel_mse", "value_rel_mse", "hit_rate", "recall", "oracle_recall",
                       "router_p99_ms", "token_read_fraction", "always_read_fraction",
                       "selected_read_fraction", "whole_read_fraction"):
        values = [getattr(p, field_name) for p in prints
                  if getattr(p, field_name) is not None and not math.isnan(getattr(p, field_name))]
        if values:
            row[field_name] = mean(values)
    if unit.task == "ppl":
        nll, tokens = sum(i.nll for i in items), sum(i.scored_tokens for i in items)
        row["ppl"] = math.exp(nll / tokens)
        row |= {"window_ppl": [i.ppl for i in items], "window_nll": [i.nll for i in items],
                "window_tokens": [i.scored_tokens for i in items]}
    elif unit.task in RETRIEVAL:
        row["accuracy"] = mean([float(i.correct) for i in items])
        row["accuracy_by_depth"] = accuracy_by_depth((i.depth, i.correct) for i in items)
    else:
        row["accuracy"] = mean([i.accuracy for i in items])
    return row


RATIOS = {"kv_bytes": "kv_bytes_ratio", "bytes_per_token": "bytes_per_token_ratio",
          "prefill_s": "prefill_ratio", "decode_tokens_per_s": "decode_ratio"}


def compare_ppl(row: dict[str, Any], ref: dict[str, Any]) -> None:
    """``row``'s ΔPPL against ``ref`` (the baseline on the same windows): pooled, and paired by window."""
    row["delta_ppl"] = row["ppl"] - ref["ppl"]
    if row.get("window_tokens") != ref.get("window_tokens"):
        raise ValueError(f"{row['config']} scored other windows than {ref['config']} at {row['context']}")
    row |= paired_ppl(row["window_nll"], ref["window_nll"], row["window_tokens"])


def _compare(rows: list[dict[str, Any]]) -> None:
    """Ratios and ΔPPL of every row against the baseline row of the same (context, task)."""
    base = {(r["context"], r["task"]): r for r in rows if r["config"] == BASELINE}
    for row in rows:
        ref = base[(row["context"], row["task"])]
        for key, name in RATIOS.items():
            row[name] = row[key] / ref[key] if ref[key] else float("nan")
        if "ppl" in row:
            compare_ppl(row, ref)


def _warm_up(model: Any, make_cache: Callable[[], Any]) -> None:
    """A short generate per config so that one-off costs are not charged to the first unit."""
    ids = torch.arange(3, 19).unsqueeze(0) % model.config.vocab_size
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=make_cache(),
                       max_new_tokens=2, min_new_tokens=2, do_sample=False)


def unit_plan(specs: Sequence[CacheSpec], tasks: Sequence[str], settings: EvalSettings) -> list[tuple]:
    """The units in run order: (context, task, config name); ppl only at ``settings.task_contexts``."""
    return [(c, t, s.name) for c in settings.all_contexts(tasks) for t in tasks
            if c in settings.task_contexts(t) for s in specs]


def check_contexts(model: Any, tasks: Sequence[str], settings: EvalSettings) -> None:
    """Every context plus the tokens a task adds after it must fit the model's positions."""
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is None:
        return
    for task in tasks:
        extra = settings.ppl_continuation if task == "ppl" else 64
        for context in settings.task_contexts(task):
            if context + extra > limit:
                raise EvalError(f"{task} at context {context}: with {extra} more tokens it exceeds the "
                                f"model's {limit} positions")


def build_prompts(tokenizer: Any, tasks: Sequence[str], settings: EvalSettings,
                  corpus: data.Corpus) -> dict[tuple[str, int], list[Any]]:
    """The prompts of every (task, context) of a run, in run order; a pure function of its arguments."""
    prompt_sets = {}
    tasks = parse_tasks(",".join(tasks))
    for context in settings.all_contexts(tasks):
        for task in tasks:
            if context not in settings.task_contexts(task):
                continue
            try:
                prompt_sets[(task, context)] = _prompts(task, context, tokenizer, corpus, settings)
            except ValueError as exc:
                raise EvalError(f"{task} at context {context}: {exc}") from exc
    return prompt_sets


def run_eval(model: Any, tokenizer: Any, specs: Sequence[CacheSpec], tasks: Sequence[str],
             settings: EvalSettings, corpus: data.Corpus | None = None,
             on_unit: Callable[[tuple, bool], None] | None = None,
             prompt_sets: dict[tuple[str, int], list[Any]] | None = None) -> dict[str, Any]:
    """Run every unit; ``on_unit(unit, done)`` is called before (``False``) and after (``True``) each.

    ``prompt_sets`` (from ``build_prompts``) are built here when not given. Returns ``{"configs",
    "settings", "corpus", "rows", "items"}``, JSON-ready.
    """
    if not specs or specs[0].name != BASELINE:
        specs = [BASELINE_SPEC] + [s for s in specs if s.name != BASELINE]
    tasks = parse_tasks(",".join(tasks))
    check_contexts(model, tasks, settings)
    corpus = corpus or data.load_wikitext()
    if prompt_sets is None:
        prompt_sets = build_prompts(tokenizer, tasks, settings, corpus)
    makers = {s.name: s.maker(model) for s in specs}
    for make in makers.values():
        _warm_up(model, make)
    units = []
    for context, task, name in unit_plan(specs, tasks, settings):
        if on_unit:
            on_unit((context, task, name), False)
        recorder = _Recorder(makers[name])
        items = _run_task(task, model, tokenizer, recorder, prompt_sets[(task, context)], settings.question)
        recorder.finish()
        items = [replace(i, footprint=f) for i, f in zip(items, recorder.footprints, strict=True)]
        unit = Unit(context, task, name, items)
        unit.row = _aggregate(unit)
        if task == "ppl":
            unit.row["window_offsets"] = [w.offset for w in prompt_sets[(task, context)]]
        units.append(unit)
        if on_unit:
            on_unit((context, task, name), True)
    rows = [u.row for u in units]
    _compare(rows)
    return {
        "configs": [{"name": s.name, "kind": s.kind, "config": s.config, "source": s.source} for s in specs],
        "settings": asdict(settings) | {"tasks": list(tasks)},
        "corpus": corpus.source,
        "rows": rows,
        "items": [asdict(i) | {"config": u.config} for u in units for i in u.items],
    }
