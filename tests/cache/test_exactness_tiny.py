"""Lossless configs reproduce transformers' DynamicCache on tiny random models of every architecture.

Each test runs one generation mode twice, once with ``DynamicCache(config=model.config)`` and once
with a kvfactory cache, and asserts identical tokens, logits within 1e-5 and identical cache contents.
"""

from __future__ import annotations

import functools

import pytest
import torch
from configs import CASES
from helpers import assert_same_generation, generate, kv_slot_bytes, max_logit_diff
from tiny_models import MISTRAL_WINDOW, PROMPT_LEN, TINY_IDS, left_padded_batch, random_prompt, tiny_model
from transformers import DynamicCache

from kvfactory import KVCacheFactory

# The shared matrix's lossless rows that leave the attention alone (storage: dense and paged with
# pages of 1, 4, 16 and 256 tokens), each distinct config once.
LOSSLESS: dict[str, dict] = {}
for row, level in CASES:
    if row.lossless and not row.kvfactory_attention and row.config(level) not in LOSSLESS.values():
        LOSSLESS[f"{row.id}/{level}"] = row.config(level)
DENSE, PAGED4 = "dense/small", "paged/small"

# mode -> (inputs, generate kwargs, seed)
MODES = {
    "greedy": (lambda: {"input_ids": random_prompt(PROMPT_LEN)}, {}, None),
    "batch3-left-padded": (lambda: left_padded_batch([PROMPT_LEN, 13, 6], seed=10), {}, None),
    "sample": (lambda: {"input_ids": random_prompt(PROMPT_LEN, seed=3)}, {"do_sample": True}, 7),
    "sample-nrs2": (lambda: left_padded_batch([PROMPT_LEN, 11], seed=20),
                    {"do_sample": True, "num_return_sequences": 2}, 11),
    "beam3": (lambda: left_padded_batch([PROMPT_LEN, 15], seed=30),
              {"num_beams": 3, "num_return_sequences": 2, "output_scores": True}, None),
}


def _run(arch: str, mode: str, cache) -> object:
    make_inputs, kwargs, seed = MODES[mode]
    inputs = make_inputs()
    if "attention_mask" not in inputs:
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return generate(tiny_model(arch), inputs, cache, seed=seed, **kwargs)


@functools.cache
def _reference(arch: str, mode: str):
    model = tiny_model(arch)
    cache = DynamicCache(config=model.config)
    return _run(arch, mode, cache), cache


@pytest.mark.parametrize("config", list(LOSSLESS), ids=list(LOSSLESS))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", TINY_IDS)
def test_lossless_matches_dynamic_cache(arch: str, mode: str, config: str) -> None:
    model = tiny_model(arch)
    ref, ref_cache = _reference(arch, mode)
    cache = KVCacheFactory(model.config, LOSSLESS[config]).create_cache()
    out = _run(arch, mode, cache)
    assert_same_generation(ref, out)
    # The cache ends in the same state: tokens seen, mask sizes, and the stored keys/values.
    assert cache.get_seq_length() == ref_cache.get_seq_length()
    for i, (mine, theirs) in enumerate(zip(cache.layers, ref_cache.layers, strict=True)):
        assert mine.get_mask_sizes(1) == theirs.get_mask_sizes(1), f"layer {i}"
        assert mine.get_max_length() == theirs.get_max_length(), f"layer {i}"
        assert torch.equal(mine.keys, theirs.keys), f"layer {i} keys"
        assert torch.equal(mine.values, theirs.values), f"layer {i} values"


def test_the_lossless_storage_rows_cover_dense_and_every_page_size() -> None:
    assert {config.get("page_size") for config in LOSSLESS.values()} >= {None, 1, 4, 16, 256}
    assert LOSSLESS[DENSE] == {"type": "dense"} and LOSSLESS[PAGED4] == {"type": "paged", "page_size": 4}


def test_sampling_modes_really_sample() -> None:
    """Guards the matrix above: the sampling modes draw tokens that greedy decoding would not."""
    sampled, _ = _reference("llama", "sample")
    sampled_again = _run("llama", "sample", DynamicCache(config=tiny_model("llama").config))
    assert torch.equal(sampled.sequences, sampled_again.sequences)  # the seed makes sampling repeatable
    greedy_same_prompt = generate(tiny_model("llama"), {"input_ids": random_prompt(PROMPT_LEN, seed=3)},
                                  DynamicCache(config=tiny_model("llama").config))
    assert not torch.equal(sampled.sequences, greedy_same_prompt.sequences)


def test_mistral_window_is_exercised() -> None:
    """The sliding window changes the output, so the matrix really tests the window rule."""
    windowed, ref_cache = _reference("mistral-sw8", "greedy")
    assert all(layer.keys.shape[-2] == MISTRAL_WINDOW - 1 for layer in ref_cache.layers)
    full = tiny_model("mistral-sw8", sliding_window=None)
    prompt = random_prompt(PROMPT_LEN)
    unwindowed = generate(full, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)},
                          DynamicCache(config=full.config))
    assert max_logit_diff(windowed, unwindowed) > 1e-3


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_sliding_layers_release_blocks(page_size: int) -> None:
    """Paged sliding-window layers hold only the blocks spanned by the last ``window - 1`` tokens."""
    model = tiny_model("mistral-sw8")
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": page_size})
    cache = factory.create_cache()
    prompt = random_prompt(40)
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    generate(model, inputs, cache, max_new_tokens=20)
    assert cache.get_seq_length() == 40 + 20 - 1
    assert all(cache.size(i) == MISTRAL_WINDOW - 1 for i in range(len(cache.layers)))
    block_bytes = page_size * kv_slot_bytes(model.config)
    max_blocks = -(-(MISTRAL_WINDOW - 1) // page_size) + 1  # the window may straddle one more block
    report = cache.memory_report()
    assert report["allocated"] <= max_blocks * block_bytes * len(cache.layers)
    assert report["used"] == report["tokens_stored"] * kv_slot_bytes(model.config)


@pytest.mark.parametrize("config", [DENSE, PAGED4])
@pytest.mark.parametrize("arch", ["llama", "mistral-sw8", "gemma3", "gpt2"])
def test_continuing_generation_with_the_same_cache(arch: str, config: str) -> None:
    """A second ``generate`` call on the grown sequence reuses the cache (multi-turn chat)."""
    model = tiny_model(arch)
    caches = [DynamicCache(config=model.config),
              KVCacheFactory(model.config, LOSSLESS[config]).create_cache()]
    outs = []
    for cache in caches:
        prompt = random_prompt(12)
        first = generate(model, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, cache,
                         max_new_tokens=5)
        turn = torch.cat([first.sequences, random_prompt(6, seed=4)], 1)
        outs.append(generate(model, {"input_ids": turn, "attention_mask": torch.ones_like(turn)}, cache,
                             max_new_tokens=5))
    assert_same_generation(*outs)
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == 12 + 5 + 6 + 4


@pytest.mark.parametrize("config", [DENSE, PAGED4])
@pytest.mark.parametrize("arch", ["llama", "mistral-sw8", "gemma3"])
def test_prompt_lookup_decoding_matches_dynamic_cache(arch: str, config: str) -> None:
    """Assisted (prompt-lookup) decoding crops rejected draft tokens; on sliding-window layers
    DynamicCache records the past for that (``activate_past_recording``), so must we."""
    model = tiny_model(arch)
    prompt = random_prompt(PROMPT_LEN).repeat(1, 2)  # repeated text gives the lookup something to draft
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    kwargs = {"max_new_tokens": 12, "prompt_lookup_num_tokens": 3}
    ref = generate(model, inputs, DynamicCache(config=model.config), **kwargs)
    out = generate(model, inputs, KVCacheFactory(model.config, LOSSLESS[config]).create_cache(), **kwargs)
    assert_same_generation(ref, out)


@pytest.mark.parametrize("config", [DENSE, PAGED4])
def test_cache_keyword_of_generate(config: str) -> None:
    """transformers 5 also takes the cache as ``generate(cache=...)`` (``past_key_values`` is deprecated)."""
    model = tiny_model("qwen2")
    inputs = left_padded_batch([PROMPT_LEN, 9], seed=40)
    params = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        ref = model.generate(**inputs, cache=DynamicCache(config=model.config), **params)
        cache = KVCacheFactory(model.config, LOSSLESS[config]).create_cache()
        out = model.generate(**inputs, cache=cache, **params)
    assert_same_generation(ref, out)
    assert cache.get_seq_length() == PROMPT_LEN + 6 - 1
