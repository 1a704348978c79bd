"""The ``kvfactory`` command line: ``size`` (KV memory calculator), ``run`` (side-by-side caches),
``serve`` (an OpenAI-compatible server), evaluation and calibration.

Commands only parse arguments; the work lives in ``kvfactory.sizing``, ``kvfactory.run``,
``kvfactory.server`` and the packages each command names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table

from kvfactory import models, sizing
from kvfactory.errors import KVFactoryError
from kvfactory.run_configs import DEFAULT_CONFIGS, MIN_NEW_TOKENS, PRESETS, SEGMENTS, RunError, parse_configs

app = typer.Typer(help="KV-cache management for Hugging Face transformers.", no_args_is_help=True,
                  rich_markup_mode=None,
                  add_completion=False)


def _version(shown: bool) -> None:
    if shown:
        from kvfactory import __version__

        typer.echo(f"kvfactory {__version__}")
        raise typer.Exit


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print kvfactory's version and exit")] = False) -> None:
    """KV-cache management for Hugging Face transformers."""

# options several commands share
def _model(model: str) -> str:
    """``--model``: a packaged model's short name, a hub id, or a local folder that exists."""
    path = Path(model).expanduser()
    local = path.is_absolute() or model.startswith((".", "~"))
    if model not in models.PACKAGED and local and not path.exists():
        raise typer.BadParameter(f"{model!r}: no such model folder", param_hint="--model")
    if model in models.PACKAGED:
        try:
            models.PACKAGED[model].check_installed()
        except FileNotFoundError as exc:
            raise typer.BadParameter(str(exc), param_hint="--model") from None
    return model


ModelOption = Annotated[str, typer.Option(callback=_model,
                                          help="'smollm2' (embedded), 'gemma3-270m' (the gemma extra) "
                                          "or a local model folder / hub id")]
DenseLayersOption = Annotated[int, typer.Option(min=0, help="first layers read whole (not routed)")]
ThreadsOption = Annotated[int, typer.Option(min=1, help="torch CPU threads")]


def load_config(model: str) -> Any:
    """The transformers config of ``model`` (a packaged model's name, a config.json or a model folder),
    no weights."""
    if model in models.PACKAGED:
        return models.load_config(model)
    if not Path(model).exists():
        raise typer.BadParameter(f"{model!r} is neither one of {sorted(models.PACKAGED)} nor an existing "
                                 f"config.json or model folder", param_hint="--model")
    try:
        return models.load_config(model)
    except (OSError, ValueError, KeyError) as exc:
        raise typer.BadParameter(f"cannot read a model config from {model!r}: {exc}",
                                 param_hint="--model") from exc


def _memory(text: str) -> int:
    try:
        return sizing.parse_memory(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--memory") from exc


def _bytes(n: float) -> str:
    exact = f"{n:,.0f} B" if n == int(n) else f"{n:,.1f} B"
    return exact if n < 1024 else f"{exact} ({sizing.format_bytes(n)})"


def _configs(values: list[str] | None) -> list[str] | None:
    try:
        parse_configs(values)
    except RunError as exc:
        raise typer.BadParameter(str(exc), param_hint="--configs") from exc
    return values


@app.command()
def size(
    model: Annotated[str, typer.Option(help="'smollm2' (embedded), a config.json or a model folder")]
    = models.EMBEDDED,
    dtype: Annotated[sizing.DType, typer.Option(help="element type of an uncompressed cache")] = "fp16",
    context: Annotated[int, typer.Option(min=1, help="tokens per sequence")] = 8192,
    batch: Annotated[int, typer.Option(min=1, help="sequences")] = 1,
    codec: Annotated[sizing.Codec, typer.Option(help="KV encoding (see kvfactory.sizing)")] = "none",
    memory: Annotated[str, typer.Option(help="budget for the largest context: 8GiB, 512MiB, 2GB or bytes")]
    = "8GiB",
) -> None:
    """Estimate KV-cache memory for a model and the longest context a memory budget holds."""
    budget = _memory(memory)
    config = load_config(model)
    shape = sizing.KVShape.from_config(config)
    per_layer = sizing.bytes_per_token_per_layer(shape, dtype, codec)
    per_token = sizing.bytes_per_token(shape, dtype, codec)
    total = sizing.kv_bytes(shape, context, batch, dtype, codec)
    longest = sizing.max_context(shape, budget, batch, dtype, codec)
    windows = sorted({w for w in shape.windows if w is not None})
    sliding = sum(w is not None for w in shape.windows)
    layout = f"{shape.num_layers} layers" + (f" ({sliding} sliding, windows {windows})" if sliding else "")
    positions = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)

    table = Table(title=f"KV cache of {model}: {layout}, {shape.kv_heads} KV heads, "
                        f"head_dim {shape.head_dim}, {dtype}, codec {codec}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("per token per layer", _bytes(per_layer))
    table.add_row("per token, all layers", _bytes(per_token))
    table.add_row(f"{context:,} tokens × batch {batch}", _bytes(total))
    if longest is None:
        fits = "unbounded: every layer is sliding-window"
    else:
        fits = f"{longest:,} tokens" + (f" (model positions: {positions:,})" if positions else "")
    table.add_row(f"largest context in {memory.strip()}, batch {batch}", fits)
    Console().print(table)


@app.command()
def run(
    context: Annotated[int, typer.Option(min=1, help="tokens of shipped WikiText-2 text before the question")]
    = 4096,
    new_tokens: Annotated[int, typer.Option(min=MIN_NEW_TOKENS, help=f"tokens generated (greedy, EOS "
                                            f"ignored): the prefill's first, then {SEGMENTS} timed "
                                            f"decode segments")]
    = 64,
    configs: Annotated[list[str] | None, typer.Option(
        callback=_configs, help=f"repeatable: a preset ({', '.join(PRESETS)}) or a JSON cache "
                                f"config; default: {', '.join(DEFAULT_CONFIGS)}. DynamicCache "
                                f"always runs as the baseline")]
    = None,
    every: Annotated[bool, typer.Option("--all", help=f"run every preset ({len(PRESETS)} configs "
                                                      f"instead of {len(DEFAULT_CONFIGS)})")] = False,
    model: ModelOption = models.EMBEDDED,
    threads: ThreadsOption = 1,
    json_path: Annotated[Path | None, typer.Option("--json", help="also write the results as JSON")] = None,
) -> None:
    """Generate from one long real prompt with DynamicCache and kvfactory caches side by side,
    printing each config's row as it finishes."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # the run shows its own progress
    try:
        from kvfactory import run as run_job

        run_job.run(context, new_tokens, configs, threads, json_path, Console(), every, model)
    except RunError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except KVFactoryError as exc:  # a config that cannot hold the run (a pool too small): no traceback
        _fail(exc)


def _fail(exc: Exception) -> None:
    Console(stderr=True).print(f"[red]error:[/red] {type(exc).__name__}: {exc}", highlight=False)
    raise typer.Exit(2)


def _csv(text: str, kind: type, option: str) -> tuple:
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values:
        raise typer.BadParameter(f"{text!r}: expected comma-separated {kind.__name__}s", param_hint=option)
    return values


@app.command("eval")
def eval_(
    cache: Annotated[list[str] | None, typer.Option(
        help="repeatable: a preset (kvfactory/presets), a peer (transformers/quanto-int4, -int2, "
             "transformers/hqq-int4, -int2, transformers/sliding-window-W), a YAML file or an inline "
             "JSON/YAML config. DynamicCache always runs as the baseline")] = None,
    tasks: Annotated[str, typer.Option(help="comma-separated: ppl,passkey,needle,multiturn")]
    = "ppl,passkey,needle,multiturn",
    context: Annotated[str | None, typer.Option(
        help="comma-separated context lengths in tokens; default 2048,6144 (ppl: --ppl-context)")] = None,
    model: ModelOption = models.EMBEDDED,
    out: Annotated[Path, typer.Option(help="output folder for results.json, report.md and PNG plots")]
    = Path("results"),
    depths: Annotated[str | None, typer.Option(help="comma-separated needle/passkey depths in [0, 1]")]
    = None,
    samples: Annotated[int | None, typer.Option(
        min=1, help="passkey keys and needle haystacks per depth, and conversations")] = None,
    ppl_tokens: Annotated[int | None, typer.Option(
        min=1, help="teacher-forced tokens scored per PPL window (default 512)")] = None,
    ppl_windows: Annotated[int | None, typer.Option(
        min=1, help="PPL windows, spread over the text (default 4)")] = None,
    ppl_context: Annotated[str | None, typer.Option(
        help="comma-separated prefill lengths of the PPL windows; default --context if given, else 2048")]
    = None,
    text: Annotated[str, typer.Option(
        help="evaluation text: 'wikitext' (WikiText-2 test), 'alice' (Alice's Adventures in Wonderland, "
             "shipped) or a UTF-8 file; PPL windows, needle haystacks and conversation filler come from it")]
    = "wikitext",
    threads: ThreadsOption = 1,
    peer_results: Annotated[list[Path] | None, typer.Option(
        help="repeatable: a peer's JSON-lines results on this run's prompts.jsonl (benchmarks/peers/run.sh), "
             "merged into the report")] = None,
    prompts_only: Annotated[bool, typer.Option(
        help="only write OUT/prompts.jsonl (the prompts the run would use, for peers), then stop")] = False,
    question: Annotated[str, typer.Option(
        help="passkey/needle: the question 'inside' the prompt a cache compresses, or fed 'after' the "
             "compressed context (kvpress's pipeline; compare kvpress rows in this setting)")] = "inside",
    seed: Annotated[int, typer.Option(
        min=0, help="draws the passkeys, the needles' haystacks and the conversations' facts: "
                    "another seed, other prompts")] = 0,
) -> None:
    """Evaluate caches on perplexity, passkey, needle and multi-turn recall against DynamicCache."""
    import shlex
    import sys

    from kvfactory.eval import command, exchange, runner

    try:
        settings = command.settings_from_options(
            None if context is None else _csv(context, int, "--context"),
            None if depths is None else _csv(depths, float, "--depths"), samples, ppl_tokens, question,
            ppl_windows, None if ppl_context is None else _csv(ppl_context, int, "--ppl-context"), seed)
        task_list = runner.parse_tasks(tasks)
        specs = runner.resolve_caches(cache or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        line = shlex.join(["kvfactory"] + sys.argv[1:])
        command.evaluate(specs, task_list, settings, model, out, threads, line, peer_results or [],
                         prompts_only, Console(), text)
    except (runner.EvalError, exchange.PeerResultsError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    except KVFactoryError as exc:
        _fail(exc)


@app.command("report")
def report_(
    out: Annotated[Path, typer.Argument(help="the output folder of a finished kvfactory eval run")],
    peer_results: Annotated[list[Path], typer.Option(
        help="repeatable: a peer's JSON-lines results on OUT/prompts.jsonl (benchmarks/peers/run.sh)")],
) -> None:
    """Merge peer results (NVIDIA kvpress) into a finished evaluation and write its report again."""
    from kvfactory.eval import command, exchange

    try:
        command.rereport(out, peer_results, Console())
    except exchange.PeerResultsError as exc:
        raise typer.BadParameter(str(exc)) from exc


@app.command()
def calibrate(
    text: Annotated[Path, typer.Option(help="a UTF-8 text file to calibrate on (not your evaluation text)")],
    out: Annotated[Path, typer.Option(help="the safetensors file to write")] = Path("kv_scales.safetensors"),
    model: ModelOption = models.EMBEDDED,
    tokens: Annotated[int, typer.Option(min=16, help="tokens of the text to run through the model")] = 2048,
    threads: ThreadsOption = 1,
) -> None:
    """Collect per-layer, per-head K/V magnitudes on text: static scales for fp8 and int8 configs
    (quantization: {codec: fp8, scales: FILE})."""
    import torch

    from kvfactory.codecs import calibration

    body = read_text(text, "--text")
    torch.set_num_threads(threads)
    console = Console()
    with console.status(f"loading {model}"):
        loaded, tokenizer = models.load_model(model)
    ids = tokenizer(body, return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
    if ids.shape[1] < 16:
        raise typer.BadParameter(f"{text}: {ids.shape[1]} tokens; calibration needs at least 16",
                                 param_hint="--text")
    with console.status(f"running {ids.shape[1]} tokens through {model}"):
        scales = calibration.collect(loaded, ids)
    layers, heads = scales[calibration.KEYS].shape
    path = calibration.save(scales, out, {"model": model, "text": text.name, "tokens": str(ids.shape[1]),
                                          "layers": str(layers), "kv_heads": str(heads)})
    console.print(f"wrote {path}: |K| and |V| maxima of {layers} layers x {heads} KV heads over "
                  f"{ids.shape[1]} tokens of {text.name}. Use it as "
                  f"{{\"quantization\": {{\"codec\": \"fp8\", \"scales\": \"{path}\"}}}}")


def read_text(path: Path, param_hint: str | None = None) -> str:
    """A UTF-8 text file given on the command line; a usage error naming it if it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"{path}: cannot read it as UTF-8 text ({exc})",
                                 param_hint=param_hint) from exc


@app.command()
def serve(
    model: ModelOption = models.EMBEDDED,
    cache: Annotated[str, typer.Option(
        help="the paged KV cache: a preset (paged16, int8, int4, snapkv@0.5, quest@0.125, ...), a YAML "
             "file or an inline JSON/YAML config")] = "paged16",
    pool_tokens: Annotated[int | None, typer.Option(
        min=1, help="tokens per layer of the shared KV pool; default: the config's own pool options "
                    "(without any, the pool grows and nothing is preempted)")] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to listen on")] = 8000,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="sequences holding K/V at once")] = 16,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="tokens in one engine step")] = 512,
    max_waiting: Annotated[int, typer.Option(min=1, help="queued requests; beyond them a 503")] = 256,
    preemption: Annotated[Literal["swap", "recompute"], typer.Option(
        help="what makes room when the pool is full: swap K/V to host memory, or drop it and "
             "recompute")] = "swap",
    prefill_first: Annotated[bool, typer.Option(
        "--prefill-first/--mixed-steps",
        help="steps that prefill a prompt carry no decode tokens (wider decode batches, decodes "
             "paused while a prompt prefills), or every step decodes every running sequence")] = False,
    compile_step: Annotated[bool, typer.Option(
        "--compile-step/--eager-step",
        help="compile decode and prefill steps of plain or KIVI pages with torch.compile before "
             "serving (a minute or two)")]
    = False,
    tiers: Annotated[str | None, typer.Option(
        help="keep prompt chunks in these tiers, nearest first, comma-separated: host, disk:PATH, "
             "redis://HOST:PORT/DB (another server over the same Redis reuses them); plain pages only")]
    = None,
    tier_codec: Annotated[Literal["identity", "int8", "fp8", "int4"], typer.Option(
        help="codec of the chunks in --tiers")] = "identity",
    served_model_name: Annotated[str | None, typer.Option(
        help="the model name requests must give; default: --model as given")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of a chat request that gives none")]
    = 256,
    shutdown_timeout: Annotated[float, typer.Option(
        min=0, help="seconds requests in flight get to finish after SIGTERM before they are aborted")]
    = 10.0,
    retrain_on_drift: Annotated[float | None, typer.Option(
        min=0, max=1, help="with an OVAL query scorer: fine-tune it in the background when the shadow "
                           "hit rate stays under this for --drift-seconds (docs/sparse-reads.md)")] = None,
    drift_seconds: Annotated[float, typer.Option(
        min=0, help="seconds under --retrain-on-drift before retraining")] = 180.0,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads; default: torch's")] = None,
    log_level: Annotated[Literal["debug", "info", "warning", "error"], typer.Option(help="log level")]
    = "info",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics) with continuous batching over one KV pool."""
    import logging

    import torch

    from kvfactory.engine import Engine
    from kvfactory.eval.peers import is_peer
    from kvfactory.eval.runner import EvalError, resolve_cache
    from kvfactory.server import create_app
    from kvfactory.server import serve as serve_app
    from kvfactory.tiers import TierChain

    if is_peer(cache):  # refused whether or not the peer's package is installed
        raise typer.BadParameter(f"{cache!r}: the engine serves kvfactory's paged configs, not "
                                 f"transformers' caches", param_hint="--cache")
    try:
        spec = resolve_cache(cache)
    except EvalError as exc:
        raise typer.BadParameter(str(exc), param_hint="--cache") from exc
    if spec.kind != "kvfactory":
        raise typer.BadParameter(f"{cache!r}: the engine serves kvfactory's paged configs, not {spec.name}",
                                 param_hint="--cache")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if threads is not None:
        torch.set_num_threads(threads)
    loaded, tokenizer = models.load_model(model)
    try:
        chain = None if tiers is None else TierChain.from_spec([t.strip() for t in tiers.split(",")])
        engine = Engine(loaded, tokenizer, spec.config, pool_tokens=pool_tokens, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, max_waiting=max_waiting,
                        preemption=preemption, prefill_first=prefill_first, tiers=chain,
                        tier_codec=tier_codec, compile_step=compile_step)
    except KVFactoryError as exc:
        _fail(exc)
    if retrain_on_drift is not None:
        from kvfactory.selectors.oval.drift import DriftRetrainer

        selector = engine.manager.factory.config.selector
        router = "embedded" if selector is None else selector.options.get("router", "embedded")
        try:
            DriftRetrainer(router, retrain_on_drift, drift_seconds).attach(engine)
        except ValueError as exc:
            raise typer.BadParameter(f"{cache!r}: {exc}", param_hint="--retrain-on-drift") from exc
    serve_app.run(create_app(engine, served_model_name or model, max_tokens=max_tokens), host, port,
                  shutdown_timeout, log_level)


oval_app = typer.Typer(help="OVAL page routing: train a router (a query scorer or a prefetch router).",
                       no_args_is_help=True, rich_markup_mode=None)
app.add_typer(oval_app, name="oval")


@oval_app.command("train")
def oval_train(
    text: Annotated[list[Path], typer.Option(help="UTF-8 text to train on (repeat; not evaluation text)")],
    val_text: Annotated[list[Path], typer.Option(help="held-out UTF-8 text for the hit-rate curves")],
    out: Annotated[Path, typer.Option(help="the router file to write (safetensors)")]
    = Path("router.safetensors"),
    kind: Annotated[Literal["query", "gate", "prefetch"], typer.Option(
        help="query: the step's query against learned key codes; gate: the step's pooled queries against "
             "learned page embeddings; prefetch: pages predicted from the previous step's hidden state")
    ] = "query",
    model: ModelOption = models.EMBEDDED,
    dense_layers: DenseLayersOption = 2,
    chunks: Annotated[int, typer.Option(min=1, help="training chunks of --chunk tokens")] = 48,
    val_chunks: Annotated[int, typer.Option(min=1, help="held-out chunks")] = 12,
    chunk: Annotated[int, typer.Option(min=256, help="tokens per chunk")] = 2048,
    positions: Annotated[int, typer.Option(min=1, help="query positions sampled per chunk")] = 32,
    epochs: Annotated[int | None, typer.Option(min=1, help="training epochs [default: 8 for a query "
                                                           "scorer, 12 for a gate, 40 for a prefetch "
                                                           "router]",
                                               show_default=False)] = None,
    budget: Annotated[float, typer.Option(min=0.01, max=1.0, help="read budget of the top-k target")] = 0.125,
    objective: Annotated[Literal["mass", "output"], typer.Option(
        help="mass: each page's attention mass; output: what leaving the page out moves the attention "
             "output")] = "mass",
    mix: Annotated[bool, typer.Option(
        help="hand each layer where Quest or recent pages read with a lower held-out output error to "
             "them (used by \"mix\": true)")] = True,
    dim: Annotated[int | None, typer.Option(min=1, help="a gate's numbers per page embedding (float16: 2 "
                                                        "bytes each per page and KV head) [default: 32]",
                                            show_default=False)] = None,
    threads: ThreadsOption = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the report here")] = None,
) -> None:
    """Distil full attention into an OVAL router of either kind (the LM stays frozen), print hit-rate
    curves of the router, Quest, recent pages and the oracle on held-out text, and choose there the
    layers Quest or recent pages read better."""
    import json

    import torch

    from kvfactory.selectors.oval import train as oval_training

    try:  # before the model loads
        oval_training.check_dim(dim, kind)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--dim") from exc
    texts = [read_text(path) for path in [*text, *val_text]]
    torch.set_num_threads(threads)
    console = Console()
    with console.status(f"loading {model}"):
        loaded, tokenizer = models.load_model(model)
    report = oval_training.run(loaded, tokenizer, texts[:len(text)], texts[len(text):], str(out), model,
                               dense_layers, chunk, positions, chunks, val_chunks, epochs, budget, console,
                               kind, objective, mix, dim)
    layers = report["layers"]
    console.print(f"wrote {out}: {kind} router for layers {layers[0]}..{layers[-1]} of {model}")
    if mix:
        handed = report["layer_selectors"]
        console.print("layers read better by another selector on the held-out text: "
                      + (", ".join(f"{layer}: {name}" for layer, name in sorted(handed.items())) or "none")
                      + "; \"mix\": true reads them with it")
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")


@oval_app.command("mix")
def oval_mix(
    router: Annotated[Path, typer.Argument(help="a router file from `kvfactory oval train`; rewritten")],
    val_text: Annotated[list[Path], typer.Option(help="held-out UTF-8 text to choose on (not evaluation "
                                                      "text)")],
    model: ModelOption = models.EMBEDDED,
    val_chunks: Annotated[int, typer.Option(min=1, help="held-out chunks")] = 12,
    chunk: Annotated[int, typer.Option(min=256, help="tokens per chunk")] = 2048,
    positions: Annotated[int, typer.Option(min=1, help="query positions sampled per chunk")] = 32,
    budget: Annotated[float, typer.Option(min=0.01, max=1.0, help="read budget to compare at")] = 0.125,
    threads: ThreadsOption = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the report here")] = None,
) -> None:
    """Choose a trained router's per-layer mix on held-out text (what `oval train` does after
    training): each layer where Quest or recent pages read with a lower attention-output error is
    handed to them when a config sets "mix": true."""
    import json

    import torch

    from kvfactory.selectors.oval import train as oval_training

    texts = [read_text(path) for path in val_text]
    torch.set_num_threads(threads)
    console = Console()
    with console.status(f"loading {model}"):
        loaded, tokenizer = models.load_model(model)
    with console.status("teacher: full attention on the held-out text"):
        report = oval_training.mix_router(loaded, tokenizer, str(router), texts, chunk, positions, val_chunks,
                                          budget)
    handed = report["layer_selectors"]
    console.print(f"wrote {router}: layers read better by another selector: "
                  + (", ".join(f"{layer}: {name}" for layer, name in sorted(handed.items())) or "none"))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")


selectors_app = typer.Typer(help="Sparse reads: calibrate per-layer read budgets.", no_args_is_help=True,
                            rich_markup_mode=None)
app.add_typer(selectors_app, name="selectors")


@selectors_app.command("calibrate")
def selectors_calibrate(
    text: Annotated[list[Path], typer.Option(help="UTF-8 text to calibrate on (repeat; not evaluation text)")
                    ],
    out: Annotated[Path, typer.Option(help="the profile to write (JSON)")] = Path("layer_budgets.json"),
    model: ModelOption = models.EMBEDDED,
    dense_layers: DenseLayersOption = 2,
    context: Annotated[int, typer.Option(min=256, help="tokens per window (the context decoded at)")] = 6144,
    windows: Annotated[int, typer.Option(min=1, help="windows of --context tokens")] = 4,
    positions: Annotated[int, typer.Option(min=1, help="query positions sampled per window")] = 48,
    budget: Annotated[float, typer.Option(min=0.02, max=1.0, help="read budget to print the split of")]
    = 0.125,
    threads: ThreadsOption = 2,
) -> None:
    """Measure how much attention mass each layer's best pages (Quest's ranking) hold at each read
    budget, and write the profile that `"layer_budgets"` splits a read budget between layers by."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvfactory.selectors import calibrate
    from kvfactory.selectors.oval import train

    texts = [read_text(path) for path in text]
    torch.set_num_threads(threads)
    console = Console()
    with console.status(f"loading {model}"):
        loaded, tokenizer = models.load_model(model)
    layers = train.new_router(loaded, dense_layers, model).shape.layers
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("teacher: full attention on the calibration text", total=windows)
        try:
            profile = calibrate.calibrate(loaded, tokenizer, texts, model, layers, context, windows,
                                          positions, [path.name for path in text],
                                          lambda: progress.advance(task))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    profile.save(out)
    split = profile.allocate(budget, layers)
    uniform, fitted = profile.mean_recall(dict.fromkeys(layers, budget)), profile.mean_recall(split)
    console.print(f"wrote {out}: {profile.source['windows']} windows of {context} tokens, layers "
                  f"{layers[0]}..{layers[-1]}. At read budget {budget:g}: recall {uniform:.3f} with one "
                  f"budget, {fitted:.3f} split as "
                  + " ".join(f"{layer}:{b:.3f}" for layer, b in split.items()))
    console.print(f"Use it as {{\"name\": \"quest\", \"read_budget\": {budget:g}, "
                  f"\"layer_budgets\": \"{out}\"}}")


@oval_app.command("calibrate", hidden=True, context_settings={"ignore_unknown_options": True,
                                                             "allow_extra_args": True})
def oval_calibrate() -> None:
    """Moved: read-budget calibration is `kvfactory selectors calibrate` (it is not OVAL's)."""
    raise typer.BadParameter("moved to `kvfactory selectors calibrate`")


if __name__ == "__main__":  # python -m kvfactory.cli
    app()
