"""Reading a quantized layer: decode into a reused workspace (kvfactory) against decode-then-concatenate.

transformers' ``QuantizedCache`` reads a layer by dequantizing everything into a new tensor and
concatenating the full-precision residual onto it: two full-size writes into fresh memory per
layer and step. ``QuantizedStore.gather`` decodes into one reused buffer and copies the residual
behind it. This times both for one SmolLM2 layer (3 KV heads, head_dim 64, fp32) per codec and
context, 1 thread, median of ``--runs``; prints JSON with the ratio naive / workspace.

    python benchmarks/codec_decode.py [--lengths 2048,6144] [--batch 1] [--runs 50]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from kvfactory.codecs import make_codec
from kvfactory.roofline import median_seconds
from kvfactory.storage.workspace import ReadWorkspace

HEADS, HEAD_DIM, RESIDUAL = 3, 64, 128


def naive(codec, enc, residual: torch.Tensor) -> torch.Tensor:
    """Dequantize into a new tensor, then concatenate the residual (a second full-size copy)."""
    return torch.cat([codec.decode(enc), residual], dim=2)


def into_workspace(codec, enc, residual: torch.Tensor, workspace: ReadWorkspace) -> torch.Tensor:
    """Decode into the reused buffer and copy the residual behind it (``QuantizedStore.gather``)."""
    b, h, r, d = residual.shape
    out = workspace.buffer("keys", (b, h, enc.tokens + r, d), residual)
    codec.decode(enc, out=out[:, :, :enc.tokens])
    out[:, :, enc.tokens:].copy_(residual)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,6144")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--codecs", default="int8,fp8,int4,int2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for length in map(int, args.lengths.split(",")):
        quantized = length // 32 * 32
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch, HEADS, quantized, HEAD_DIM, generator=gen)
        residual = torch.randn(args.batch, HEADS, RESIDUAL, HEAD_DIM, generator=gen)
        for name in args.codecs.split(","):
            codec = make_codec(name, "key")
            enc = codec.encode(x)
            slow_read = functools.partial(naive, codec, enc, residual)
            fast_read = functools.partial(into_workspace, codec, enc, residual, ReadWorkspace())
            assert torch.equal(slow_read(), fast_read())
            slow, fast = median_seconds(slow_read, args.runs), median_seconds(fast_read, args.runs)
            rows.append({"codec": name, "tokens": quantized + RESIDUAL, "batch": args.batch,
                         "naive_ms": round(slow * 1e3, 3), "workspace_ms": round(fast * 1e3, 3),
                         "speedup": round(slow / fast, 2)})
    print(json.dumps({"benchmark": "codec_decode", "layer": f"{HEADS} KV heads x {HEAD_DIM}, fp32 keys",
                      "threads": 1, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
