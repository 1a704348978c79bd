"""Weights prepacked for the engine's steps: the one place kvfactory uses oneDNN's blocked GEMM layout.

A decode step multiplies a few rows (one per sequence) by every weight matrix, so it is bound by
reading the weights; a prefill chunk multiplies hundreds, so it is bound by the arithmetic. On one
thread, MKL's single-precision GEMM over a row-major ``nn.Linear`` weight reaches neither bound for
few rows, and on AMD CPUs falls short for many rows too. oneDNN's inner product over a weight
reordered once into its blocked layout (``torch.ops.mkldnn``, the layout torch's inductor packs
weights into; vLLM's CPU build runs the same library) reads and multiplies faster at every row count
``benchmarks/linear_layouts.py`` measures. ``pack_linear_weights`` gives each float32 CPU
``nn.Linear`` of a model a reordered copy of its weight and routes every input to it.

The copy costs the weights' bytes once more. Its results differ from the unpacked GEMM's by
summation order only (about 1e-6 relative in fp32). A weight changed in place is reordered again
before its next use; a forward that needs gradients takes the model's own path.
"""

from __future__ import annotations

import torch

BATCH_HINT = 32  # rows oneDNN lays the weight out for; any row count runs on it


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


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose class ``pack_linear_weights`` swapped in place (its parameters, state dict
    keys and tied weights stay the model's), holding its weight packed as well."""

    packed: torch.Tensor
    packed_version: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(x)  # compiled graphs pack frozen weights; autograd needs F.linear
        if self.weight._version != self.packed_version:  # trained or loaded since: pack again
            self.packed, self.packed_version = pack(self.weight), self.weight._version
        return packed_linear(x, self.packed, self.bias)


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Give every float32 CPU ``nn.Linear`` of ``model`` a packed weight (``PackedLinear``); returns the
    bytes the packed copies take (0 where oneDNN's ops are missing). Calling it again packs nothing
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
        added += torch.ops.mkldnn._nbytes(module.packed)
    return added
