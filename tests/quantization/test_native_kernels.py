"""The C kernels equal their torch definitions: KIVI decode (``kvfactory.codecs.native``) against
decoding the codes and multiplying, the KIVI encoder against the codecs' torch path bit for bit, page
scores and top pages (``kvfactory.selectors.pages``); their
declared signatures are those of the C source, and a call that does not fit them raises."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfactory import kernels
from kvfactory.codecs import native
from kvfactory.codecs.kivi import KiviKeyCodec, KiviValueCodec
from kvfactory.errors import ShapeError
from kvfactory.selectors.pages import best_dot, split_rows, top_pages

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")

PARAMS = {"fp8": (torch.float8_e4m3fn, torch.float8_e4m3fn), "fp16": (torch.float16, torch.float16),
          "bf16": (torch.bfloat16, torch.bfloat16), "fp32": (torch.float32, torch.float32)}


def encoded(codec, batch: int, heads: int, tokens: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.randn(1, heads, 1, dim, generator=gen)  # per-channel offsets, as real keys have
    x = torch.randn(batch, heads, tokens, dim, generator=gen) * 2 + offsets
    enc = codec.encode(x)
    return enc, codec.decode(enc)


# head_dim 64 and 128 at 4 and 2 bits take the compiled-size AVX-512 bodies, the others the portable one
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dim", [64, 128, 16, 24, 63])
@pytest.mark.parametrize("group", [32, 8])
@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_key_scores_equal_decoded_keys(bits, dim, group, params, rows) -> None:
    scale_dtype, zero_dtype = PARAMS[params]
    codec = KiviKeyCodec(bits=bits, group_size=group, scale_dtype=scale_dtype, zero_dtype=zero_dtype)
    enc, keys = encoded(codec, 2, 3, 4 * group, dim)
    query = torch.randn(2, 3, rows, dim, generator=torch.Generator().manual_seed(1))
    t = enc.tensors
    assert native.supports(t["codes"], t["scale"], t["zero"], bits)
    got = native.key_scores(query, t["codes"], t["scale"], t["zero"], bits)
    torch.testing.assert_close(got, query @ keys.transpose(-1, -2), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize(("dim", "group"),
                         [(64, 32), (128, 32), (64, 16), (64, 64), (64, 8), (24, 16), (63, 32)])
@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_value_sums_equal_decoded_values(bits, dim, group, params, rows) -> None:
    scale_dtype, zero_dtype = PARAMS[params]
    codec = KiviValueCodec(bits=bits, group_size=group, scale_dtype=scale_dtype, zero_dtype=zero_dtype)
    enc, values = encoded(codec, 2, 3, 37, dim)
    probs = torch.rand(2, 3, rows, 37, generator=torch.Generator().manual_seed(1)).softmax(-1)
    t = enc.tensors
    got = native.value_sums(probs, t["codes"], t["scale"], t["zero"], bits, group, dim)
    torch.testing.assert_close(got, probs @ values, atol=1e-4, rtol=1e-5)


ENCODED_PARAMS = {**PARAMS, "kivi": (torch.float8_e4m3fn, torch.float16),
                  "mixed": (torch.float16, torch.bfloat16)}


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([4, 2]), dim=st.sampled_from([64, 24, 7]), group=st.sampled_from([32, 5, 1]),
       params=st.sampled_from(list(ENCODED_PARAMS)),
       magnitude=st.sampled_from([1e-30, 1e-5, 1.0, 300.0, 1e6]),
       constant=st.booleans(), seed=st.integers(0, 2**16))
def test_the_c_encoder_stores_what_torch_stores(bits, dim, group, params, magnitude, constant, seed) -> None:
    """Codes, scales and zero points equal byte for byte: parameters rounded up or down to their dtype
    at every magnitude (FP8 and fp16 subnormals, saturation), constant groups, groups of one token."""
    scale_dtype, zero_dtype = ENCODED_PARAMS[params]
    gen = torch.Generator().manual_seed(seed)
    offsets = 4 * torch.randn(1, 3, 1, dim, generator=gen)
    x = (torch.randn(2, 3, 2 * group, dim, generator=gen) + offsets) * magnitude
    if constant:
        x[:, 1] = x[:, 1, :1]  # one head's tokens all alike: max == min in every key group
    for codec in (KiviKeyCodec(bits=bits, group_size=group, scale_dtype=scale_dtype, zero_dtype=zero_dtype),
                  KiviValueCodec(bits=bits, group_size=group, scale_dtype=scale_dtype, zero_dtype=zero_dtype,
                                 head_dim=dim)):
        native_side, torch_side = codec.encode(x).tensors, codec.encode_in_torch(x)
        for name, stored in torch_side.items():
            assert native_side[name].dtype == stored.dtype and native_side[name].shape == stored.shape
            assert torch.equal(native_side[name].view(torch.uint8), stored.view(torch.uint8)), name


def test_strided_views_are_read_in_place() -> None:
    """Runs cut from a larger buffer (a dense store's headroom, a slice of probabilities) are read
    through their strides, not copied."""
    kc, vc = KiviKeyCodec(bits=4), KiviValueCodec(bits=4)
    kenc, keys = encoded(kc, 2, 3, 192, 64)
    venc, values = encoded(vc, 2, 3, 192, 64)
    k = {n: t[:, :, 1:5] for n, t in kenc.tensors.items()}  # groups 1..4 of 6
    v = {n: t[:, :, 32:160] for n, t in venc.tensors.items()}
    query = torch.randn(2, 3, 3, 64, generator=torch.Generator().manual_seed(1))
    probs = torch.rand(2, 3, 3, 200, generator=torch.Generator().manual_seed(2))[..., 40:168]
    assert not k["codes"].is_contiguous() and not probs.is_contiguous()
    scores = native.key_scores(query, k["codes"], k["scale"], k["zero"], 4)
    torch.testing.assert_close(scores, query @ keys[:, :, 32:160].transpose(-1, -2), atol=1e-4, rtol=1e-5)
    sums = native.value_sums(probs, v["codes"], v["scale"], v["zero"], 4, 32, 64)
    torch.testing.assert_close(sums, probs @ values[:, :, 32:160], atol=1e-4, rtol=1e-4)


def test_shapes_that_do_not_fit_the_codes_are_refused() -> None:
    kenc, _ = encoded(KiviKeyCodec(bits=4), 1, 2, 64, 64)
    venc, _ = encoded(KiviValueCodec(bits=4), 1, 2, 64, 64)
    k, v = kenc.tensors, venc.tensors
    with pytest.raises(ShapeError, match="does not fit"):
        native.key_scores(torch.randn(1, 2, 3, 72), k["codes"], k["scale"], k["zero"], 4)
    with pytest.raises(ShapeError, match="do not fit"):
        native.value_sums(torch.rand(1, 2, 3, 63), v["codes"], v["scale"], v["zero"], 4, 32, 64)


def test_unsupported_layouts_are_declined() -> None:
    codec = KiviKeyCodec(bits=4)
    enc, _ = encoded(codec, 1, 2, 64, 64)
    t = enc.tensors
    assert not native.supports(t["codes"][..., ::2], t["scale"], t["zero"], 4)  # bytes not contiguous
    assert not native.supports(t["codes"], t["scale"].to(torch.float64), t["zero"], 4)
    big = KiviKeyCodec(bits=4).encode(torch.randn(1, 1, 32, 1100))
    assert not native.supports(big.tensors["codes"], big.tensors["scale"], big.tensors["zero"], 4)


def test_the_library_is_built_once_and_shared(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVFACTORY_KERNEL_DIR", str(tmp_path))
    compiler = kernels.c_compiler()
    first = kernels.build("pages", compiler)  # the quickest to compile (kivi.c takes a minute at -O3)
    built = first.stat().st_mtime_ns
    assert kernels.build("pages", compiler) == first and first.stat().st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def _c_definitions(name: str) -> dict[str, str]:
    """The exported (not static) function definitions of ``NAME.c``, whitespace collapsed, by name."""
    text = kernels.source(name).read_text()
    found = re.findall(r"^(?:void|int|float|int64_t) +\w+\([^)]*\)", text, flags=re.M)
    return {re.match(r"\w+ +(\w+)", d).group(1): " ".join(d.split()) for d in found}


@pytest.mark.parametrize("name", sorted(kernels.SIGNATURES))
def test_signatures_are_those_of_the_c_definitions(name) -> None:
    """Every exported function is declared, with the C definition's types and parameter names."""
    declared = {kernels.signature(p)[0]: " ".join(p.split()) for p in kernels.SIGNATURES[name]}
    assert declared == _c_definitions(name) and declared
    lib = kernels.load(name)
    for function in declared:
        assert isinstance(getattr(lib, function), ctypes._CFuncPtr)
        assert len(getattr(lib, function).argtypes) == len(kernels.signature(declared[function])[2])


def test_signature_types() -> None:
    name, restype, params = kernels.signature("int f(int64_t n, const float *x, float s, int k, void *out)")
    assert (name, restype) == ("f", ctypes.c_int)
    assert params == (("n", ctypes.c_int64), ("x", ctypes.c_void_p), ("s", ctypes.c_float),
                      ("k", ctypes.c_int), ("out", ctypes.c_void_p))
    assert kernels.signature("void g(int64_t *out)")[1:] == (None, (("out", ctypes.c_void_p),))
    with pytest.raises(KeyError):
        kernels.signature("void h(double x)")  # a type the table does not map


def test_a_call_that_does_not_fit_the_signature_raises() -> None:
    """Wrong argument counts, keywords or types raise before any C code runs; a fitting call, by
    position or by the C parameter names, works."""
    lib = kernels.load("pages")
    scores = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    out = torch.full((1, 2), -1, dtype=torch.long)
    args = (1, 4, scores.data_ptr(), 0, 4, 2, out.data_ptr())
    with pytest.raises(TypeError, match="argument 'out' missing"):
        lib.top_pages(*args[:-1])  # one short: the C code would read a garbage pointer
    with pytest.raises(TypeError, match="exactly 7 arguments"):
        lib.top_pages(*args, 0)  # one too many: plain ctypes argtypes would let this through
    with pytest.raises(TypeError):
        lib.top_pages(*args[:-1], output=out.data_ptr())  # not the C parameter's name
    with pytest.raises(ctypes.ArgumentError):
        lib.top_pages(1, 4.5, *args[2:])  # a float for an int64_t
    with pytest.raises(ctypes.ArgumentError):
        lib.top_pages(*args[:2], scores, *args[3:])  # a tensor, not its data pointer
    with pytest.raises(TypeError, match="argument 'cb' missing"):
        kernels.load("kivi").kivi_key_scores(*args)
    assert (out == -1).all()  # nothing ran
    assert lib.top_pages(*args) == 0 and sorted(out[0].tolist()) == [0, 2]
    out.fill_(-1)
    assert lib.top_pages(rows=1, P=4, scores=scores.data_ptr(), lo=1, hi=4, k=1, out=out.data_ptr()) == 0
    assert out[0, 0] == 2


def test_no_compiler_warns_and_leaves_the_torch_kernels(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVFACTORY_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="building the C kivi kernels failed"):
        assert kernels.load.__wrapped__("kivi") is None
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.warns(UserWarning, match="building the C kivi kernels failed"):
        assert kernels.load.__wrapped__("kivi") is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
# 128, 64, 16: blocks of 16 pages and a tail of 2; 192: wider than a block keeps (page by page);
# 24: not whole vectors (the portable loop)
@pytest.mark.parametrize("features", [128, 64, 16, 192, 24])
@pytest.mark.parametrize("rows", [1, 3])
def test_page_scores_equal_the_matrix_product(dtype, features, rows) -> None:
    gen = torch.Generator().manual_seed(0)
    summaries = torch.randn(2, 3, 50, features + 8, generator=gen).to(dtype)[..., :features]  # a strided view
    query = torch.randn(2, 3, rows, features, generator=gen)
    dots = query @ summaries.float().transpose(-1, -2)
    torch.testing.assert_close(best_dot(query, summaries), dots.amax(2), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("features", [128, 24])
def test_page_scores_split_the_queries_themselves(features) -> None:
    """Quest's rows ``[max(q, 0) | min(q, 0)]`` formed in the kernel as ``split_rows`` does: their dot
    with a page's ``[max | min]`` is the bound ``q · centre + |q| · half-width``."""
    gen = torch.Generator().manual_seed(4)
    summaries = torch.randn(2, 3, 50, features, generator=gen).half()
    query = torch.randn(2, 3, 3, features // 2, generator=gen)
    high, low = summaries.float().chunk(2, -1)
    bound = query @ ((high + low) / 2).transpose(-1, -2) + query.abs() @ ((high - low) / 2).transpose(-1, -2)
    torch.testing.assert_close(split_rows(query) @ summaries.float().transpose(-1, -2), bound,
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(best_dot(query, summaries, bound=True), bound.amax(2), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("lo", "hi", "k"), [(0, 50, 7), (1, 49, 48), (3, 40, 1), (0, 50, 50)])
def test_top_pages_are_the_largest_scores(lo, hi, k) -> None:
    scores = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(1))
    scores[0, 0, 10] = float("nan")  # never preferred to a number
    scores[1, 2, 20:30] = 0.5  # ties
    got = top_pages(scores, lo, hi, k)
    assert got.shape == (2, 3, k) and ((got >= lo) & (got < hi)).all()
    for row, picked in zip(scores.flatten(0, 1), got.flatten(0, 1), strict=True):
        assert picked.unique().numel() == k
        window = row[lo:hi].nan_to_num(float("-inf"))
        kth = window.topk(k).values[-1]
        assert (row[picked].nan_to_num(float("-inf")) >= kth).all()
