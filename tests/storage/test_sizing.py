"""The KV memory calculator against hand-computed numbers and real DynamicCache tensors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, GPT2Config, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from kvfactory import sizing
from kvfactory.cache import dynamic_cache_bytes

SMOLLM2 = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      hidden_size=576)
# 4 layers, 2 KV heads of 16 channels: 2 * 2 * 16 * 2 = 128 fp16 bytes per token per layer.
MISTRAL = MistralConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=100)
QWEN2_MIXED = Qwen2Config(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          use_sliding_window=True, sliding_window=32, max_window_layers=2)


def test_smollm2_fp16_bytes_per_token():
    assert sizing.bytes_per_token_per_layer(SMOLLM2, "fp16") == 2 * 3 * 64 * 2 == 768
    assert sizing.bytes_per_token(SMOLLM2, "fp16") == 2 * 30 * 3 * 64 * 2 == 23040
    assert sizing.bytes_per_token(SMOLLM2, "bf16") == 23040
    assert sizing.bytes_per_token(SMOLLM2, "fp32") == 46080
    assert sizing.kv_bytes(SMOLLM2, 4096, batch=2) == 23040 * 4096 * 2


def test_shape_falls_back_to_attention_heads_and_hidden_size():
    shape = sizing.KVShape.from_config(GPT2Config(n_layer=2, n_head=12, n_embd=768))
    assert (shape.kv_heads, shape.head_dim, shape.windows) == (12, 64, (None, None))


@pytest.mark.parametrize(("codec", "per_layer"), [
    ("none", 768),                             # 3 heads * 2 * 64 * 2 bytes
    ("int8", 3 * 2 * (64 + 2)),                # int8 elements + fp16 scale per token and head
    ("fp8", 3 * 2 * (64 + 2)),                 # fp8 elements + fp16 scale per token and head
    ("int4", 3 * ((32 + 6) + (32 + 4))),       # packed 64/2 + K: (1+2)*64/32, V: (1+1)*ceil(64/32)
    ("int2", 3 * ((16 + 6) + (16 + 4))),
])
def test_codec_bytes(codec, per_layer):
    assert sizing.bytes_per_token_per_layer(SMOLLM2, "fp16", codec) == per_layer
    assert sizing.kv_bytes(SMOLLM2, 1000, 3, "fp16", codec) == per_layer * 30 * 1000 * 3


def test_codec_ratios_and_dtype_independence():
    fp16 = sizing.bytes_per_token(SMOLLM2, "fp16")
    ratios = {c: sizing.bytes_per_token(SMOLLM2, "fp16", c) / fp16 for c in sizing.CODECS}
    assert ratios == {"none": 1.0, "int8": 0.515625, "fp8": 0.515625, "int4": 0.2890625, "int2": 0.1640625}
    for codec in ("int8", "fp8", "int4", "int2"):  # quantised sizes do not depend on the model dtype
        assert sizing.bytes_per_token(SMOLLM2, "fp32", codec) == sizing.bytes_per_token(SMOLLM2, codec=codec)


def test_kivi_fractional_bytes_round_up_in_totals():
    shape = sizing.KVShape(kv_heads=1, head_dim=20, windows=(None,))
    # int4: K = 20/2 + 3*20/32 = 11.875, V = 20/2 + 2*ceil(20/32) = 12
    assert sizing.bytes_per_token_per_layer(shape, codec="int4") == 23.875
    assert sizing.kv_bytes(shape, 3, codec="int4") == 72  # ceil(71.625)
    assert sizing.kv_bytes(shape, 2, codec="int4") == 48  # ceil(47.75)


def test_sliding_window_layers_hold_at_most_their_window():
    assert sizing.KVShape.from_config(MISTRAL).windows == (100,) * 4
    assert sizing.kv_bytes(MISTRAL, 50) == 4 * 50 * 128
    assert sizing.kv_bytes(MISTRAL, 10_000) == sizing.kv_bytes(MISTRAL, 100) == 4 * 100 * 128
    assert sizing.max_context(MISTRAL, 4 * 100 * 128) is None  # every window fits: unbounded
    assert sizing.max_context(MISTRAL, 4 * 100 * 128 - 1) == 99
    # two full layers, two with a 32-token window (2 * 2 * 16 * 2 = 128 bytes per token and layer)
    assert sizing.kv_bytes(QWEN2_MIXED, 1000) == (1000 + 1000 + 32 + 32) * 128
    assert sizing.max_context(QWEN2_MIXED, (1000 + 1000 + 32 + 32) * 128) == 1000


def test_max_context_inverts_kv_bytes():
    assert sizing.max_context(SMOLLM2, 8 * 2**30) == 8 * 2**30 // 23040 == 372827
    assert sizing.max_context(SMOLLM2, 8 * 2**30, batch=8, codec="int4") == 8 * 2**30 // (6660 * 8)
    assert sizing.max_context(SMOLLM2, 23039) == 0
    assert sizing.max_context(SMOLLM2, 23040) == 1


@settings(max_examples=60, deadline=None)
@given(memory=st.integers(1, 10**9), batch=st.integers(1, 8), codec=st.sampled_from(sizing.CODECS),
       model=st.sampled_from([SMOLLM2, QWEN2_MIXED, sizing.KVShape(1, 20, (None, 7))]))
def test_max_context_is_the_largest_that_fits(memory, batch, codec, model):
    longest = sizing.max_context(model, memory, batch, "fp32", codec)
    assert sizing.kv_bytes(model, longest, batch, "fp32", codec) <= memory
    assert sizing.kv_bytes(model, longest + 1, batch, "fp32", codec) > memory


def test_estimate_matches_a_real_dynamic_cache():
    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    cache = DynamicCache(config=config)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 100, (2, 37)), past_key_values=cache)
    assert dynamic_cache_bytes(cache) == sizing.kv_bytes(config, 37, batch=2, dtype="fp32")


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1000", 1000),
    ("1.5 GiB", 3 * 2**29), (" 64kib ", 64 * 1024), ("10B", 10), ("1TB", 10**12),
])
def test_parse_memory(text, expected):
    assert sizing.parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "8 GiBs", "8g", "-1GiB", "0", "0.1B", "1e9", "8 Gi B", "eight"])
def test_parse_memory_rejects_bad_strings(text):
    with pytest.raises(ValueError, match="memory"):
        sizing.parse_memory(text)


def test_bad_dtype_codec_context():
    with pytest.raises(ValueError, match="dtype 'fp64'"):
        sizing.bytes_per_token(SMOLLM2, "fp64")
    with pytest.raises(ValueError, match="codec 'int3'.*int4"):
        sizing.kv_bytes(SMOLLM2, 10, codec="int3")
    with pytest.raises(ValueError, match="batch"):
        sizing.kv_bytes(SMOLLM2, 10, batch=0)


def test_format_bytes():
    assert sizing.format_bytes(768) == "768 B"
    assert sizing.format_bytes(23040) == "22.5 KiB"
    assert sizing.format_bytes(8 * 2**30) == "8.0 GiB"
    assert sizing.format_bytes(3 * 2**40) == "3.0 TiB"
