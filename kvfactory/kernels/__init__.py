"""C kernels for the CPU hot paths, compiled on first use and called through ctypes.

Each ``NAME.c`` here is plain C (no Python or torch headers, so it compiles in about a second):
``kivi.c`` reads KIVI's packed codes at decode (``kvfactory.codecs.native``), ``pages.c`` scores and
picks a layer's pages for the page selectors (``kvfactory.selectors.pages``), ``common.h`` is what
they share. ``load(NAME)`` builds one with
the system C compiler (``$CC``, else ``cc``; ``-O3 -march=native``) into
``$XDG_CACHE_HOME/kvfactory/kernels`` (or ``KVFACTORY_KERNEL_DIR``), named by a hash of the source,
the flags and the CPU, written atomically so parallel processes share it. Without a working
compiler it returns None after one warning, and callers keep their torch code paths.
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


def build(name: str, compiler: str) -> Path:
    """The compiled library of ``NAME.c`` (with the headers here), built unless a matching one is cached."""
    headers = sorted(source(name).parent.glob("*.h"))
    text = source(name).read_bytes() + b"".join(h.read_bytes() for h in headers)
    key = hashlib.sha256(text + " ".join([compiler, *FLAGS, *LIBS, _cpu_id()]).encode()).hexdigest()[:16]
    target = _kernel_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, str(source(name)), *LIBS, "-o", tmp], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@cache
def load(name: str) -> ctypes.CDLL | None:
    """``NAME.c`` built and loaded (once per process); None, with a warning, if it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn(f"kvfactory: no C compiler found for the {name} kernels; using the torch code path "
                      "instead", stacklevel=3)
        return None
    try:
        return ctypes.CDLL(str(build(name, compiler)))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"kvfactory: building the C {name} kernels failed ({detail}); using the torch code "
                      "path instead", stacklevel=3)
        return None
