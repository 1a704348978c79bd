"""C kernels for the CPU hot paths, compiled on first use and called through ctypes.

Each ``NAME.c`` here is plain C (no Python or torch headers, so it compiles in seconds, once):
``kivi.c`` reads KIVI's packed codes at decode (``kvfactory.codecs.native``; a batch's pages in place
for ``kvfactory.quantization.ragged``), ``pages.c`` scores and picks a layer's pages for the page
selectors (``kvfactory.selectors.pages``), ``ragged.c`` attends a batch of decoding sequences over
their blocks of a paged pool (``kvfactory.storage.ragged``), ``chunk.c`` a prefill chunk over its
stored tokens and itself (``kvfactory.attention.causal_chunk``), ``linear.c`` the engine's linear
layers on one thread (``kvfactory.engine.weights``), ``common.h`` is what they share (the
wheel ships the headers with the sources). ``load(NAME)`` builds one with the system C compiler
(``$CC``, else ``cc``; ``-O3 -march=native``) into ``$XDG_CACHE_HOME/kvfactory/kernels`` (or
``KVFACTORY_KERNEL_DIR``), named by a hash of the source, the flags and the CPU, written atomically
so parallel processes share it. Without a working
compiler it returns None after one warning, and callers keep their torch code paths.

Every function a library exports is declared once, in ``SIGNATURES`` as its C definition reads, and
``load`` binds it with those types and parameter names: a call with a wrong argument count, a
missing or unknown keyword, or a value ctypes cannot convert raises (TypeError, ctypes.ArgumentError)
instead of passing the C code garbage. Pointers are ``c_void_p`` (callers pass ``tensor.data_ptr()``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c11"]
LIBS = ["-lm"]  # after the source, as linkers resolve in order
I64, PTR = ctypes.c_int64, ctypes.c_void_p
# the dtype codes of common.h (F32, F16, BF16, LUT8: FP8 read through a 256-entry table)
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 3}

# What each library exports, copied from its C definitions (checked by
# tests/quantization/test_native_kernels.py).
SIGNATURES = {
    "kivi": (
        "void kivi_key_scores(int64_t B, int64_t H, int64_t R, int64_t D, int bits, const float *query, "
        "const uint8_t *codes, int64_t cb, int64_t ch, int64_t cn, int64_t N, int64_t G, int64_t P, "
        "const void *scale, int skind, const float *slut, int64_t sb, int64_t sh, int64_t sn, "
        "const void *zero, int zkind, const float *zlut, int64_t zb, int64_t zh, int64_t zn, "
        "float *scores, int64_t row)",
        "void kivi_value_sums(int64_t B, int64_t H, int64_t R, int64_t D, int bits, int64_t group, "
        "const float *probs, int64_t row, const uint8_t *codes, int64_t cb, int64_t ch, int64_t ct, "
        "int64_t T, int64_t P, const void *scale, int skind, const float *slut, int64_t sb, int64_t sh, "
        "int64_t st, const void *zero, int zkind, const float *zlut, int64_t zb, int64_t zh, int64_t zt, "
        "float *out)",
        "void kivi_paged_decode(int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int bits, int64_t group, "
        "const float *query, float scale, const uint8_t *kcodes, const void *kscale, int kskind, "
        "const float *kslut, const void *kzero, int kzkind, const float *kzlut, const uint8_t *vcodes, "
        "const void *vscale, int vskind, const float *vslut, const void *vzero, int vzkind, "
        "const float *vzlut, int64_t NB, int64_t KN, int64_t G, int64_t P, const int64_t *tables, "
        "int64_t max_blocks, const int64_t *tokens, float *out, float *lse)",
        "void kivi_paged_dequantize(int64_t Hkv, int64_t D, int bits, int64_t group, const uint8_t *kcodes, "
        "const void *kscale, int kskind, const float *kslut, const void *kzero, int kzkind, "
        "const float *kzlut, const uint8_t *vcodes, const void *vscale, int vskind, const float *vslut, "
        "const void *vzero, int vzkind, const float *vzlut, int64_t NB, int64_t KN, int64_t G, int64_t P, "
        "const int64_t *ids, int64_t tokens, float *keys, int64_t kh, float *values, int64_t vh)",
        "void kivi_encode_keys(int64_t BH, int64_t N, int64_t G, int64_t D, int bits, const float *x, "
        "uint8_t *codes, int64_t P, void *scale, int skind, const float *slut, int64_t stop, float slimit, "
        "float ssmallest, void *zero, int zkind, const float *zlut, int64_t ztop, float zlimit, "
        "float zsmallest)",
        "void kivi_encode_values(int64_t BT, int64_t D, int64_t group, int bits, const float *x, "
        "uint8_t *codes, int64_t P, void *scale, int skind, const float *slut, int64_t stop, float slimit, "
        "float ssmallest, void *zero, int zkind, const float *zlut, int64_t ztop, float zlimit, "
        "float zsmallest)",
    ),
    "pages": (
        "int page_scores(int64_t B, int64_t H, int64_t R, int64_t F, int64_t P, const float *rows, "
        "const void *features, int kind, int64_t fb, int64_t fh, int64_t fp, int bound, float *scores)",
        "int top_pages(int64_t rows, int64_t P, const float *scores, int64_t lo, int64_t hi, int64_t k, "
        "int64_t *out)",
        "int token_shares(int64_t B, int64_t H, int64_t R, int64_t C, int64_t T, int64_t page, "
        "const float *rows, const int8_t *codes, int64_t cb, int64_t ch, int64_t cc, float *out)",
    ),
    "linear": (
        "int linear_has_body(void)",
        "int rows_linear(int64_t M, int64_t N, int64_t K, const float *x, int64_t xs, const float *w, "
        "const float *bias, float *out, int64_t os)",
    ),
    "chunk": (
        "int chunk_has_body(void)",
        "int chunk_attention(int64_t Hq, int64_t Hkv, int64_t C, int64_t T, int64_t D, const float *query, "
        "int64_t qh, int64_t qc, const float *key, int64_t kh, int64_t kt, const float *value, int64_t vh, "
        "int64_t vt, const int64_t *table, int64_t P, int causal, float scale, float *out, float *lse)",
    ),
    "ragged": (
        "void paged_decode(int64_t S, int64_t Hq, int64_t Hkv, int64_t D, const float *query, "
        "const void *k_pool, const void *v_pool, int kind, int64_t num_blocks, int64_t P, "
        "const int64_t *tables, int64_t max_blocks, const int64_t *starts, const int64_t *lengths, "
        "float scale, float *out, float *lse)",
    ),
}
_C_TYPES = {"void": None, "int": ctypes.c_int, "int64_t": I64, "float": ctypes.c_float}


def signature(prototype: str) -> tuple[str, type | None, tuple[tuple[str, type], ...]]:
    """``(name, return type, ((parameter, type), ...))`` of a C prototype in ctypes types, every pointer
    a ``c_void_p``; a scalar type outside ``int``, ``int64_t`` and ``float`` raises KeyError."""
    head, _, params = prototype.strip().removesuffix(")").partition("(")
    restype, name = head.split()
    parsed = []
    for param in params.split(",") if params.strip() != "void" else ():
        kind, _, pname = param.strip().replace("*", "* ").rpartition(" ")
        parsed.append((pname, PTR if "*" in kind else _C_TYPES[kind.strip()]))
    return name, _C_TYPES[restype], tuple(parsed)


def _bind(lib: ctypes.CDLL, name: str) -> ctypes.CDLL:
    """``lib`` with each function of ``SIGNATURES[name]`` replaced by one that checks its arguments."""
    for prototype in SIGNATURES[name]:
        function, restype, params = signature(prototype)
        prototype_type = ctypes.CFUNCTYPE(restype, *(t for _, t in params))
        setattr(lib, function, prototype_type((function, lib), tuple((1, p) for p, _ in params)))
    return lib


def source(name: str) -> Path:
    return Path(__file__).with_name(f"{name}.c")


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def _kernel_dir() -> Path:
    if "KVFACTORY_KERNEL_DIR" in os.environ:
        return Path(os.environ["KVFACTORY_KERNEL_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvfactory" / "kernels"


def build(name: str, compiler: str, extra: tuple[str, ...] = ()) -> Path:
    """The compiled library of ``NAME.c`` (with the headers here), built unless a matching one is cached;
    ``extra``: flags after ``FLAGS`` (``-mno-avx512f`` builds the AVX2 bodies on an AVX-512 CPU)."""
    headers = sorted(source(name).parent.glob("*.h"))
    text = source(name).read_bytes() + b"".join(h.read_bytes() for h in headers)
    flags = " ".join([compiler, *FLAGS, *extra, *LIBS, _cpu_id()])
    key = hashlib.sha256(text + flags.encode()).hexdigest()[:16]
    target = _kernel_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, *extra, str(source(name)), *LIBS, "-o", tmp], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def c_compiler() -> str | None:
    """The C compiler the kernels are built with: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@cache
def load(name: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """``NAME.c`` built (with ``extra`` flags, see ``build``) and loaded, once per process, with its
    ``SIGNATURES`` bound; None, with a warning, if it cannot be built."""
    compiler = c_compiler()
    if compiler is None:
        warnings.warn(f"kvfactory: no C compiler found for the {name} kernels; using the torch code path "
                      "instead", stacklevel=3)
        return None
    try:
        return _bind(ctypes.CDLL(str(build(name, compiler, extra))), name)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"kvfactory: building the C {name} kernels failed ({detail}); using the torch code "
                      "path instead", stacklevel=3)
        return None
