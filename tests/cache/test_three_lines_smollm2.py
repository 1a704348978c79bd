"""The user's three lines on SmolLM2 loaded the plain transformers way, for every shipped preset.

``AutoModelForCausalLM.from_pretrained`` (SDPA, no kvfactory loader, no attention switch, no hook),
then ``KVCacheFactory(model_config=model.config, ...)``, ``create_cache()`` and
``generate(past_key_values=cache)``. Each preset must do what it says: lossless ones equal
``DynamicCache`` (tokens, logits within 1e-5), quantized ones hold their codec's bytes, evicting ones
hold their budget, sparse ones read their budget.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_generation, generate
from transformers import AutoModelForCausalLM, DynamicCache

from kvfactory import KVCacheFactory
from kvfactory.config import parse_config
from kvfactory.eviction import POLICIES
from kvfactory.models import GGUF_FILE, embedded_model_dir
from kvfactory.presets import load_preset, preset_names
from kvfactory.selectors import SELECTORS
from kvfactory.sizing import KVShape, bytes_per_token_per_layer

pytestmark = pytest.mark.slow

PROMPT_TOKENS, NEW_TOKENS = 600, 8
RATIO, READ_BUDGET = 0.5, 0.125
PAGE = 16  # the page size of every POLICY@RATIO and SELECTOR@BUDGET preset
PRESETS = preset_names() + [f"{policy}@{RATIO}" for policy in sorted(POLICIES)] + \
    [f"{selector}@{READ_BUDGET}" for selector in sorted(SELECTORS)]


@pytest.fixture(scope="module")
def plain_model():
    """SmolLM2 as a user loads it: from the GGUF file, transformers' defaults (SDPA)."""
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), gguf_file=GGUF_FILE,
                                                 dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    return model


@pytest.fixture(scope="module")
def prompt(wikitext_ids) -> dict[str, torch.Tensor]:
    ids = wikitext_ids[:PROMPT_TOKENS][None]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def reference(plain_model, prompt):
    return generate(plain_model, prompt, DynamicCache(config=plain_model.config), max_new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_works_through_the_three_lines(plain_model, prompt, reference, name: str) -> None:
    config = load_preset(name)
    factory = KVCacheFactory(model_config=plain_model.config, cache_config=config)
    cache = factory.create_cache()
    out = generate(plain_model, prompt, cache, max_new_tokens=NEW_TOKENS)
    assert out.sequences.shape == reference.sequences.shape
    parsed = parse_config(config)
    seen = PROMPT_TOKENS + NEW_TOKENS - 1
    assert cache.get_seq_length() == seen
    if parsed.eviction is not None:
        check_budget(cache, seen)
    elif parsed.selector is not None:
        check_read_budget(cache, parsed.selector.build_selector().reads_all, reference, out)
    elif parsed.quantization is not None:
        check_codec_bytes(plain_model, cache, parsed.quantization.codec_name(1, len(cache.layers)))
    else:
        assert_same_generation(reference, out)


def check_budget(cache, seen: int) -> None:
    """Compressing the prompt by ``RATIO`` keeps about half of it in all layers together; decoded
    tokens come on top (at most ``NEW_TOKENS - 1`` per layer)."""
    layers = len(cache.layers)
    stored = [cache.size(i) for i in range(layers)]
    assert max(stored) < seen
    assert sum(stored) <= layers * (PROMPT_TOKENS * (1 - RATIO) + NEW_TOKENS), stored


def check_read_budget(cache, reads_all: bool, reference, out) -> None:
    """Each decode step reads ``READ_BUDGET`` of the sparse layers' stored pages, rounded up per layer
    (the per-layer split), plus the page summaries it scores, or everything for the full selector (which
    then equals DynamicCache)."""
    metrics = cache.routing_metrics()
    assert metrics["steps"] == NEW_TOKENS - 1
    share = metrics["kv_bytes_read_per_step"] / metrics["kv_bytes_full_per_step"]
    if reads_all:
        assert_same_generation(reference, out)
        assert share >= 1.0
    else:
        pages = -(-(PROMPT_TOKENS + NEW_TOKENS) // PAGE)
        rounding, summaries = 3 / pages, 0.05  # a page up per layer split and partly filled end pages
        assert READ_BUDGET * 0.8 <= share <= READ_BUDGET + rounding + summaries, share


def check_codec_bytes(model, cache, codec: str) -> None:
    """Encoded tokens cost the codec's bytes (``kvfactory.sizing``), up to one block per layer; the
    full-precision window holds only the newest tokens."""
    report = cache.memory_report()
    shape = KVShape.from_config(model.config)
    per_token = bytes_per_token_per_layer(shape, "fp16", codec)
    encoded_tokens = report["tokens_stored"] - report.get("residual_tokens", 0)
    encoded_bytes = report["allocated"] - report.get("residual", 0)
    layers = len(cache.layers)
    assert encoded_tokens >= layers * (PROMPT_TOKENS - 160)
    assert per_token * encoded_tokens <= encoded_bytes <= per_token * (encoded_tokens + 32 * layers)
