"""``kvfactory run``: one long real prompt generated under several cache configs side by side.

The embedded model reads at least ``context`` tokens of shipped WikiText-2 text plus a question
about it (plain prompt, no chat template) and decodes greedily under transformers' ``DynamicCache``
(the baseline, always run first) and each kvfactory config, lossless (dense, paged) and quantized
(int8, int4), evicting (SnapKV compressing the prompt by 75 %, StreamingLLM bounded to 1024 tokens
per layer) and reading sparsely (Quest and the OVAL router reading 1/8 of the pages per decode
step). The table shows KV bytes held after generation, prefill time, decode speed against the
baseline, whether the tokens match it (for lossy configs: how many leading tokens do) and the
start of each config's answer.
"""

from __future__ import annotations

import gc
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text
from transformers import DynamicCache

from kvfactory.cache import dynamic_cache_bytes
from kvfactory.config import parse_config
from kvfactory.errors import ConfigError
from kvfactory.factory import KVCacheFactory
from kvfactory.measure import GenerationTiming, timed_generate
from kvfactory.models import load_model
from kvfactory.sizing import format_bytes, kv_bytes
from kvfactory.texts import shipped_text

BASELINE = "DynamicCache"
PRESETS: dict[str, dict[str, Any]] = {
    "dense": {"type": "dense"},
    "paged/16": {"type": "paged", "page_size": 16},
    "paged/256": {"type": "paged", "page_size": 256},
    "int8": {"type": "dense", "quantization": "int8"},
    "paged/16+int4": {"type": "paged", "page_size": 16, "quantization": "int4"},
    "paged/16+snapkv/0.75": {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16},
        {"name": "selective", "policy": "snapkv", "compression_ratio": 0.75}]},
    "paged/16+streaming/1024": {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16},
        {"name": "selective", "policy": "streaming_llm", "budget": 1024}]},
    "paged/16+quest/0.125": {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16}, {"name": "quest", "read_budget": 0.125}]},
    "paged/16+oval/0.125": {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16}, {"name": "oval", "read_budget": 0.125}]},
}
_SENTENCE_END = re.compile(r" \.(?= )|\n")  # WikiText writes "word . Next"
# About the first article: some 4,000 tokens before the question at the default context.
QUESTION = "\nQuestion: What is Robert Boulter's profession?\nAnswer: Robert Boulter is an English"


class RunError(ValueError):
    """Settings the run cannot honour: an unknown config, or a context the text or model cannot hold."""


def build_prompt(tokenizer: Any, context: int, question: str = QUESTION) -> str:
    """Whole sentences of the shipped text holding at least ``context`` tokens, then ``question``."""
    text = shipped_text()
    offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    if context > len(offsets):
        raise RunError(f"context {context}: the shipped text holds only {len(offsets)} tokens")
    sentence_end = _SENTENCE_END.search(text, offsets[context - 1][1])
    return text[:sentence_end.end() if sentence_end else len(text)] + question


def parse_configs(values: list[str] | None) -> dict[str, dict[str, Any]]:
    """Named cache configs to compare: preset names or inline JSON configs (default: all presets).

    Each config is validated now, so a typo fails before the model loads.
    """
    if not values:
        return dict(PRESETS)
    configs = {}
    for value in values:
        if value in PRESETS:
            configs[value] = PRESETS[value]
            continue
        try:
            config = json.loads(value)
        except json.JSONDecodeError:
            raise RunError(f"config {value!r}: expected one of {', '.join(PRESETS)} or a JSON cache "
                           f"config such as '{{\"type\": \"paged\", \"page_size\": 64}}'") from None
        try:
            parse_config(config)
        except ConfigError as exc:
            raise RunError(f"config {value!r}: {exc}") from exc
        configs[json.dumps(config, separators=(",", ":"))] = config
    return configs


@dataclass(frozen=True)
class ConfigResult:
    """One row of the table: a cache config's memory, speed and agreement with the baseline."""

    name: str
    config: dict[str, Any] | None
    kv_bytes: int
    bytes_per_token: float
    prefill_s: float
    decode_tokens_per_s: float
    speed_ratio: float
    equal: bool
    same_prefix: int  # leading generated tokens equal to the baseline's (lossy configs drift later)
    answer: str


def _measure(model: Any, inputs: dict[str, torch.Tensor], config: dict[str, Any] | None,
             new_tokens: int) -> tuple[torch.Tensor, int, int, GenerationTiming]:
    """Generate under one config: (generated tokens, KV bytes held, tokens cached, timing)."""
    if config is None:
        cache = DynamicCache(config=model.config)
    else:
        cache = KVCacheFactory(model.config, config).create_cache()
    timing = timed_generate(model, inputs, cache, new_tokens)
    held = dynamic_cache_bytes(cache) if config is None else int(cache.memory_report()["allocated"])
    tokens = cache.get_seq_length() * timing.sequences.shape[0]
    generated = timing.sequences[:, inputs["input_ids"].shape[1]:]
    del cache
    gc.collect()
    return generated, held, tokens, timing


def run(context: int = 4096, new_tokens: int = 64, configs: list[str] | None = None, threads: int = 1,
        json_path: Path | None = None, console: Console | None = None) -> dict[str, Any]:
    """Run the comparison, print the table and the baseline's answer; return (and optionally save) it."""
    if context < 1 or new_tokens < 2 or threads < 1:
        raise RunError(f"context={context}, new_tokens={new_tokens}, threads={threads}: expected "
                       f"context >= 1, new_tokens >= 2 (decode speed needs a step after the first), "
                       f"threads >= 1")
    named = {BASELINE: None} | parse_configs(configs)
    console = console or Console()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("loading the embedded model", total=2 + len(named))
            model, tokenizer = load_model()
            limit = model.config.max_position_embeddings
            prompt = build_prompt(tokenizer, context)
            inputs = tokenizer(prompt, return_tensors="pt")
            prompt_tokens = inputs["input_ids"].shape[1]
            if prompt_tokens + new_tokens > limit:
                raise RunError(f"context {context}: the prompt ({prompt_tokens} tokens) plus {new_tokens} "
                               f"new tokens exceeds the model's {limit} positions")
            progress.update(task, advance=1, description="warm-up (short prompt, every config)")
            short = {k: v[:, :16] for k, v in inputs.items()}
            for config in named.values():
                _measure(model, short, config, 2)
            progress.advance(task)
            measured = {}
            for name, config in named.items():
                progress.update(task, description=f"{name}: prefill {prompt_tokens} + decode {new_tokens}")
                measured[name] = _measure(model, inputs, config, new_tokens)
                progress.advance(task)
    finally:
        torch.set_num_threads(previous_threads)
    reference, _, tokens, base = measured[BASELINE]
    rows = [ConfigResult(name, named[name], held, held / cached, timing.prefill_s, timing.decode_tokens_per_s,
                         timing.decode_tokens_per_s / base.decode_tokens_per_s,
                         bool(torch.equal(generated, reference)), _same_prefix(generated, reference),
                         tokenizer.decode(generated[0], skip_special_tokens=True))
            for name, (generated, held, cached, timing) in measured.items()]
    answer = tokenizer.decode(reference[0], skip_special_tokens=True)
    report = {"model": "SmolLM2-135M-Instruct (embedded, fp32)", "threads": threads,
              "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "cached_tokens": tokens,
              "fp16_dense_reference_bytes": kv_bytes(model.config, tokens, dtype="fp16"),
              "question": QUESTION.strip(), "answer": answer, "results": [asdict(r) for r in rows]}
    _print(console, report, rows)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _same_prefix(generated: torch.Tensor, reference: torch.Tensor) -> int:
    """Generated tokens (of the first row) equal to the reference's before the first difference."""
    differs = (generated[0] != reference[0]).nonzero()
    return int(differs[0, 0]) if differs.numel() else generated.shape[1]


def lossy(config: dict[str, Any] | None) -> bool:
    """Quantized, evicting or reading sparsely: tokens may drift from the baseline's."""
    parsed = None if config is None else parse_config(config)
    if parsed is None:
        return False
    sparse = parsed.selector is not None and not parsed.selector.build_selector().reads_all
    return parsed.quantization is not None or parsed.selective is not None or sparse


def _print(console: Console, report: dict[str, Any], rows: list[ConfigResult]) -> None:
    table = Table(title=f"{report['model']}: {report['prompt_tokens']} prompt + {report['new_tokens']} new "
                        f"tokens, greedy, {report['threads']} thread(s)",
                  caption=f"speed ratio: decode tok/s over {BASELINE}'s; same tokens: greedy tokens equal "
                          f"{BASELINE}'s. {report['cached_tokens']} tokens cached; an fp16 dense cache of "
                          f"them holds {format_bytes(report['fp16_dense_reference_bytes'])}.")
    table.add_column("config", overflow="fold")
    headers = ("KV bytes", "bytes/\ntoken", "prefill\ns", "decode\ntok/s", "speed\nratio", "same\ntokens")
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("answer (first words)", overflow="ellipsis", no_wrap=True, max_width=28)
    for r in rows:
        if r.name == BASELINE:
            same = "ref"
        elif r.equal:
            same = "yes"
        else:  # lossy configs may drift: say after how many tokens; lossless ones must not
            same = f"{r.same_prefix}/{report['new_tokens']}" if lossy(r.config) else "[red]NO[/red]"
        table.add_row(escape(r.name), format_bytes(r.kv_bytes), f"{r.bytes_per_token:,.0f}",
                      f"{r.prefill_s:.2f}", f"{r.decode_tokens_per_s:.2f}", f"{r.speed_ratio:.2f}", same,
                      escape(" ".join(r.answer.split())))
    console.print(table)
    console.print(Panel(Text.assemble(report["question"], (report["answer"], "bold")),
                        title=f"{BASELINE}: end of the prompt and the generated tokens (bold)"))
