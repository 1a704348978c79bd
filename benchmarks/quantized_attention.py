"""One decode step's attention over one quantized layer: read whole + SDPA against chunked attention.

``QuantizedStore.gather`` decodes the whole layer into the workspace and SDPA reads it back;
``kvfactory.attention.attend`` over a ``QuantizedRead`` decodes ``chunk_bytes`` at a time into a
buffer that stays in cache. This times both for one SmolLM2 layer (9 query heads over 3 KV heads,
head_dim 64, fp32, the codec's default residual window), 1 thread, median of ``--runs``, for each
batch size, length and codec, and prints JSON with the ratio whole / chunked. Where the layer's
K/V fit in a couple of chunks, both cost the same; ``QuantizedStore.deferred_read`` reads those
whole.

    python benchmarks/quantized_attention.py [--lengths 2048,6144] [--batches 1,2,4,8] [--runs 20]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kvfactory import attention
from kvfactory.codecs.spec import QuantizationSpec
from kvfactory.quantization.store import QuantizedRead, QuantizedStore
from kvfactory.roofline import median_seconds
from kvfactory.storage import DenseStore
from kvfactory.storage.workspace import ReadWorkspace

QUERY_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def filled(codec: str, batch: int, length: int) -> QuantizedStore:
    spec = QuantizationSpec(codec=codec)
    store = QuantizedStore(DenseStore(), *spec.codecs(0, 1), spec.residual_for(codec), ReadWorkspace())
    store.bind(0)
    gen = torch.Generator().manual_seed(0)
    store.append(*(torch.randn(batch, KV_HEADS, length, HEAD_DIM, generator=gen) for _ in range(2)))
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,6144")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--codecs", default="int8,int4")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = HEAD_DIM ** -0.5
    rows = []
    for length in map(int, args.lengths.split(",")):
        for batch in map(int, args.batches.split(",")):
            query = torch.randn(batch, QUERY_HEADS, 1, HEAD_DIM, generator=torch.Generator().manual_seed(1))
            for codec in args.codecs.split(","):
                store = filled(codec, batch, length)

                def whole(store=store, query=query):
                    keys, values = store.gather()
                    return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)

                def chunked(store=store, query=query):
                    return attention.attend(query, QuantizedRead(store), None, scale)

                torch.testing.assert_close(chunked().transpose(1, 2), whole(), atol=1e-4, rtol=1e-4)
                slow, fast = median_seconds(whole, args.runs), median_seconds(chunked, args.runs)
                mib = 2 * batch * KV_HEADS * length * HEAD_DIM * 4 / 2**20
                rows.append({"codec": codec, "tokens": length, "batch": batch,
                             "fp32_layer_kv_mib": round(mib, 1),
                             "whole_ms": round(slow * 1e3, 3), "chunked_ms": round(fast * 1e3, 3),
                             "speedup": round(slow / fast, 2),
                             "chunked_by_default": store.deferred_read() is not None})
                print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"benchmark": "quantized_attention", "chunk_bytes": QuantizedRead.chunk_bytes,
                      "threads": 1, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
