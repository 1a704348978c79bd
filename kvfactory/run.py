"""``kvfactory run``: one long real prompt generated under several cache configs side by side.

The embedded model reads at least ``context`` tokens of shipped WikiText-2 text plus a question
about it (plain prompt, no chat template) and decodes greedily under transformers' ``DynamicCache``
(the baseline, always run first) and each kvfactory config. The default set tells the story in a
few minutes: paged (lossless), paged int4 (memory), SnapKV compressing the prompt by 75 %
(eviction), and Quest and the OVAL router reading 1/8 of the pages per decode step (sparse reads);
``every=True`` (``--all``) runs every preset. Each config's row is printed when it finishes: KV
bytes held after generation, prefill time (one run), decode speed and its ratio to the baseline
(medians of segments interleaved with the baseline, see ``compare``), whether the tokens match the
baseline's (for lossy configs: how many leading tokens do) and the start of its answer.
"""

from __future__ import annotations

import copy
import gc
import json
import re
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text
from transformers import DynamicCache

from kvfactory.cache import dynamic_cache_bytes
from kvfactory.config import parse_config
from kvfactory.factory import KVCacheFactory
from kvfactory.measure import GenerationTiming, timed_continue, timed_generate
from kvfactory.models import EMBEDDED, load_model
from kvfactory.run_configs import MIN_NEW_TOKENS, SEGMENTS, RunError, parse_configs
from kvfactory.sizing import format_bytes, kv_bytes
from kvfactory.texts import shipped_text

BASELINE = "DynamicCache"
MODEL_LABEL = "SmolLM2-135M-Instruct (embedded, fp32)"
TIMING = (f"prefill_s: one run. decode_tokens_per_s, speed_ratio: medians over the segments, each run right "
          f"after a {BASELINE} segment at the same positions (the segment's baseline_tokens_per_s)")
_SENTENCE_END = re.compile(r" \.(?= )|\n")  # WikiText writes "word . Next"
# About the first article: some 4,000 tokens before the question at the default context.
QUESTION = "\nQuestion: What is Robert Boulter's profession?\nAnswer: Robert Boulter is an English"


def build_prompt(tokenizer: Any, context: int, question: str = QUESTION) -> str:
    """Whole sentences of the shipped text holding at least ``context`` tokens, then ``question``."""
    text = shipped_text()
    offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    if context > len(offsets):
        raise RunError(f"context {context}: the shipped text holds only {len(offsets)} tokens")
    sentence_end = _SENTENCE_END.search(text, offsets[context - 1][1])
    return text[:sentence_end.end() if sentence_end else len(text)] + question


@dataclass(frozen=True)
class Segment:
    """One decode segment of a config and the baseline's segment run just before it at the same
    positions: the pair's ratio is robust to the machine's load drifting between configs."""

    tokens: int
    tokens_per_s: float
    baseline_tokens_per_s: float
    ratio: float


@dataclass(frozen=True)
class ConfigResult:
    """One row: a cache config's memory, speed and agreement with the baseline.

    ``prefill_s`` is one run; ``decode_tokens_per_s`` and ``speed_ratio`` are the medians over
    ``segments``.
    """

    name: str
    config: dict[str, Any] | None
    kv_bytes: int
    bytes_per_token: float
    prefill_s: float
    decode_tokens_per_s: float
    speed_ratio: float
    segments: list[Segment]
    equal: bool
    same_prefix: int  # leading generated tokens equal to the baseline's (lossy configs drift later)
    answer: str


def more_bytes_reason(config: dict[str, Any]) -> str:
    """Why a config can hold more bytes than ``DynamicCache`` (what its parts keep besides the K/V)."""
    parsed = parse_config(config)
    if parsed.selector is not None:
        return ("sparse reads keep every token in plain pages (they save reads, not memory) and add "
                "each page's summary for routing")
    if parsed.quantization is not None:
        return "the codec keeps its window of recent tokens unquantized, most of a short prompt"
    if parsed.eviction is not None:
        return "the policy holds the step's new tokens on top of its budget until it evicts"
    return "pages are whole: each layer's last page is partly empty"


def segment_sizes(decode_tokens: int, segments: int = SEGMENTS) -> list[int]:
    """``decode_tokens`` split into ``segments`` near-equal segments, longer ones first."""
    size, longer = divmod(decode_tokens, segments)
    return [size + (i < longer) for i in range(segments)]


def pair_segments(config: list[GenerationTiming], baseline: list[GenerationTiming]) -> list[Segment]:
    """Each of a config's decode segments beside the baseline segment run just before it."""
    return [Segment(c.new_tokens, c.decode_tokens_per_s, b.decode_tokens_per_s,
                    c.decode_tokens_per_s / b.decode_tokens_per_s)
            for c, b in zip(config, baseline, strict=True)]


def medians(segments: list[Segment]) -> tuple[float, float]:
    """(median tokens/s, median of the paired speed ratios) over ``segments``."""
    return (statistics.median(s.tokens_per_s for s in segments),
            statistics.median(s.ratio for s in segments))


@dataclass
class _Decode:
    """A cache being decoded: its sequences so far and the timing of each segment."""

    cache: Any
    sequences: torch.Tensor
    timings: list[GenerationTiming] = field(default_factory=list)
    prompt_cache: Any = None  # the baseline's: its cache right after the prefill


def decode_interleaved(model: Any, decodes: list[_Decode], sizes: list[int]) -> None:
    """For each segment size, continue every decode in turn by that many tokens (greedy, EOS ignored)."""
    for size in sizes:
        for decode in decodes:
            timing = timed_continue(model, decode.sequences, decode.cache, size)
            decode.sequences = timing.sequences
            decode.timings.append(timing)


def _new_cache(model: Any, config: dict[str, Any] | None) -> Any:
    if config is None:
        return DynamicCache(config=model.config)
    return KVCacheFactory(model.config, config).create_cache()


def _prefill(model: Any, inputs: dict[str, torch.Tensor], config: dict[str, Any] | None
             ) -> tuple[_Decode, GenerationTiming]:
    """A fresh cache of ``config`` filled with the prompt, and the prefill's timing (first token)."""
    cache = _new_cache(model, config)
    prefill = timed_generate(model, inputs, cache, 1)
    return _Decode(cache, prefill.sequences), prefill


def _warm_up(model: Any, inputs: dict[str, torch.Tensor], configs: Iterable[dict[str, Any] | None]) -> None:
    """A short prefill and continuation per config, so one-time costs stay out of the numbers."""
    short = {k: v[:, :16] for k, v in inputs.items()}
    for config in configs:
        decode, _ = _prefill(model, short, config)
        decode_interleaved(model, [decode], [2])


def _result(name: str, config: dict[str, Any] | None, decode: _Decode, prefill: GenerationTiming,
            baseline: list[GenerationTiming], reference: torch.Tensor, tokenizer: Any) -> ConfigResult:
    """The row of a finished decode; ``reference`` is the baseline's generated tokens."""
    cache = decode.cache
    held = dynamic_cache_bytes(cache) if config is None else int(cache.memory_report()["allocated"])
    cached = cache.get_seq_length() * decode.sequences.shape[0]
    generated = decode.sequences[:, -reference.shape[1]:]
    segments = pair_segments(decode.timings, baseline)
    tokens_per_s, ratio = medians(segments)
    return ConfigResult(name, config, held, held / cached, prefill.prefill_s, tokens_per_s, ratio, segments,
                        bool(torch.equal(generated, reference)), _same_prefix(generated, reference),
                        tokenizer.decode(generated[0], skip_special_tokens=True))


def compare(model: Any, tokenizer: Any, configs: dict[str, dict[str, Any]], context: int, new_tokens: int,
            console: Console, threads: int = 1, label: str = MODEL_LABEL) -> dict[str, Any]:
    """Generate ``new_tokens`` after the prompt under the baseline, then each of ``configs``, printing
    each row as it finishes; return the report.

    Each cache is prefilled once, then decodes in ``SEGMENTS`` segments. The baseline's cache is kept
    after its own run and cropped back to the prompt before each config, whose segments each run
    right after a baseline segment at the same positions. Speeds are medians over segments.
    """
    inputs = tokenizer(build_prompt(tokenizer, context), return_tensors="pt")
    prompt_tokens = inputs["input_ids"].shape[1]
    limit = model.config.max_position_embeddings
    if prompt_tokens + new_tokens > limit:
        raise RunError(f"context {context}: the prompt ({prompt_tokens} tokens) plus {new_tokens} "
                       f"new tokens exceeds the model's {limit} positions")
    sizes = segment_sizes(new_tokens - 1)
    report = {"model": label, "threads": threads, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
              "decode_segments": sizes, "timing": TIMING, "question": QUESTION.strip()}
    printer = RowPrinter(console, [BASELINE, *configs], new_tokens)
    printer.header(report)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("warm-up (short prompt, every config)", total=len(configs) + 2)
        _warm_up(model, inputs, [None, *configs.values()])
        progress.update(task, advance=1, description=f"{BASELINE}: prefill {prompt_tokens} + decode "
                                                     f"{new_tokens}")
        baseline, row = _measure_baseline(model, inputs, sizes, tokenizer)
        reference, rows = baseline.sequences[:, prompt_tokens:], [row]
        printer.row(row)
        report |= {"cached_tokens": baseline.cache.get_seq_length(),
                   "answer": tokenizer.decode(reference[0], skip_special_tokens=True)}
        for name, config in configs.items():
            progress.update(task, advance=1, description=f"{name}: prefill {prompt_tokens} + decode "
                                                         f"{new_tokens}, interleaved with {BASELINE}")
            rows.append(_measure_config(model, inputs, name, config, baseline, sizes, reference, tokenizer))
            printer.row(rows[-1])
        progress.advance(task)
    report |= {"fp16_dense_reference_bytes": kv_bytes(model.config, report["cached_tokens"], dtype="fp16"),
               "results": [asdict(row) for row in rows]}
    printer.footer(report)
    return report


def _measure_baseline(model: Any, inputs: dict[str, torch.Tensor], sizes: list[int], tokenizer: Any
                      ) -> tuple[_Decode, ConfigResult]:
    """The baseline's prefill and its own segments, and its row (speed ratio 1 by definition). Its
    cache as the prefill left it stays in ``baseline.prompt_cache``: each config's baseline segments
    restart from a copy (a sliding-window layer cannot be cropped back to the prompt)."""
    baseline, prefill = _prefill(model, inputs, None)
    baseline.prompt_cache = copy.deepcopy(baseline.cache)
    decode_interleaved(model, [baseline], sizes)
    reference = baseline.sequences[:, inputs["input_ids"].shape[1]:]
    return baseline, _result(BASELINE, None, baseline, prefill, baseline.timings, reference, tokenizer)


def _measure_config(model: Any, inputs: dict[str, torch.Tensor], name: str, config: dict[str, Any],
                    baseline: _Decode, sizes: list[int], reference: torch.Tensor, tokenizer: Any
                    ) -> ConfigResult:
    """One config's row: its prefill, then its segments interleaved with the baseline's from the prompt."""
    decode, prefill = _prefill(model, inputs, config)
    prompt_tokens = inputs["input_ids"].shape[1]
    rewound = _Decode(copy.deepcopy(baseline.prompt_cache), baseline.sequences[:, :prompt_tokens + 1])
    decode_interleaved(model, [rewound, decode], sizes)
    row = _result(name, config, decode, prefill, rewound.timings, reference, tokenizer)
    del decode  # free this config's cache before the next one is built
    gc.collect()
    return row


def run(context: int = 4096, new_tokens: int = 64, configs: list[str] | None = None, threads: int = 1,
        json_path: Path | None = None, console: Console | None = None, every: bool = False,
        model_name: str = EMBEDDED) -> dict[str, Any]:
    """Load ``model_name`` (the embedded model by default; ``kvfactory.models.load_model``) and
    ``compare`` the configs on ``threads`` torch threads; return (and optionally save as JSON) the
    report."""
    if context < 1 or new_tokens < MIN_NEW_TOKENS or threads < 1:
        raise RunError(f"context={context}, new_tokens={new_tokens}, threads={threads}: expected "
                       f"context >= 1, new_tokens >= {MIN_NEW_TOKENS} ({SEGMENTS} decode segments of at "
                       f"least 2 after the prefill's token), threads >= 1")
    named = parse_configs(configs, every)
    console = console or Console()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with console.status(f"loading {model_name}"):
            model, tokenizer = load_model(model_name)
        label = MODEL_LABEL if model_name == EMBEDDED else f"{model_name} (fp32)"
        report = compare(model, tokenizer, named, context, new_tokens, console, threads, label)
    finally:
        torch.set_num_threads(previous_threads)
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
    return parsed.quantization is not None or parsed.eviction is not None or sparse


def _short(x: float) -> str:
    """Two decimals below 100, whole numbers above (a tiny model's decode speed fits its column)."""
    return f"{x:.2f}" if x < 100 else f"{x:,.0f}"


# (header line 1, header line 2, width): numbers right-aligned after the config's name
_COLUMNS = (("", "KV bytes", 10), ("bytes/", "token", 8), ("prefill", "s", 9), ("decode", "tok/s", 8),
            ("speed", "ratio", 7), ("same", "tokens", 8))
_NUMBERS_WIDTH = sum(width for *_, width in _COLUMNS)


class RowPrinter:
    """Prints rows one at a time in columns that fit the console (80 columns in log files).

    The name column is as wide as the longest name where that fits; a longer name gets a line of
    its own with the numbers under it, so no name is cut. Each answer goes on an indented line
    under its row, cut to the width.
    """

    def __init__(self, console: Console, names: list[str], new_tokens: int) -> None:
        self.console, self.new_tokens = console, new_tokens
        longest = max(len(name) for name in [*names, "config"])
        self.name_width = max(len("config"), min(longest, console.width - _NUMBERS_WIDTH))

    def header(self, report: dict[str, Any]) -> None:
        """The title, what the columns measure and the column names."""
        sizes = report["decode_segments"]
        lengths = f"{sizes[0]}" if len(set(sizes)) == 1 else "/".join(map(str, sizes))
        threads = f"{report['threads']} thread" + ("s" if report["threads"] > 1 else "")
        self.console.print(Text(f"{report['model']}, {threads}: {report['prompt_tokens']} prompt + "
                                f"{report['new_tokens']} new tokens", style="bold"))
        self.console.print(Text(
            f"prefill s: one run. decode tok/s and speed ratio: medians over {len(sizes)} segments of "
            f"{lengths} tokens, each run right after a {BASELINE} segment at the same positions; the ratio "
            f"divides by that segment's tok/s. same tokens: the greedy tokens equal {BASELINE}'s (lossy "
            f"configs: how many leading ones do).", style="dim"))
        for line, label in ((0, ""), (1, "config")):
            cells = "".join(column[line].rjust(column[2]) for column in _COLUMNS)
            self.console.print(Text(label.ljust(self.name_width) + cells, style="bold"), no_wrap=True)

    def row(self, result: ConfigResult) -> None:
        """One config's name and numbers, then its answer."""
        same, style = self._same(result)
        cells = (format_bytes(result.kv_bytes), f"{result.bytes_per_token:,.0f}", _short(result.prefill_s),
                 _short(result.decode_tokens_per_s), f"{result.speed_ratio:.2f}")
        numbers = Text("".join(cell.rjust(column[2]) for cell, column in zip(cells, _COLUMNS, strict=False)))
        numbers.append(same.rjust(_COLUMNS[-1][2]), style=style)
        if len(result.name) <= self.name_width:
            self.console.print(Text(result.name.ljust(self.name_width)) + numbers, no_wrap=True)
        else:
            self.console.print(Text(result.name))
            self.console.print(Text(" " * self.name_width) + numbers, no_wrap=True)
        answer = " ".join(result.answer.split())
        self.console.print(Text(f"  → {answer}", style="dim"), no_wrap=True, overflow="ellipsis")

    def _same(self, result: ConfigResult) -> tuple[str, str]:
        if result.name == BASELINE:
            return "ref", ""
        if result.equal:
            return "yes", ""
        if lossy(result.config):  # lossy configs may drift: say after how many tokens
            return f"{result.same_prefix}/{self.new_tokens}", ""
        return "NO", "bold red"  # a lossless config must not

    def footer(self, report: dict[str, Any]) -> None:
        """The fp16 reference size, why a row holds more bytes than the baseline, and the baseline's
        answer after the end of the prompt."""
        self.console.print(Text(f"{report['cached_tokens']} tokens cached; an fp16 dense cache of them holds "
                                f"{format_bytes(report['fp16_dense_reference_bytes'])}.", style="dim"))
        baseline, *rows = report["results"]
        for row in rows:
            if row["kv_bytes"] > baseline["kv_bytes"]:
                self.console.print(Text(f"{row['name']} holds more bytes than {BASELINE}: "
                                        f"{more_bytes_reason(row['config'])}.", style="dim"))
        self.console.print(Panel(Text.assemble(report["question"], (report["answer"], "bold")),
                                 title=f"{BASELINE}: end of the prompt and the generated tokens (bold)"))
