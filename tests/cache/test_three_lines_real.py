"""The user's three lines on both packaged models loaded the plain transformers way, for every shipped
preset, every eviction policy at 0.5 and every selector at 1/8.

``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` (SDPA, no kvfactory loader, no
attention switch, no hook), then ``KVCacheFactory(model_config=model.config, ...)``,
``create_cache()`` and ``generate(past_key_values=cache)``, on SmolLM2 (full attention in every layer)
and Gemma 3 270M (sliding window 512 in 15 of 18 layers). Each config must do what it says: lossless
ones equal ``DynamicCache`` (tokens, logits within 1e-5), quantized ones hold their codec's bytes,
evicting ones hold their budget in the full-attention layers, sparse ones read their budget there;
sliding-window layers hold their last ``window - 1`` tokens whatever the config.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_generation, generate, wikitext_excerpt
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvfactory import KVCacheFactory
from kvfactory.cache import attention_layout
from kvfactory.config import parse_config
from kvfactory.eviction import POLICIES
from kvfactory.models import PACKAGED
from kvfactory.presets import load_preset, preset_names
from kvfactory.selectors import SELECTORS
from kvfactory.sizing import KVShape, bytes_per_token_per_layer

pytestmark = pytest.mark.slow

PROMPT_TOKENS, NEW_TOKENS = 600, 8  # more than Gemma 3's 512-token window
RATIO, READ_BUDGET = 0.5, 0.125
PAGE = 16  # the page size of every POLICY@RATIO and SELECTOR@BUDGET preset
PRESETS = preset_names() + [f"{policy}@{RATIO}" for policy in sorted(POLICIES)] + \
    [f"{selector}@{READ_BUDGET}" for selector in sorted(SELECTORS)]
MODELS = ("smollm2", "gemma3-270m")


@pytest.fixture(scope="module", params=MODELS)
def plain(request):
    """``(model, prompt, reference)``: the model as a user loads it, from its GGUF file with
    transformers' defaults (SDPA); a WikiText prompt; its ``DynamicCache`` generation."""
    gguf = PACKAGED[request.param].gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    assert model.config._attn_implementation == "sdpa"
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tokenizer(wikitext_excerpt(), return_tensors="pt").input_ids[:, :PROMPT_TOKENS]
    prompt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    reference = generate(model, prompt, DynamicCache(config=model.config), max_new_tokens=NEW_TOKENS)
    return model, prompt, reference


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_works_through_the_three_lines(plain, name: str) -> None:
    model, prompt, reference = plain
    config = load_preset(name)
    factory = KVCacheFactory(model_config=model.config, cache_config=config)
    cache = factory.create_cache()
    out = generate(model, prompt, cache, max_new_tokens=NEW_TOKENS)
    assert out.sequences.shape == reference.sequences.shape
    parsed = parse_config(config)
    seen = PROMPT_TOKENS + NEW_TOKENS - 1
    assert cache.get_seq_length() == seen
    windows = attention_layout(model.config)
    for i, window in enumerate(windows):
        if window is not None:
            assert cache.size(i) == window - 1, f"sliding layer {i}"
    if parsed.eviction is not None:
        check_budget(cache, windows, seen)
    elif parsed.selector is not None:
        check_read_budget(cache, parsed.selector.build_selector().reads_all, reference, out)
    elif parsed.quantization is not None:
        check_codec_bytes(model, cache, parsed.quantization.codec_name(1, len(cache.layers)))
    else:
        assert_same_generation(reference, out)


def check_budget(cache, windows: list[int | None], seen: int) -> None:
    """Compressing the prompt by ``RATIO`` keeps about half of it in the full-attention layers
    together; decoded tokens come on top (at most ``NEW_TOKENS - 1`` per layer)."""
    stored = [cache.size(i) for i, window in enumerate(windows) if window is None]
    assert max(stored) < seen
    assert sum(stored) <= len(stored) * (PROMPT_TOKENS * (1 - RATIO) + NEW_TOKENS), stored


def check_read_budget(cache, reads_all: bool, reference, out) -> None:
    """Each decode step reads ``READ_BUDGET`` of the sparse layers' stored pages, rounded up per layer
    (the per-layer split), plus the page summaries it scores, or everything for the full selector (which
    then equals DynamicCache). Sliding-window layers are read whole, which the model-wide fraction counts."""
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
        assert share <= metrics["model_read_fraction"] <= 1.0
        assert (metrics["model_read_fraction"] > share) == (metrics["unrouted_kv_bytes_per_step"] > 0)


def check_codec_bytes(model, cache, codec: str) -> None:
    """Encoded tokens cost the codec's bytes (``kvfactory.sizing``), up to one block per layer; the
    full-precision window holds only the newest tokens."""
    report = cache.memory_report()
    shape = KVShape.from_config(model.config)
    per_token = bytes_per_token_per_layer(shape, "fp16", codec)
    encoded_tokens = report["tokens_stored"] - report.get("residual_tokens", 0)
    encoded_bytes = report["allocated"] - report.get("residual", 0)
    layers = len(cache.layers)
    assert encoded_tokens >= report["tokens_stored"] - 160 * layers
    assert per_token * encoded_tokens <= encoded_bytes <= per_token * (encoded_tokens + 32 * layers)
