"""Weights prepacked for the engine's decode steps: the one place kvfactory uses MKL's packed GEMM.

A decode step multiplies a few rows (one per sequence) by every weight matrix, so it is bound by
reading the weights. MKL's single-precision GEMM reads a row-major ``nn.Linear`` weight at about
half the machine's read rate for 4 to 32 rows, and at that rate in its packed layout
(``cblas_sgemm_pack``, the layout torch's inductor prepacks weights into when it freezes a graph);
``benchmarks/linear_layouts.py`` measures both. ``pack_linear_weights`` gives each float32 CPU
``nn.Linear`` of a model a packed copy of its weight and routes inputs of ``PACKED_ROWS`` rows to it;
other row counts (prefill chunks, one sequence) take the model's own path, which is faster there.

The packed copy costs the weights' bytes once more. Its results differ from the unpacked GEMM's by
summation order only (about 1e-5 relative in fp32). A weight changed in place is packed again before
its next use. The ops are torch's internal ``torch.ops.mkl``; without them nothing is packed.
"""

from __future__ import annotations

import torch

PACKED_ROWS = range(4, 33)  # rows for which the packed GEMM reads faster (benchmarks/linear_layouts.py)


def packing_available() -> bool:
    """Whether this torch has MKL's packed GEMM ops."""
    mkl = torch.ops.mkl
    return torch.backends.mkl.is_available() and hasattr(mkl, "_mkl_linear") \
        and hasattr(mkl, "_mkl_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in MKL's packed layout (the same for any number of rows)."""
    with torch.no_grad():
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACKED_ROWS.stop - 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed copy of ``weight``."""
    rows = x.numel() // x.shape[-1]
    out = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), packed, weight, bias, rows)
    return out.view(*x.shape[:-1], out.shape[-1])


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose class ``pack_linear_weights`` swapped in place (its parameters, state dict
    keys and tied weights stay the model's), holding its weight packed as well."""

    packed: torch.Tensor
    packed_version: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled graph packs its frozen weights itself
            return super().forward(x)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows not in PACKED_ROWS or (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(x)
        if self.weight._version != self.packed_version:  # trained or loaded since: pack again
            self.packed, self.packed_version = pack(self.weight), self.weight._version
        return packed_linear(x, self.packed, self.weight, self.bias)


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Give every float32 CPU ``nn.Linear`` of ``model`` a packed weight (``PackedLinear``); returns the
    bytes the packed copies take (0 where MKL's packed GEMM is missing). Calling it again packs nothing
    more."""
    if not packing_available():
        return 0
    added = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:  # exactly nn.Linear: subclasses may compute otherwise
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        module.__class__ = PackedLinear
        module.packed, module.packed_version = pack(weight), weight._version
        added += module.packed.nbytes
    return added
