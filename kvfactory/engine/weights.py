"""Weights prepacked for the engine's steps: the one place kvfactory lays linear weights out anew.

A decode step multiplies a few rows (one per sequence) by every weight matrix, so it is bound by
reading the weights; a prefill chunk multiplies hundreds, so it is bound by the arithmetic. On one
thread, MKL's single-precision GEMM over a row-major ``nn.Linear`` weight reaches neither bound for
few rows, and on AMD CPUs falls short for many rows too. Two layouts do better
(``benchmarks/linear_layouts.py`` measures them):

- **panels** of 32 output columns (``[out / 32, in, 32]``) for ``kernels/linear.c``, which streams each
  panel once for up to 8 rows at a time, so it reads at about the core's memory rate for few rows, and
  passes many rows over the panels in blocks of 64 that stay in L2. It runs on one thread with
  AVX-512, so it is the layout where torch runs on one thread (the engine's measured setting) on such
  a CPU and the output size is a multiple of 32;
- **oneDNN's** blocked layout (``torch.ops.mkldnn``, the layout torch's inductor packs weights into;
  vLLM's CPU build runs the same library), reordered once, spread over torch's threads: elsewhere.

For many rows the panels are not faster everywhere: on an Intel Xeon MKL's GEMM over the row-major
weight multiplies 512 rows about 1.1x faster, on an AMD EPYC it is slower. So when a weight goes into
panels, ``gemm_is_faster`` times both on ``TUNE_ROWS`` rows of its shape, once per shape and process,
and a weight where the GEMM won multiplies ``GEMM_ROWS`` rows or more by its own row-major weight
(``PackedWeight.gemm_rows``): few rows always take the panels.

``pack_linear_weights`` gives each float32 CPU ``nn.Linear`` of a model a packed copy of its weight and
routes every input to it. The copy costs the weights' bytes once more. Its results differ from the
unpacked GEMM's by summation order only (about 1e-6 relative in fp32). A weight changed in place is
packed again before its next use; a forward that needs gradients takes the model's own path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from kvfactory import kernels

BATCH_HINT = 32  # rows oneDNN lays the weight out for; any row count runs on it
PANEL = 32  # output columns per panel of kernels/linear.c's layout
GEMM_ROWS = 128  # rows from which a weight may take the row-major GEMM (``gemm_is_faster``); fewer: panels
TUNE_ROWS = 512  # rows ``gemm_is_faster`` times both on (a prefill chunk's, the engine's default)
TUNE_RUNS = 5  # calls of each it times
TUNE_OUTPUTS = 2048  # at most this many output columns timed (an output embedding's 49,152 would take long)


def packing_available() -> bool:
    """Whether this torch has oneDNN's reordered-weight linear ops."""
    mkldnn = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise") \
        and hasattr(mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered into oneDNN's blocked layout (an opaque ``mkldnn`` tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``packed``, ``pack(weight)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def panels_fit(weight: torch.Tensor) -> bool:
    """Whether ``weight`` goes into panels: float32 on the CPU, a multiple of 32 outputs, torch on one
    thread, and ``kernels/linear.c`` built with its AVX-512 body."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[0] % PANEL \
            or torch.get_num_threads() != 1:
        return False
    lib = kernels.load("linear")
    return lib is not None and bool(lib.linear_has_body())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` as panels ``[out / 32, in, 32]`` for ``panel_linear``."""
    out, inputs = weight.shape
    with torch.no_grad():
        panels = weight.detach().reshape(out // PANEL, PANEL, inputs).transpose(1, 2).contiguous()
    torch._dynamo.mark_static(panels)  # a weight: a compiled graph (dynamic shapes) need not trace its sizes
    return panels


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``panels``, ``pack_panels(weight)`` (``x`` float32)."""
    count, inputs, _ = panels.shape
    rows = x.reshape(-1, inputs).contiguous()
    bias = None if bias is None else bias.contiguous()  # held while the kernel reads it
    out = torch.empty(rows.shape[0], count * PANEL, dtype=x.dtype)
    computed = kernels.load("linear").rows_linear(
        M=rows.shape[0], N=count * PANEL, K=inputs, x=rows.data_ptr(), xs=inputs, w=panels.data_ptr(),
        bias=None if bias is None else bias.data_ptr(), out=out.data_ptr(), os=count * PANEL)
    if not computed:  # no AVX-512 body in this build: ``out`` was never written
        raise RuntimeError("kernels/linear.c has no body on this CPU; pack with pack_weight, which checks")
    return out.reshape(*x.shape[:-1], count * PANEL)


@torch.library.custom_op("kvfactory::panel_linear", mutates_args=())
def panel_linear_op(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``panel_linear`` as a torch custom op: how a compiled graph (``kvfactory.engine.compiled``) calls
    the panel kernel without a break."""
    return panel_linear(x, panels, bias)


@panel_linear_op.register_fake
def _(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], panels.shape[0] * PANEL))


@cache
def gemm_is_faster(outputs: int, inputs: int) -> bool:
    """Whether the row-major GEMM (``F.linear``) multiplies ``TUNE_ROWS`` rows by a random ``[outputs,
    inputs]`` weight (at most ``TUNE_OUTPUTS`` outputs) faster than ``panel_linear``, timed here, once
    per shape: the best of ``TUNE_RUNS`` calls each, the two taking turns after a warm call each, so
    that neither runs in a quieter moment than the other."""
    weight = torch.randn(min(outputs, TUNE_OUTPUTS), inputs)
    x, panels = torch.randn(TUNE_ROWS, inputs), pack_panels(weight)
    calls = (lambda: F.linear(x, weight), lambda: panel_linear(x, panels, None))
    best = [math.inf, math.inf]
    with torch.inference_mode():
        for run in calls:
            run()
        for _ in range(TUNE_RUNS):
            for i, run in enumerate(calls):
                start = time.perf_counter()
                run()
                best[i] = min(best[i], time.perf_counter() - start)
    return best[0] < best[1]


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the layout the engine multiplies by: panels (``pack_panels``) or oneDNN's (``pack``);
    ``gemm_rows``: rows from which the weight's own row-major GEMM is used instead (``gemm_is_faster``),
    None for never."""

    data: torch.Tensor
    panels: bool
    gemm_rows: int | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` in the layout that is fastest for ``x``'s row count."""
        if self.takes_gemm(x):
            return F.linear(x, weight, bias)
        return panel_linear(x, self.data, bias) if self.panels else packed_linear(x, self.data, bias)

    def takes_gemm(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows are many enough for the row-major GEMM (``gemm_rows``). In a graph being
        compiled with dynamic shapes the answer is a guard on the row count: the engine's compiled
        decode step covers fewer rows, its compiled prefill step as many or more, so neither
        recompiles."""
        return self.gemm_rows is not None and x.numel() >= self.gemm_rows * x.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes if self.panels else torch.ops.mkldnn._nbytes(self.data)


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` in panels where ``panels_fit`` says so (with the GEMM for many rows where
    ``gemm_is_faster``), else in oneDNN's layout; None without either."""
    if panels_fit(weight):
        faster = gemm_is_faster(*weight.shape)
        return PackedWeight(pack_panels(weight), True, GEMM_ROWS if faster else None)
    return PackedWeight(pack(weight), False) if packing_available() else None


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose class ``pack_linear_weights`` swapped in place (its parameters, state dict
    keys and tied weights stay the model's), holding its weight packed as well."""

    packed: PackedWeight
    packed_version: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and self.weight.requires_grad) or x.dtype != self.weight.dtype:
            return super().forward(x)  # autograd needs F.linear
        if torch.compiler.is_compiling():  # the graph takes the panels as they are; inductor packs the rest
            packed = self.packed
            if packed.panels and not packed.takes_gemm(x):
                return panel_linear_op(x, packed.data, self.bias)
            return super().forward(x)
        if self.weight._version != self.packed_version:  # trained or loaded since: pack again
            self.packed, self.packed_version = pack_weight(self.weight), self.weight._version
        return self.packed.linear(x, self.weight, self.bias)


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Give every float32 CPU ``nn.Linear`` of ``model`` a packed weight (``PackedLinear``); returns the
    bytes the packed copies take (0 where neither layout is available). Calling it again packs nothing
    more."""
    added = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:  # exactly nn.Linear: subclasses may compute otherwise
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" \
                or (packed := pack_weight(weight)) is None:
            continue
        module.__class__ = PackedLinear
        module.packed, module.packed_version = packed, weight._version
        added += packed.nbytes
    return added
