"""KIVI kernels in C (``kvfactory/kernels/kivi.c``) for the CPU: decode products, and the encoder.

At batch 1 a decode step's attention over a 6k-token int4 layer is a few hundred thousand
multiply-adds: the cost is in unpacking codes and in per-call overhead, not in memory traffic.
``torch.compile``'s kernels for it (``fused``) spend more on unpacking nibbles than fp32 BLAS on 8x
the bytes, plus dynamo's guard and wrapper time per call; the C kernels unpack codes in registers
(AVX-512 where the CPU has it) and read the whole layer in one call, with scales in their stored
FP8/fp16. Built on first use (``kvfactory.kernels``); without a compiler ``available()`` is False
and callers use the ``fused`` kernels. CPU tensors only.

The encoder (``encode_keys``, ``encode_values``) writes the codes, scales and zero points that the
codecs' torch path writes, bit for bit, in one pass where torch takes some forty small operations
(a serving step encodes every sequence's oldest window group in each of its layers).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from kvfactory import kernels
from kvfactory.codecs.base import smallest
from kvfactory.codecs.packing import packed_size
from kvfactory.errors import ShapeError

MAX_DIM, MAX_ROWS, MAX_BLOCK = 512, 64, 256  # as in kivi.c


def _library() -> ctypes.CDLL | None:
    return kernels.load("kivi")


def available() -> bool:
    """Whether the C kernels are built and loaded (building them on the first call)."""
    return _library() is not None


@cache
def _lut(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of every byte of an FP8 ``dtype``."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def lut_pointer(dtype: torch.dtype) -> int | None:
    """The kernels' table for reading parameters of ``dtype``: FP8's 256 values, None for wider dtypes."""
    return _lut(dtype).data_ptr() if dtype.itemsize == 1 else None


def _param(t: torch.Tensor) -> tuple[object, ...]:
    """Kernel arguments for a scale or zero-point tensor: pointer, kind, table, strides of dims 0-2."""
    return (t.data_ptr(), kernels.KINDS[t.dtype], lut_pointer(t.dtype), *t.stride()[:3])


def supports(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> bool:
    """Whether the kernels take these tensors: on the CPU, parameters of a known dtype with their last
    dim contiguous, codes contiguous within a token (values) or a group (keys), at most ``MAX_DIM``
    channels, and the library built."""
    inner = codes.stride(-1) == 1 and (codes.dim() == 4 or codes.stride(-2) == codes.shape[-1])
    known = scale.dtype in kernels.KINDS and zero.dtype in kernels.KINDS
    return (codes.device.type == "cpu" and inner and known and scale.stride(-1) == 1
            and zero.stride(-1) == 1 and codes.shape[-1] * 8 // bits <= MAX_DIM
            and available())


def key_scores(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               bits: int) -> torch.Tensor:
    """``query [B, H, R, D]`` against KIVI keys ``codes [B, H, N, G, P]``, ``scale``/``zero``
    ``[B, H, N, 1, D]``: ``[B, H, R, N * G]`` float32 dot products (check ``supports`` first)."""
    if query.shape[-2] > MAX_ROWS:
        parts = query.split(MAX_ROWS, -2)
        return torch.cat([key_scores(rows, codes, scale, zero, bits) for rows in parts], -2)
    b, h, n, g, p = codes.shape
    r, d = query.shape[-2:]
    if d > p * 8 // bits or scale.shape[-1] != d or zero.shape[-1] != d or query.shape[:2] != (b, h):
        raise ShapeError(f"KIVI key scores: query {tuple(query.shape)} does not fit codes "
                         f"{tuple(codes.shape)} with scales {tuple(scale.shape)} at {bits} bits")
    query = query.float().contiguous()
    out = torch.empty(b, h, r, n * g, dtype=torch.float32)
    cs = codes.stride()
    _library().kivi_key_scores(
        b, h, r, d, bits, query.data_ptr(), codes.data_ptr(), *cs[:3], n, g, p,
        *_param(scale), *_param(zero), out.data_ptr(), n * g)
    return out


def value_sums(probs: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               bits: int, group: int, head_dim: int) -> torch.Tensor:
    """``probs [B, H, R, T]`` over KIVI values ``codes [B, H, T, P]``, ``scale``/``zero``
    ``[B, H, T, ceil(D / group)]``: ``[B, H, R, D]`` float32 (check ``supports`` first)."""
    if probs.shape[-2] > MAX_ROWS:
        return torch.cat([value_sums(rows, codes, scale, zero, bits, group, head_dim)
                          for rows in probs.split(MAX_ROWS, -2)], -2)
    b, h, t, p = codes.shape
    r = probs.shape[-2]
    groups = -(-head_dim // group)
    if head_dim > p * 8 // bits or scale.shape[-1] != groups or zero.shape[-1] != groups \
            or probs.shape[:2] != (b, h) or probs.shape[-1] != t:
        raise ShapeError(f"KIVI value sums: probabilities {tuple(probs.shape)} do not fit codes "
                         f"{tuple(codes.shape)} with scales {tuple(scale.shape)} at {bits} bits")
    probs = probs.float()
    strides = probs.stride()
    if strides[3] != 1 or strides[1] != r * strides[2] or strides[0] != h * strides[1]:  # rows must be even
        probs = probs.contiguous()
    row = probs.stride(2)
    out = torch.empty(b, h, r, head_dim, dtype=torch.float32)
    cs = codes.stride()
    _library().kivi_value_sums(
        b, h, r, head_dim, bits, group, probs.data_ptr(), row, codes.data_ptr(), *cs[:3], t, p,
        *_param(scale), *_param(zero), out.data_ptr())
    return out


def pool_pointers(pool: dict[str, torch.Tensor]) -> tuple[int | None, ...]:
    """A pool of KIVI pages (``k.codes``, ``k.scale``, ``k.zero``, ``v.codes``, ``v.scale``, ``v.zero``,
    each ``[Hkv, num_blocks, ...]`` contiguous) as the paged kernels take it: the key codes, scale and
    zero point, then the values' (each parameter as pointer, dtype kind and FP8 table)."""
    def param(t: torch.Tensor) -> tuple[int, int, int | None]:
        return t.data_ptr(), kernels.KINDS[t.dtype], lut_pointer(t.dtype)
    return (pool["k.codes"].data_ptr(), *param(pool["k.scale"]), *param(pool["k.zero"]),
            pool["v.codes"].data_ptr(), *param(pool["v.scale"]), *param(pool["v.zero"]))


def paged_dequantize(pool: dict[str, torch.Tensor], ids: torch.Tensor, bits: int, group: int,
                     keys: torch.Tensor, values: torch.Tensor) -> None:
    """The first ``keys.shape[1]`` tokens (whole key groups) held in blocks ``ids`` (int64, in order) of
    a pool of KIVI pages (see ``pool_pointers``), decoded once into float32 ``keys`` / ``values``
    ``[Hkv, tokens, D]`` (rows contiguous, any head stride)."""
    hkv, num_blocks, key_groups, group_tokens, code_bytes = pool["k.codes"].shape
    tokens, head_dim = keys.shape[1:]
    if keys.shape != values.shape or keys.shape[0] != hkv or {keys.dtype, values.dtype} != {torch.float32} \
            or keys.stride()[1:] != (head_dim, 1) or values.stride()[1:] != (head_dim, 1) \
            or tokens % group_tokens or ids.numel() * key_groups * group_tokens < tokens:
        raise ShapeError(f"KIVI pages: {tokens} tokens of blocks {ids.numel()} x {key_groups * group_tokens} "
                         f"tokens do not decode into keys {tuple(keys.shape)} / values {tuple(values.shape)}")
    ids = ids.to(torch.int64).contiguous()
    _library().kivi_paged_dequantize(
        hkv, head_dim, bits, group, *pool_pointers(pool), num_blocks, key_groups, group_tokens, code_bytes,
        ids.data_ptr(), tokens, keys.data_ptr(), keys.stride(0), values.data_ptr(), values.stride(0))


@cache
def _stored(dtype: torch.dtype) -> tuple[object, ...]:
    """A parameter dtype as the encoder takes it: kind, FP8 table, largest finite code, its value and
    the smallest positive value."""
    limit = torch.finfo(dtype).max
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    top = torch.tensor(limit, dtype=dtype).view(ints[dtype.itemsize])
    return kernels.KINDS[dtype], lut_pointer(dtype), int(top), limit, smallest(dtype)


def _encodes(x: torch.Tensor, *dtypes: torch.dtype) -> bool:
    return x.device.type == "cpu" and x.shape[-1] <= MAX_DIM and all(d in kernels.KINDS for d in dtypes) \
        and available()


def encode_keys(x: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype, zero_dtype: torch.dtype
                ) -> dict[str, torch.Tensor] | None:
    """KIVI keys ``x [B, H, T, D]`` (float32, ``T`` a multiple of ``group``) encoded per channel over each
    group of ``group`` tokens: ``codes``, ``scale`` and ``zero`` as ``KiviKeyCodec`` stores them; None
    where the C encoder does not take them (not the CPU, more than ``MAX_DIM`` channels, a dtype it
    does not know, the library not built)."""
    if not _encodes(x, scale_dtype, zero_dtype):
        return None
    b, h, t, d = x.shape
    x, size = x.contiguous(), packed_size(d, bits)
    codes = torch.empty(b, h, t // group, group, size, dtype=torch.uint8)
    scale, zero = (torch.empty(b, h, t // group, 1, d, dtype=dtype) for dtype in (scale_dtype, zero_dtype))
    _library().kivi_encode_keys(b * h, t // group, group, d, bits, x.data_ptr(), codes.data_ptr(), size,
                                scale.data_ptr(), *_stored(scale_dtype), zero.data_ptr(),
                                *_stored(zero_dtype))
    return {"codes": codes, "scale": scale, "zero": zero}


def encode_values(x: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype, zero_dtype: torch.dtype
                  ) -> dict[str, torch.Tensor] | None:
    """KIVI values ``x [B, H, T, D]`` (float32) encoded per token over each group of ``group`` channels:
    ``codes``, ``scale`` and ``zero`` as ``KiviValueCodec`` stores them; None where the C encoder does
    not take them (as ``encode_keys``)."""
    if not _encodes(x, scale_dtype, zero_dtype):
        return None
    b, h, t, d = x.shape
    x, size, groups = x.contiguous(), packed_size(d, bits), -(-d // group)
    codes = torch.empty(b, h, t, size, dtype=torch.uint8)
    scale, zero = (torch.empty(b, h, t, groups, dtype=dtype) for dtype in (scale_dtype, zero_dtype))
    _library().kivi_encode_values(b * h * t, d, group, bits, x.data_ptr(), codes.data_ptr(), size,
                                  scale.data_ptr(), *_stored(scale_dtype), zero.data_ptr(),
                                  *_stored(zero_dtype))
    return {"codes": codes, "scale": scale, "zero": zero}
