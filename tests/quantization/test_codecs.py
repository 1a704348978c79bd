"""Codec tests on random tensors: one matrix over every codec and role, then codec-specific checks.

The error bounds are the ones each format implies with the parameters the codec stored: half a
quantisation step for int8 and KIVI, half an FP8 ulp (relative) for fp8, zero for identity.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvfactory import ConfigError, ShapeError
from kvfactory.codecs import (
    CODECS,
    Codec,
    Encoded,
    Fp8Codec,
    IdentityCodec,
    Int8Codec,
    KiviKeyCodec,
    KiviValueCodec,
    make_codec,
)
from kvfactory.codecs.base import round_to
from kvfactory.codecs.fp8 import FORMATS
from kvfactory.codecs.packing import pack, packed_size, unpack

HEADS = 3
CASES = {
    **{f"{name}-{role}": (lambda name=name, role=role: make_codec(name, role))
       for name in ("identity", "int8", "int4", "int2", "fp8", "fp8_e5m2") for role in ("key", "value")},
    "int8-head": lambda: Int8Codec(granularity="head"),
    "int8-static": lambda: Int8Codec(granularity="head", static_scale=torch.tensor([0.1, 0.09, 0.12])),
    "fp8-static": lambda: Fp8Codec(scale="static", static_scale=torch.tensor([0.03, 0.035, 0.04])),
    "int4-key-fp16": lambda: KiviKeyCodec(bits=4, scale_dtype=torch.float16),
    "int2-value-g24": lambda: KiviValueCodec(bits=2, group_size=24, zero_dtype=torch.float16),
    "int4-key-g8": lambda: KiviKeyCodec(bits=4, group_size=8),
}
cases = pytest.mark.parametrize("case", list(CASES))
SHAPES = [(1, HEADS, 64, 64), (3, HEADS, 32, 63), (1, HEADS, 64, 80)]
# FP8 error: (relative, for normal values; absolute / scale, for subnormals) = half an ulp
FP8_ERROR = {"e4m3": (2.0 ** -4, 2.0 ** -10), "e5m2": (2.0 ** -3, 2.0 ** -17)}


def data(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 2).to(dtype)


def allowed_error(codec: Codec, enc: Encoded, x: torch.Tensor) -> torch.Tensor:
    """The largest |x - decode(x)| per element the codec's format allows, from what it stored."""
    b, h, t, d = x.shape
    scale = enc.tensors.get("scale")
    if isinstance(codec, IdentityCodec):
        return torch.zeros(())
    if isinstance(codec, Int8Codec):
        if codec.static_scale is not None:
            return codec.static_scale.view(1, h, 1, 1) / 2
        per_unit = scale.float().reshape(b, h, -1, 1)
        return per_unit.repeat_interleave(t // per_unit.shape[2], 2) / 2
    if isinstance(codec, Fp8Codec):
        rel, sub = FP8_ERROR[codec.format]
        s = codec.static_scale.view(1, h, 1, 1) if scale is None else scale.float()
        return rel * x.abs() + sub * s
    if isinstance(codec, KiviKeyCodec):
        g = codec.group_size
        return scale.float().expand(b, h, t // g, g, d).reshape(b, h, t, d) / 2
    return scale.float().repeat_interleave(codec.group_size, -1)[..., :d] / 2


# --- the shared matrix ---------------------------------------------------------------------------

@cases
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_error_within_format_bound(case, shape):
    codec = CASES[case]()
    x = data(shape)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = (x - y).abs()
    assert bool((err <= allowed_error(codec, enc, x) * (1 + 1e-5) + 1e-6).all()), float(err.max())
    for name, tensor in enc.tensors.items():
        assert tensor.shape[:3] == (shape[0], shape[1], shape[2] // codec.unit), name


@cases
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_input(case, shape):
    """bf16 in, bf16 out; the quantiser sees the bf16 values exactly, decoding rounds to bf16."""
    codec = CASES[case]()
    x = data(shape, torch.bfloat16)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    exact = codec.decode(enc, out=torch.empty(x.shape))  # out's dtype decides: decode in fp32
    assert bool(((x.float() - exact).abs() <= allowed_error(codec, enc, x.float()) + 1e-6).all())
    assert (y.float() - exact).abs().max() <= 2 ** -6 * x.float().abs().max()


@cases
def test_encode_is_deterministic_and_leaves_input(case):
    codec = CASES[case]()
    x = data((1, HEADS, 32, 64))
    before = x.clone()
    with torch.inference_mode():
        first, second = codec.encode(x), codec.encode(x)
        inside = codec.decode(first)
    assert torch.equal(x, before) and torch.equal(codec.decode(first), inside)
    assert first.tensors.keys() == second.tensors.keys()
    for name in first.tensors:
        assert torch.equal(first.tensors[name].view(torch.uint8), second.tensors[name].view(torch.uint8))


@cases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_view(case, dtype):
    """decode(out=view) writes into the given view of a bigger buffer and nowhere else."""
    codec = CASES[case]()
    x = data((2, HEADS, 32, 63), dtype)
    enc = codec.encode(x)
    buffer = torch.full((2, HEADS, 100, 63), 7.0, dtype=dtype)
    view = buffer[:, :, 16:48]
    result = codec.decode(enc, out=view)
    assert result.data_ptr() == view.data_ptr()
    assert torch.equal(buffer[:, :, 16:48], codec.decode(enc))
    assert bool((buffer[:, :, :16] == 7).all()) and bool((buffer[:, :, 48:] == 7).all())


@cases
def test_decode_into_out_allocates_at_most_half_of_it(case):
    """No temporary as large as the output (fp8's int16 bit patterns take half of an fp32 one)."""
    codec = CASES[case]()
    enc = codec.encode(data((1, HEADS, 128, 64)))
    out = torch.empty(1, HEADS, 128, 64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        codec.decode(enc, out=out)
    allocated = [event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0]
    assert max(allocated, default=0) <= out.nbytes // 2


@cases
def test_runs_concatenate_select_and_drop_on_the_unit_axis(case):
    """What storage relies on: dim 2 of every tensor is the unit axis, dim 0 the batch row."""
    codec = CASES[case]()
    a, b = data((3, HEADS, 32, 64), seed=1), data((3, HEADS, 64, 64), seed=2)
    ea, eb = codec.encode(a), codec.encode(b)
    joined = Encoded({n: torch.cat([ea.tensors[n], eb.tensors[n]], 2) for n in ea.tensors}, 96)
    whole = codec.decode(joined)
    assert torch.equal(whole, torch.cat([codec.decode(ea), codec.decode(eb)], 2))
    rows = torch.tensor([2, 0])
    picked = Encoded({n: t.index_select(0, rows) for n, t in joined.tensors.items()}, 96)
    assert torch.equal(codec.decode(picked), whole.index_select(0, rows))
    unit = codec.unit
    dropped = Encoded({n: t[:, :, 1:] for n, t in joined.tensors.items()}, 96 - unit)
    assert torch.equal(codec.decode(dropped), whole[:, :, unit:])


@cases
def test_bytes_per_token_is_measured_bytes(case):
    for d in (64, 63):
        codec = CASES[case]()
        enc = codec.encode(data((2, HEADS, 256, d)))
        assert codec.bytes_per_token(HEADS, d) == pytest.approx(enc.nbytes() / (2 * 256))


@cases
def test_tokens_must_fill_whole_units(case):
    codec = CASES[case]()
    if codec.unit == 1:
        assert codec.decode(codec.encode(data((1, HEADS, 5, 64)))).shape[2] == 5
        return
    with pytest.raises(ValueError, match=rf"T={codec.unit + 1}\b.*unit={codec.unit}\b"):
        codec.encode(data((1, HEADS, codec.unit + 1, 64)))


@cases
def test_decode_checks_out_and_needs_a_dtype(case):
    codec = CASES[case]()
    enc = codec.encode(data((1, HEADS, 32, 64)))
    with pytest.raises(ShapeError):
        codec.decode(enc, out=torch.empty(1, HEADS, 32, 64, dtype=torch.int32))
    fresh = CASES[case]()  # no dtype until an encode: decoding needs `out`
    if not isinstance(fresh, IdentityCodec):
        with pytest.raises(ValueError, match="decode needs"):
            fresh.decode(enc)
        assert fresh.decode(enc, out=torch.empty(1, HEADS, 32, 64)).shape == (1, HEADS, 32, 64)


# --- sizes -------------------------------------------------------------------------------------------

# K+V bytes per token per layer relative to fp16 for SmolLM2 (3 KV heads, head_dim 64, group 32).
SMOLLM2_BUDGET = {"int8": 0.53, "fp8": 0.53, "fp8_e5m2": 0.53, "int4": 0.30, "int2": 0.17}


@pytest.mark.parametrize("name", list(SMOLLM2_BUDGET))
def test_smollm2_bytes_per_token_within_budget(name):
    fp16 = 2 * 3 * 64 * 2
    per_layer = sum(make_codec(name, role).bytes_per_token(3, 64) for role in ("key", "value"))
    assert per_layer / fp16 <= SMOLLM2_BUDGET[name]
    x = data((1, 3, 512, 64))
    measured = sum(make_codec(name, role).encode(x).nbytes() for role in ("key", "value")) / 512
    assert measured == per_layer


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("d", [64, 63, 80, 5])
def test_kivi_value_code_bytes(bits, d):
    """Values: ceil(D * bits / 8) code bytes per (row, head, token), plus one scale and zero per group."""
    codec = KiviValueCodec(bits=bits, group_size=32)
    enc = codec.encode(data((2, HEADS, 7, d)))
    per_token = math.ceil(d / (8 // bits))
    assert enc.tensors["codes"].shape == (2, HEADS, 7, per_token)
    assert enc.tensors["codes"].dtype == torch.uint8
    groups = math.ceil(d / 32)
    assert enc.nbytes() == 2 * HEADS * 7 * (per_token + groups * 2)  # fp8 scale + fp8 zero


def test_identity_width_follows_dtype():
    codec = IdentityCodec()
    x = data((1, HEADS, 4, 64), torch.bfloat16)
    assert torch.equal(codec.decode(codec.encode(x)), x)
    assert codec.bits == 16 and codec.bytes_per_token(HEADS, 64) == HEADS * 64 * 2
    with pytest.raises(ValueError, match="width"):
        _ = IdentityCodec().bits
    half = IdentityCodec(dtype=torch.float16)
    assert half.encode(data((1, HEADS, 4, 64))).tensors["data"].dtype == torch.float16


def test_static_scales_are_counted_once():
    int8 = Int8Codec(granularity="head", static_scale=torch.tensor([0.1, 0.2, 0.3]))
    fp8 = Fp8Codec(scale="static", static_scale=[0.1, 0.2, 0.3])
    for codec in (int8, fp8):
        assert codec.fixed_nbytes == 12 and codec.unit == 1
        assert set(codec.encode(data((1, 3, 8, 64))).tensors) == {"codes"}
        assert codec.bytes_per_token(3, 64) == 3 * 64
        with pytest.raises(ShapeError, match="2 KV heads"):
            codec.encode(data((1, 2, 8, 64)))
    assert make_codec("int8", "key").fixed_nbytes == 0


def test_static_scales_saturate():
    codec = Int8Codec(granularity="head", static_scale=[0.01, 0.01, 0.01])
    x = torch.full((1, 3, 2, 4), 5.0)
    assert torch.allclose(codec.decode(codec.encode(x)), torch.full_like(x, 1.27))


# --- packing ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("d", [1, 2, 3, 7, 16, 63, 64, 80])
def test_pack_unpack_is_exact(bits, d):
    gen = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 2 ** bits, (2, 3, 5, d), dtype=torch.uint8, generator=gen)
    packed = pack(codes, bits)
    assert packed.shape == (2, 3, 5, packed_size(d, bits)) == (2, 3, 5, math.ceil(d * bits / 8))
    assert torch.equal(unpack(packed, bits, torch.empty_like(codes)), codes)
    buffer = torch.cat([pack(torch.zeros_like(codes), bits), packed, packed], 2)  # a view at an offset
    assert torch.equal(unpack(buffer[:, :, 5:10], bits, torch.empty_like(codes)), codes)
    assert torch.equal(unpack(packed, bits, torch.empty(codes.shape)), codes.float())


# --- KIVI --------------------------------------------------------------------------------------------

def outlier_keys(seed=0) -> torch.Tensor:
    """Random keys with a few large channels shared by all tokens (KIVI's observation on real keys)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HEADS, 256, 64, generator=gen)
    keys[..., [3, 17, 40]] = keys[..., [3, 17, 40]] * 2 + torch.tensor([12.0, -9.0, 15.0])
    return keys


def relative_mse(codec: Codec, x: torch.Tensor) -> float:
    return float(((codec.decode(codec.encode(x)) - x) ** 2).sum() / (x ** 2).sum())


def test_kivi_keys_per_channel_beat_per_token_on_outlier_channels():
    keys = outlier_keys()
    per_channel = relative_mse(KiviKeyCodec(bits=4), keys)
    per_token = relative_mse(KiviValueCodec(bits=4), keys)
    assert per_channel < 2e-3  # measured 9.7e-4
    assert per_channel * 10 < per_token  # measured 19x
    assert relative_mse(KiviKeyCodec(bits=2), keys) < 0.03  # measured 0.024


def test_kivi_values_relative_error():
    values = data((1, HEADS, 256, 64))
    assert relative_mse(KiviValueCodec(bits=4), values) < 0.01  # measured 0.0076
    assert relative_mse(KiviValueCodec(bits=2), values) < 0.2  # measured 0.18


@pytest.mark.parametrize("codec", [KiviKeyCodec(bits=2), KiviValueCodec(bits=4)], ids=["key", "value"])
def test_kivi_constant_groups_decode_exactly(codec):
    x = torch.full((1, HEADS, 32, 64), 0.375)
    x[:, 1] = 0.0
    y = codec.decode(codec.encode(x))
    assert torch.equal(y, x)


@pytest.mark.parametrize("group_size,d", [(24, 64), (32, 80), (5, 63), (64, 32)])
def test_kivi_value_groups_not_dividing_head_dim(group_size, d):
    codec = KiviValueCodec(bits=4, group_size=group_size)
    x = data((2, HEADS, 8, d))
    enc = codec.encode(x)
    assert enc.tensors["scale"].shape == (2, HEADS, 8, math.ceil(d / group_size))
    err = (codec.decode(enc) - x).abs()
    assert bool((err <= allowed_error(codec, enc, x) + 1e-6).all())


def test_kivi_value_head_dim_is_fixed():
    codec = KiviValueCodec()
    codec.encode(data((1, HEADS, 2, 64)))
    with pytest.raises(ShapeError, match="head_dim 63"):
        codec.encode(data((1, HEADS, 2, 63)))


# --- fp8 -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_decode_matches_torch_cast(fmt):
    """The integer-op decode equals torch's own FP8 -> float conversion for every code."""
    codec = Fp8Codec(format=fmt, scale="static", static_scale=[1.0])
    codes = torch.arange(256, dtype=torch.uint8).view(FORMATS[fmt])
    codes = codes[codes.float().isfinite()].view(1, 1, 1, -1)
    out = codec.decode(Encoded({"codes": codes}, 1), out=torch.empty(codes.shape))
    assert torch.equal(out, codes.float())


# --- quantisation parameters ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_round_to_bounds_the_value(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2000, generator=gen) * 10.0 ** torch.randint(-6, 3, (2000,), generator=gen),
                   torch.tensor([0.0, -0.0, 1e-9, -1e-9])])
    up, down = round_to(x, dtype, up=True).float(), round_to(x, dtype, up=False).float()
    info = torch.finfo(dtype)
    tiny = float(torch.ones((), dtype=torch.int8 if dtype.itemsize == 1 else torch.int16).view(dtype))
    assert bool((up >= x).all()) and bool((down <= x).all())
    assert bool((up - down <= info.eps * x.abs() + tiny).all())


# --- registry and configuration ------------------------------------------------------------------

def test_make_codec_by_name_and_role():
    assert isinstance(make_codec("none", "key"), IdentityCodec)
    assert type(make_codec("int4", "key")) is KiviKeyCodec and make_codec("int4", "key").bits == 4
    assert type(make_codec("int2", "value")) is KiviValueCodec and make_codec("int2", "value").bits == 2
    assert make_codec("fp8_e5m2", "value").format == "e5m2"
    assert make_codec("int8", "value", granularity="head").unit == 16
    assert make_codec("int4", "key", group_size=64).unit == 64
    for name in CODECS:
        codec = make_codec(name, "key")
        assert name in ("none", codec.name)


@pytest.mark.parametrize("call,key", [
    (lambda: make_codec("int3", "key"), "quantization"),
    (lambda: make_codec("int4", "query"), "role"),
    (lambda: make_codec("int4", "key", bits=2), "KiviKeyCodec option"),
    (lambda: make_codec("int8", "key", group=3), "Int8Codec option"),
    (lambda: KiviKeyCodec(bits=3), "bits"),
    (lambda: KiviValueCodec(group_size=0), "group_size"),
    (lambda: KiviValueCodec(scale_dtype=torch.int8), "scale_dtype"),
    (lambda: Int8Codec(granularity="channel"), "granularity"),
    (lambda: Int8Codec(static_scale=[1.0, 2.0]), "static_scale"),
    (lambda: Int8Codec(granularity="head", static_scale=[1.0, -2.0]), "static_scale"),
    (lambda: Fp8Codec(format="e3m4"), "format"),
    (lambda: Fp8Codec(scale="static"), "static_scale"),
    (lambda: Fp8Codec(static_scale=[1.0]), "static_scale"),
    (lambda: IdentityCodec(dtype=torch.int8), "dtype"),
])
def test_bad_config_raises_config_error(call, key):
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.key == key


def test_unknown_name_lists_the_allowed_names():
    with pytest.raises(ConfigError, match="none, identity, int8, int4, int2, fp8, fp8_e5m2"):
        make_codec("int3", "key")
