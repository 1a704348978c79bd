"""Attention products computed straight from packed codes, fused by ``torch.compile``.

A decode step needs ``q · K^T`` and ``p · V`` over every stored token. Decoding K and V first
writes the whole layer in floating point and reads it back; these functions unpack, scale and
reduce in one expression, which ``torch.compile`` turns into one loop over the packed bytes with no
floating-point K/V in memory (about 3-4x faster than decode + SDPA on one SmolLM2 layer at 6k
tokens, ``benchmarks/quantized_attention.py``).

Covered: KIVI int4/int2 (keys per channel over token groups, values per token over channel
groups that divide ``head_dim``) and int8 (a scale per token and head). On the CPU, KIVI layers
use the C kernels of ``native`` instead when they are built (faster: no per-call dynamo overhead,
codes unpacked in registers); these serve GPUs and machines without a C compiler. Scales and zero points
come in float32 (``widen``: small tensors; FP8 casts inside the compiled loop are slow on CPU).
The first call of each shape family compiles (seconds); if compiling fails (no C++ toolchain,
an unsupported build), ``available`` turns False with a warning and reads fall back to decoding in
chunks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

_state = {"available": True}


def available() -> bool:
    return _state["available"]


def _planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed ``[..., P]`` bytes as float codes ``[..., P * 8 / bits]`` (planar layout, ``packing``)."""
    mask = 2 ** bits - 1
    return torch.cat([((codes >> (bits * q)) & mask).float() for q in range(8 // bits)], dim=-1)


def _kivi_scores(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """``query [B, H, R, D]`` against KIVI keys ``codes [B, H, N, G, P]``, ``scale``/``zero``
    ``[B, H, N, 1, D]``: ``[B, H, R, N * G]`` dot products."""
    b, h, n, g, _ = codes.shape
    d = query.shape[-1]
    keys = _planes(codes, bits)[..., :d] * scale + zero  # [B, H, N, G, D]
    keys = keys.view(b, h, 1, n * g, d)
    return (query[:, :, :, None, :] * keys).sum(-1)


def _kivi_values(probs: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bits: int, group: int) -> torch.Tensor:
    """``probs [B, H, R, T]`` over KIVI values ``codes [B, H, T, P]``, ``scale``/``zero``
    ``[B, H, T, D / group]``: ``[B, H, R, D]``."""
    b, h, t, _ = codes.shape
    groups = scale.shape[-1]
    values = _planes(codes, bits)[..., :groups * group].view(b, h, t, groups, group)
    values = (values * scale[..., None] + zero[..., None]).view(b, h, 1, t, groups * group)
    return (probs[..., None] * values).sum(-2)


def _int8_scores(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``query [B, H, R, D]`` against int8 keys ``codes [B, H, T, D]``, ``scale [B, H, T, 1]``."""
    b, h, t, d = codes.shape
    dots = (query[:, :, :, None, :] * codes.float().view(b, h, 1, t, d)).sum(-1)
    return dots * scale.view(b, h, 1, t)


def _int8_values(probs: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``probs [B, H, R, T]`` over int8 values ``codes [B, H, T, D]``, ``scale [B, H, T, 1]``."""
    b, h, t, d = codes.shape
    weights = probs * scale.view(b, h, 1, t)
    return (weights[..., None] * codes.float().view(b, h, 1, t, d)).sum(-2)


_compiled: dict[str, Callable[..., torch.Tensor]] = {}
_EAGER = {"kivi_scores": _kivi_scores, "kivi_values": _kivi_values,
          "int8_scores": _int8_scores, "int8_values": _int8_values}


def run(name: str, *args: object) -> torch.Tensor | None:
    """Call the compiled ``name`` kernel; None (and ``available()`` False) if compiling failed."""
    if not _state["available"]:
        return None
    fn = _compiled.get(name)
    if fn is None:
        fn = _compiled[name] = torch.compile(_EAGER[name])
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - any compiler failure: fall back, loudly
        _state["available"] = False
        warnings.warn(f"torch.compile of kvfactory's fused attention kernels failed ({type(err).__name__}: "
                      f"{err}); quantized layers are read by decoding in chunks instead", stacklevel=2)
        return None
