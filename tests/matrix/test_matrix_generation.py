"""Cross-cutting generation tests over the shared matrix (``configs.py``): greedy exactness or the
row's loss bound, left-padded batches, beam search and the memory report, on each tiny random model
of ``MATRIX_ARCHS`` (full attention only, and hybrid)."""

from __future__ import annotations

import functools

import pytest
import torch
from configs import BEAMS, CASE_IDS, CASES, MATRIX_ARCHS, MIXED, OPERATIONS, PADDED, ROWS, SUMMARIES, Row
from helpers import LOGITS_ATOL, assert_same_generation, diff_before_divergence, generate, kv_slot_bytes
from tiny_models import left_padded_batch, random_prompt, tiny_model
from transformers import DynamicCache

from kvfactory import KVCacheFactory
from kvfactory.cache import attention_layout
from kvfactory.codecs import make_codec
from kvfactory.eviction import POLICIES
from kvfactory.presets import preset_names
from kvfactory.selectors import SELECTORS

PROMPT, NEW = 24, 6
PADDED_LENGTHS = [PROMPT, 15, 7]
BEAM_LENGTHS = [PROMPT, 13]
cases = pytest.mark.parametrize(("row", "level"), CASES, ids=CASE_IDS)
archs = pytest.mark.parametrize("arch", MATRIX_ARCHS)


def greedy_inputs() -> dict[str, torch.Tensor]:
    ids = random_prompt(PROMPT)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


MODES = {
    "greedy": (greedy_inputs, {}),
    "padded": (lambda: left_padded_batch(PADDED_LENGTHS, seed=3), {}),
    "beams": (lambda: left_padded_batch(BEAM_LENGTHS, seed=5),
              {"num_beams": 2, "num_return_sequences": 2, "output_scores": True, "max_new_tokens": 5}),
}


def run(arch: str, mode: str, cache) -> object:
    make_inputs, kwargs = MODES[mode]
    return generate(tiny_model(arch), make_inputs(), cache, **({"max_new_tokens": NEW} | kwargs))


@functools.cache
def reference(arch: str, mode: str):
    return run(arch, mode, DynamicCache(config=tiny_model(arch).config))


def create_cache(row: Row, level: str, arch: str):
    return KVCacheFactory(tiny_model(arch).config, row.config(level, arch)).create_cache()


def check(row: Row, ref, out) -> None:
    """Lossless: the same generation; lossy: within the row's bound before the tokens differ."""
    if row.lossless:
        assert_same_generation(ref, out)
    else:
        assert out.sequences.shape == ref.sequences.shape
        assert diff_before_divergence(ref, out) <= row.bound


# -- the matrix itself ----------------------------------------------------------------------------

def test_every_row_states_every_operation_and_builds() -> None:
    assert len({row.id for row in ROWS}) == len(ROWS)
    for row in ROWS:
        assert set(row.raises) <= set(OPERATIONS), row.id
        assert row.bound >= 0.0, row.id
        for level in ("small", "demanding"):
            for arch in MATRIX_ARCHS:
                KVCacheFactory(tiny_model(arch).config, row.config(level, arch))


def test_every_registered_policy_selector_codec_and_preset_has_a_row() -> None:
    """A new policy, selector or preset fails here until it gets its rows."""
    entries = [entry for row in ROWS for level in ("small", "demanding")
               for entry in row.config(level).get("strategies", [])]
    policies = {(e["policy"], "budget" in e) for e in entries if e["name"] == "eviction"}
    assert policies >= {(p, by_budget) for p in POLICIES for by_budget in (False, True)}
    assert {e["name"] for e in entries} >= set(SELECTORS)
    presets = {row.id.removeprefix("preset:") for row in ROWS if row.id.startswith("preset:")}
    assert presets >= set(preset_names()) | {"snapkv@0.5", "quest@0.25"}  # files and NAME@FRACTION
    assert {row.bytes_per_token.removesuffix(SUMMARIES) for row in ROWS} >= {"int8", "fp8", "int4", "int2"}


# -- generation -----------------------------------------------------------------------------------

@archs
@cases
def test_greedy_is_exact_or_within_the_bound(row: Row, level: str, arch: str) -> None:
    """Sliding-window layers hold their last ``window - 1`` tokens (at most that where a storage
    strategy drops tokens in every layer, as ``FirstAndLast``: eviction policies leave them alone,
    ``test_compose.py``); full-attention layers all tokens seen, or fewer where the row evicts."""
    cache = create_cache(row, level, arch)
    ref, out = reference(arch, "greedy"), run(arch, "greedy", cache)
    check(row, ref, out)
    if not row.lossless:  # a lossy row really is lossy here (else its bound says nothing)
        assert diff_before_divergence(ref, out) > LOGITS_ATOL
    seen = PROMPT + NEW - 1
    assert cache.get_seq_length() == seen
    windows = attention_layout(tiny_model(arch).config)
    stored = [cache.size(i) for i in range(len(cache.layers))]
    for n, window in zip(stored, windows, strict=True):
        if window is not None:
            assert n <= min(seen, window - 1) if row.evicts else n == min(seen, window - 1)
    full = [n for n, window in zip(stored, windows, strict=True) if window is None]
    assert all(n < seen for n in full) if row.evicts else full == [seen] * len(full)


@archs
@cases
def test_left_padded_batch(row: Row, level: str, arch: str) -> None:
    cache = create_cache(row, level, arch)
    if row.refuses(PADDED, lambda: run(arch, "padded", cache)):
        return
    check(row, reference(arch, "padded"), run(arch, "padded", cache))
    assert cache.get_seq_length() == max(PADDED_LENGTHS) + NEW - 1


@archs
@cases
def test_beam_search(row: Row, level: str, arch: str) -> None:
    cache = create_cache(row, level, arch)
    if row.refuses(BEAMS, lambda: run(arch, "beams", cache)):
        return
    ref, out = reference(arch, "beams"), run(arch, "beams", cache)
    assert out.sequences.shape[0] == 2 * len(BEAM_LENGTHS)
    if row.lossless:
        assert_same_generation(ref, out)
    else:  # beams reorder rows by their scores: a lossy run may rank them its own way
        assert torch.isfinite(out.sequences_scores).all()
        if torch.equal(out.sequences, ref.sequences):
            torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=row.bound, rtol=0)
    assert cache.get_seq_length() == out.sequences.shape[1] - 1


# -- memory ---------------------------------------------------------------------------------------

def codec_bytes(codec: str, kv_heads: int, head_dim: int, group_size: int | None) -> int:
    options = {"group_size": group_size} if codec in ("int4", "int2") and group_size else {}
    return sum(make_codec(codec, role, **options).bytes_per_token(kv_heads, head_dim)
               for role in ("key", "value"))


def quantization_options(config: dict) -> dict:
    if "quantization" in config:
        value = config["quantization"]
        return {"codec": value} if isinstance(value, str) else value
    return next(e for e in config["strategies"] if e["name"] == "quantized")


@archs
@cases
def test_memory_report(row: Row, level: str, arch: str) -> None:
    """allocated >= used >= 0; used is what the row's tokens cost; clear() gives everything back."""
    config, model_config = row.config(level, arch), tiny_model(arch).config
    cache = KVCacheFactory(model_config, config).create_cache()
    run(arch, "greedy", cache)
    report = cache.memory_report()
    assert report["allocated"] >= report["used"] >= 0 and report["tokens_stored"] > 0
    assert report["tokens_stored"] == sum(cache.size(i) for i in range(len(cache.layers)))
    windows = attention_layout(model_config)
    if any(window is not None for window in windows):  # hybrid: the two kinds of layer apart
        sliding = [i for i, window in enumerate(windows) if window is not None]
        assert report["sliding_tokens_stored"] == sum(cache.size(i) for i in sliding)
        for key in ("allocated", "tokens_stored"):
            assert report[f"global_{key}"] + report[f"sliding_{key}"] == report[key]
    else:
        assert "sliding_allocated" not in report
    slot = kv_slot_bytes(model_config)
    stored, window = report["tokens_stored"], report.get("residual_tokens", report["tokens_stored"])
    if row.bytes_per_token == MIXED:
        assert window < stored and report["used"] < stored * slot
        return
    codec, summaries = row.bytes_per_token.removesuffix(SUMMARIES), row.bytes_per_token.endswith(SUMMARIES)
    if codec == "fp32":
        expected = stored * slot
    else:  # quantized tokens cost the codec's bytes, the full-precision window fp32
        assert window < stored, "nothing was quantized"
        assert report["workspace"] > 0
        per_token = codec_bytes(codec, model_config.num_key_value_heads, model_config.head_dim,
                                quantization_options(config).get("group_size"))
        expected = (stored - window) * per_token + window * slot
    if summaries:
        assert report["used"] > expected
    else:
        assert report["used"] == pytest.approx(expected, rel=0.02)
    cache.clear()
    assert cache.get_seq_length() == 0 and cache.memory_report()["allocated"] == 0
