"""One decode step's attention for a ragged batch over a paged pool: C kernel, torch path, gather + SDPA.

A batch of sequences (one query token each) over one SmolLM2 layer's block pool (9 query heads over
3 KV heads, head_dim 64, pages of 16 tokens, fp32), each sequence's blocks shuffled through the pool.
Times ``kvfactory.storage.ragged.paged_decode`` in C (blocks read in place; also over the same pool
with each sequence's blocks consecutive, as a prefill allocates them), its torch path
(``kernel=False``: one padded gather and masked attention for the batch) and a baseline that gathers
each sequence with ``index_select`` and runs SDPA on it. Then the same batch in int4 pages (the
``int4`` preset's stores, written in interleaved 512-token chunks as an engine's prefills write
them): ``kvfactory.quantization.ragged.quantized_decode`` (packed blocks and windows read in place,
two kernel calls) against each sequence's own chunked read (``attention.attend`` over its
``QuantizedRead``, what the engine ran before). 1 thread, median of ``--runs``; prints JSON.

    python benchmarks/ragged_decode.py [--sequences 8] [--tokens 6144] [--runs 20]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kvfactory import attention
from kvfactory.manager import KVCacheManager
from kvfactory.models import load_config
from kvfactory.presets import load_preset
from kvfactory.quantization.ragged import quantized_decode
from kvfactory.roofline import median_seconds
from kvfactory.storage.ragged import paged_decode

QUERY_HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    per_sequence = -(-args.tokens // PAGE)
    blocks = args.sequences * per_sequence
    k_pool, v_pool = (torch.randn(KV_HEADS, blocks, PAGE, HEAD_DIM, generator=gen) for _ in range(2))
    tables = torch.randperm(blocks, generator=gen).view(args.sequences, per_sequence)
    starts = torch.zeros(args.sequences, dtype=torch.long)
    lengths = torch.full((args.sequences,), args.tokens, dtype=torch.long)
    query = torch.randn(args.sequences, QUERY_HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM ** -0.5

    def baseline() -> torch.Tensor:
        rows = []
        for s in range(args.sequences):
            k, v = (pool.index_select(1, tables[s]).view(1, KV_HEADS, -1, HEAD_DIM)[:, :, :args.tokens]
                    for pool in (k_pool, v_pool))
            # [batch, heads, tokens, D] as transformers calls it (3-D inputs take a slower SDPA path)
            rows.append(F.scaled_dot_product_attention(query[None, s, :, None], k, v, scale=scale,
                                                       enable_gqa=True))
        return torch.cat(rows)[:, :, 0]

    def kernel() -> torch.Tensor:
        return paged_decode(query, k_pool, v_pool, tables, starts, lengths, scale)

    in_order = torch.arange(blocks).view(args.sequences, per_sequence)

    def kernel_in_order() -> torch.Tensor:
        return paged_decode(query, k_pool, v_pool, in_order, starts, lengths, scale)

    def gathered() -> torch.Tensor:
        return paged_decode(query, k_pool, v_pool, tables, starts, lengths, scale, kernel=False)

    read_bytes = 2 * args.sequences * args.tokens * KV_HEADS * HEAD_DIM * 4
    expected = baseline()
    in_order_torch = paged_decode(query, k_pool, v_pool, in_order, starts, lengths, scale, kernel=False)
    torch.testing.assert_close(kernel_in_order(), in_order_torch, atol=1e-5, rtol=1e-5)
    for fn in (kernel, gathered):
        torch.testing.assert_close(fn(), expected, atol=1e-5, rtol=1e-5)
    stores = int4_stores(args.sequences, args.tokens, gen)

    def int4_in_place() -> torch.Tensor:
        return quantized_decode(query, stores, scale)

    def int4_each() -> torch.Tensor:
        return torch.cat([attention.attend(query[None, s, :, None], store.deferred_read(), None, scale)
                          [:, 0] for s, store in enumerate(stores)])

    torch.testing.assert_close(int4_in_place(), int4_each(), atol=1e-4, rtol=1e-4)
    times = {name: median_seconds(fn, args.runs) for name, fn in
             (("c_kernel", kernel), ("c_kernel_blocks_in_order", kernel_in_order), ("torch_path", gathered),
              ("gather_sdpa", baseline),
              ("int4_in_place", int4_in_place), ("int4_each_sequence", int4_each))}
    print(json.dumps({
        "benchmark": "ragged_decode", "threads": 1, "sequences": args.sequences, "tokens": args.tokens,
        "query_heads": QUERY_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE,
        "dtype": "float32", "layer_kv_mib": round(2 * k_pool.numel() * 4 / 2**20, 1),
        **{f"{name}_ms": round(t * 1e3, 3) for name, t in times.items()},
        **{f"{name}_read_gb_s": round(read_bytes / times[name] / 1e9, 1)
           for name in ("c_kernel", "c_kernel_blocks_in_order")},
        "speedup_vs_torch_path": round(times["torch_path"] / times["c_kernel"], 2),
        "speedup_vs_gather_sdpa": round(times["gather_sdpa"] / times["c_kernel"], 2),
        "int4_speedup_vs_each_sequence": round(times["int4_each_sequence"] / times["int4_in_place"], 2),
    }, indent=2))


def int4_stores(sequences: int, tokens: int, gen: torch.Generator) -> list:
    """Layer 0 of ``sequences`` int4 caches over one pool, ``tokens`` random K/V each (SmolLM2's scale),
    written 512 tokens at a time, one sequence after another, so their blocks interleave."""
    config = {**load_preset("int4"), "pool_tokens": sequences * (tokens + 256)}
    manager = KVCacheManager(load_config(), config)
    layers = [manager.create(f"s{s}").layers[0] for s in range(sequences)]
    for start in range(0, tokens, 512):
        for layer in layers:
            n = min(512, tokens - start)
            layer.append(*(torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen) for _ in range(2)))
    return [layer.store for layer in layers]


if __name__ == "__main__":
    main()
