"""Quantized caches against DynamicCache and transformers' ``QuantizedCache``: decode speed and bytes.

The same measurement as ``benchmarks/decode.py`` (SmolLM2, fp32, 1 thread, prompts of 2048 and
6144 WikiText tokens, batch 1 and 8, 64 new tokens, interleaved runs, medians, ratios to
DynamicCache in the same run), over kvfactory's codecs and transformers' quanto / HQQ backends
at 4 and 2 bits (``pip install 'kvfactory[peers]'``). Bytes are what each cache holds after
decoding, as a ratio to an fp16 dense cache of the same tokens; kvfactory rows also give the
full-precision residual window (``residual_bytes``, ``residual_tokens``) and the shared decode
workspace separately. ``NAME/attn`` rows decode with ``attn_implementation="kvfactory"``: chunked
attention over the packed data instead of decoding each layer whole for SDPA.

    python benchmarks/quant.py [--lengths 2048,6144] [--batches 1,8] [--runs 3] [--configs int4,...]
"""

from __future__ import annotations

from decode import WithAttention, run

CONFIGS = {
    "int8": {"type": "dense", "quantization": "int8"},
    "fp8": {"type": "dense", "quantization": "fp8"},
    "int4": {"type": "dense", "quantization": "int4"},
    "int2": {"type": "dense", "quantization": "int2"},
    "paged16+int4": {"type": "paged", "page_size": 16, "quantization": "int4"},
    "int8/attn": WithAttention({"type": "dense", "quantization": "int8"}, "kvfactory"),
    "int4/attn": WithAttention({"type": "dense", "quantization": "int4"}, "kvfactory"),
    "int2/attn": WithAttention({"type": "dense", "quantization": "int2"}, "kvfactory"),
    "paged16+int4/attn": WithAttention(
        {"type": "paged", "page_size": 16, "quantization": "int4"}, "kvfactory"),
    "quanto-int4": "transformers/quanto-int4",
    "quanto-int2": "transformers/quanto-int2",
    "hqq-int4": "transformers/hqq-int4",
    "hqq-int2": "transformers/hqq-int2",
}

if __name__ == "__main__":
    run(CONFIGS, "quant")
