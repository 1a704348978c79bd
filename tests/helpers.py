"""Helpers shared by the test modules: run ``generate`` against a cache and compare two runs."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfactory.selectors.oval.gate import BlockGate, GateShape
from kvfactory.selectors.oval.lowrank import LowRankScorer, LowRankShape
from kvfactory.selectors.oval.router import Router, RouterShape
from kvfactory.texts import shipped_text

# The repository sits next to ``shared/`` (``/work/main`` and ``/work/shared``; CI has the same layout).
DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
WIKITEXT = DATA_DIR / "wikitext2_test.txt"
LOGITS_ATOL = 1e-5  # README "Guarantees": lossless configs give logits within 1e-5 of DynamicCache in fp32




@torch.no_grad()
def generate(model: Any, inputs: dict[str, torch.Tensor], cache: Any, seed: int | None = None,
             **kwargs: Any) -> Any:
    """``model.generate`` with ``cache``, returning the dict output with per-step logits.

    ``seed`` seeds torch right before the call, so two runs sample the same random numbers.
    """
    params = {"max_new_tokens": 8, "do_sample": False, "output_logits": True,
              "return_dict_in_generate": True} | kwargs
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(**inputs, past_key_values=cache, **params)


def max_logit_diff(ref: Any, out: Any) -> float:
    assert len(ref.logits) == len(out.logits), "different number of generation steps"
    return max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits, strict=True))


def diff_before_divergence(ref: Any, out: Any) -> float:
    """The largest logit difference of two generations at the steps where every row had been fed the
    same tokens: each row's steps up to and including its first different token (a lossy cache's
    error, without the noise of comparing different continuations)."""
    assert ref.sequences.shape[0] == out.sequences.shape[0], "different numbers of rows"
    steps = len(ref.logits)
    new = ref.sequences.shape[1] - steps, out.sequences.shape[1] - len(out.logits)
    assert new[0] == new[1], "different prompt widths"
    worst = 0.0
    for row in range(ref.sequences.shape[0]):
        same = ref.sequences[row, new[0]:] == out.sequences[row, new[0]:][:steps]
        last = int(same.long().cumprod(0).sum().item())  # steps before the first different token
        for step in range(min(last + 1, steps, len(out.logits))):
            worst = max(worst, (ref.logits[step][row] - out.logits[step][row]).abs().max().item())
    return worst


def assert_same_generation(ref: Any, out: Any, atol: float = LOGITS_ATOL) -> None:
    """Identical tokens and logits within ``atol`` at every step (and beam scores, if any)."""
    assert ref.sequences.shape == out.sequences.shape, (ref.sequences.shape, out.sequences.shape)
    mismatch = (ref.sequences != out.sequences).nonzero().tolist()
    assert not mismatch, f"tokens differ at (row, position) {mismatch[:5]}"
    diff = max_logit_diff(ref, out)
    assert diff <= atol, f"logits differ by {diff:.3g} > {atol}"
    if getattr(ref, "sequences_scores", None) is not None:
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=atol, rtol=0)


def kv_slot_bytes(model_config: Any, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one token's keys and values in one layer, from the model config alone."""
    cfg = model_config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def layer_sizes(cache: Any) -> list[int]:
    """Tokens stored per batch row in every layer of a kvfactory cache."""
    return [cache.size(i) for i in range(len(cache.layers))]


@dataclass(eq=False)
class FirstLastRetain:
    """A user eviction policy for tests, mixed into a storage class ahead of it: after each step
    ``retain`` keeps the first ``first`` and the last ``last`` stored tokens (StreamingLLM-like)."""

    first: int = 4
    last: int = 8

    def retain(self) -> None:
        n = self.size()
        if n > self.first + self.last:
            self.keep(torch.cat([torch.arange(self.first), torch.arange(n - self.last, n)]))


def apply_edit(store: Any, op: str, arg: Any, ref_k: torch.Tensor, ref_v: torch.Tensor,
               fresh: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply one random-test edit to ``store`` and the same edit to the reference K/V; return the new
    references. ``fresh(tokens, rows)`` makes the K/V an ``append`` adds; ``keep``'s ``arg`` is a
    16-bit mask over positions, ``keep_heads``' a seed for per row and head subsets, ``select_rows``'s a
    list of rows (taken modulo the batch)."""
    rows, n = ref_k.shape[0], ref_k.shape[2]
    if op == "append":
        k, v = fresh(arg, rows)
        store.append(k, v)
        return torch.cat([ref_k, k], 2), torch.cat([ref_v, v], 2)
    if op == "drop_front":
        store.drop_front(arg)
        return ref_k[:, :, arg:], ref_v[:, :, arg:]
    if op == "truncate":
        store.truncate(arg)
        return ref_k[:, :, :arg], ref_v[:, :, :arg]
    if op == "keep":
        index = torch.tensor([i for i in range(n) if arg >> (i % 16) & 1], dtype=torch.long)
        store.keep(index)
        return ref_k.index_select(2, index), ref_v.index_select(2, index)
    if op == "keep_heads":  # ``arg`` seeds a random sorted subset of the same size per row and head
        gen = torch.Generator().manual_seed(arg)
        kept = arg % (n + 1)
        index = torch.rand(rows, ref_k.shape[1], n, generator=gen).argsort(-1)[..., :kept].sort(-1).values
        store.keep(index)
        expand = index.unsqueeze(-1).expand(*index.shape, ref_k.shape[3])
        return ref_k.gather(2, expand), ref_v.gather(2, expand)
    index = torch.tensor([r % rows for r in arg])
    store.select_rows(index)
    return ref_k[index], ref_v[index]


@contextlib.contextmanager
def attn_implementation(model: torch.nn.Module, name: str):
    """``model`` with attention ``name`` inside the block, SDPA again after it."""
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation("sdpa")


@functools.cache
def tiny_router(hidden: int, kv_heads: int, head_dim: int, layers: tuple[int, ...], kind: str = "query",
                query_heads: int = 4) -> str:
    """An untrained OVAL router file of ``kind`` for these shapes (the matrix checks mechanics, not
    routing): a query scorer with random projections and code scales fitted to random keys, a
    block gate started from random keys' principal directions, or a prefetch router."""
    path = Path(tempfile.mkdtemp()) / "router.safetensors"
    torch.manual_seed(0)
    if kind == "prefetch":
        Router(RouterShape(hidden, kv_heads, head_dim, layers, group_size=1)).save(path)
        return str(path)
    if kind == "gate":
        gate = BlockGate(GateShape(query_heads, kv_heads, head_dim, layers))
        gate.init_from_keys(torch.randn(len(layers), kv_heads, 256, head_dim))
        gate.save(path)
        return str(path)
    scorer = LowRankScorer(LowRankShape(query_heads, kv_heads, head_dim, layers))
    with torch.no_grad():
        scorer.query.normal_(std=head_dim ** -0.5)
        scorer.key.normal_(std=head_dim ** -0.5)
    scorer.fit_code_scales(torch.randn(len(layers), kv_heads, 256, head_dim))
    scorer.save(path)
    return str(path)


def fit_tiny_scorer(kind: str, epochs: int) -> tuple[Any, list[Any], float, float]:
    """A ``kind`` scorer (``"query"`` or ``"gate"``) trained on a tiny llama's own page attention (two
    512-token prompts, 8 positions per 256-token chunk, keys kept): the scorer, the teacher's chunks and
    the summed loss from the principal key directions before training and after."""
    from tiny_models import random_prompt, tiny_model

    from kvfactory.selectors import teacher
    from kvfactory.selectors.oval import train as oval_train

    model = tiny_model("llama", max_position_embeddings=1024)
    ids = torch.cat([random_prompt(512, seed=s)[0] for s in range(2)])
    scorer = oval_train.new_router(model, 0, "tiny", kind)
    chunks = teacher.collect(model, ids, scorer.shape.layers, 8, 256, seed=0, keys=True)
    scorer.init_from_keys(oval_train._sample_keys(chunks))

    def total() -> float:
        with torch.no_grad():
            return sum(float(oval_train.LOSSES[kind](scorer, c, 0.25, "mass")) for c in chunks)
    before = total()
    oval_train.train(scorer, chunks, epochs=epochs, budget=0.25)
    return scorer, chunks, before, total()


@torch.no_grad()
def greedy_tokens(model: Any, prompt: list[int], new_tokens: int, cache: Any = None) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` with ``cache`` (default ``DynamicCache``), one
    forward per token and EOS not special: the reference an engine's greedy output must equal."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=model.config)
    ids, out = torch.tensor([prompt]), []
    for _ in range(new_tokens):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


@torch.no_grad()
def first_divergence(model: Any, prompt: list[int], tokens: list[int], cache: Any = None
                     ) -> tuple[int, float] | None:
    """Where ``tokens`` first part from ``greedy_tokens``' reference after ``prompt`` with ``cache``: the
    position, and how far below the reference's best logit there ``tokens``' token scores; None where they
    never part. What a near tie allows (vLLM's ``check_logprobs_close`` compares so): equal tokens, then
    one step whose token the reference scores within a tolerance of its best, after which the sequences
    no longer share a prefix to compare."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    for i, token in enumerate(tokens):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
        best = int(logits.argmax())
        if best != token:
            return i, float(logits[best] - logits[token])
        ids = torch.tensor([[best]])
    return None


def wikitext_excerpt() -> str:
    """The first ~40,000 characters of WikiText-2 test (~4 characters per token: comfortably more
    than 4,096 tokens); the shipped excerpt is the same text's beginning, so the tests never skip
    without shared/."""
    text = WIKITEXT.read_text(encoding="utf-8") if WIKITEXT.exists() else shipped_text()
    lines, chars = [], 0
    for line in text.splitlines():
        lines.append(line)
        chars += len(line)
        if chars > 40_000:
            break
    return "\n".join(lines)
