"""OVAL's block gate: the step's queries of a KV head, pooled, against a learned embedding of each page.

In the spirit of SeerAttention (Gao et al., 2024, "SeerAttention: Learning Intrinsic Sparse Attention
in Your LLMs") and SeerAttention-R (2025): per routed layer and KV head, a page's key maximum, minimum
and mean per channel (``3 * head_dim`` numbers) go through a learned projection to ``dim`` (32)
numbers, kept as float16 with the page summaries (64 bytes per page and KV head, what the query
scorer's int8 codes take); a decode step joins the query heads that share the KV head (GQA) into
one gate query by a learned projection of their concatenation, and a page's logit is that query
dotted with the page's embedding. The projections are distilled from the frozen model's own page
attention (``train.py``), with the model's weights untouched; they start from each layer's
principal key directions applied to the page mean (a training-free, Loki-like gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfactory.selectors.oval.basis import principal_key_directions
from kvfactory.selectors.oval.files import RouterModule, layer_index
from kvfactory.selectors.pages import best_dot


@dataclass(frozen=True)
class GateShape:
    """The architecture a gate file was trained for."""

    query_heads: int
    kv_heads: int
    head_dim: int
    layers: tuple[int, ...]  # model layers it gates (the sparse ones)
    dim: int = 32  # numbers per page embedding
    model: str = ""  # what it was trained on (informational)

    def index_of(self, layer_idx: int) -> int:
        return layer_index(self.layers, layer_idx)


class BlockGate(RouterModule):
    """Learned page and pooled-query projections per gated layer (see the module docstring)."""

    shape_type = GateShape
    kind = "gate"
    embeds_pages = True

    def __init__(self, shape: GateShape) -> None:
        super().__init__(shape)
        layers, d, e = len(shape.layers), shape.head_dim, shape.dim
        self.page = torch.nn.Parameter(torch.zeros(layers, shape.kv_heads, 3 * d, e))
        self.query = torch.nn.Parameter(torch.zeros(layers, shape.kv_heads, self.group * d, e))
        # each gated layer's query projection over sqrt(dim) in float32, for decode steps (``_scaled_query``)
        self._scaled: dict[int, tuple[tuple[int, int, int], torch.Tensor]] = {}

    @property
    def group(self) -> int:
        return self.shape.query_heads // self.shape.kv_heads

    def init_from_keys(self, keys: torch.Tensor) -> None:
        """Start from each layer's and KV head's ``dim`` principal key directions: pages embedded by
        their mean key in that basis, each query head projected alike and averaged (``keys [layers,
        Hkv, T, D]``)."""
        d = self.shape.head_dim
        e = min(d, self.shape.dim)  # channels beyond head_dim start small and random
        basis = principal_key_directions(keys, e)  # [L, Hkv, D, e]
        with torch.no_grad():
            self.page.normal_(std=1e-3)
            self.query.normal_(std=1e-3)
            self.page[:, :, 2 * d:, :e] = basis
            self.query[..., :e] = basis.repeat(1, 1, self.group, 1) / self.group

    def embed_pages(self, features: torch.Tensor, layer: int) -> torch.Tensor:
        """Page features ``[B, Hkv, n, 3 * head_dim]`` of model layer ``layer`` -> ``[B, Hkv, n, dim]``."""
        page = self.page[self.shape.index_of(layer)]
        return features.to(page.dtype) @ page  # [Hkv, 3D, E] broadcast over the batch

    def gate_queries(self, queries: torch.Tensor, layer: int) -> torch.Tensor:
        """``queries [B, Hkv, R, D]`` (R = the KV head's query heads x new tokens, head-major) -> one gate
        query per new token, ``[B, Hkv, new, dim]``."""
        projection = self.query[self.shape.index_of(layer)]
        return self._joined(queries).to(projection.dtype) @ projection

    def _joined(self, queries: torch.Tensor) -> torch.Tensor:
        """``queries [B, Hkv, R, D]`` -> each new token's query heads side by side,
        ``[B, Hkv, new, R / new * D]``."""
        b, h, rows, d = queries.shape
        if rows == self.group:  # one new token (a decode step): its heads are side by side already
            return queries.reshape(b, h, 1, rows * d)
        return queries.view(b, h, self.group, rows // self.group, d).transpose(2, 3).flatten(3)

    def _scaled_query(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s query projection over sqrt(dim), float32, detached: made again whenever the
        weights change (an optimiser's in-place step counts a new version; a copy of this module, or
        new storage, has other weights), so a decode step's scoring is one product."""
        weights = self.query
        state = (id(weights), weights._version, weights.data_ptr())
        kept = self._scaled.get(layer)
        if kept is None or kept[0] != state:
            scaled = weights.detach()[self.shape.index_of(layer)].float() / math.sqrt(self.shape.dim)
            kept = self._scaled[layer] = (state, scaled)
        return kept[1]

    def page_logits(self, queries: torch.Tensor, embedded: torch.Tensor, layer: int) -> torch.Tensor:
        """``[B, Hkv, pages]``: the best new token's logit of each page, from ``queries [B, Hkv, R, D]``
        and the pages' ``embedded [B, Hkv, pages, dim]``."""
        gate = self.gate_queries(queries, layer).float() / math.sqrt(self.shape.dim)
        return (gate @ embedded.float().transpose(-1, -2)).amax(2)

    def score_pages(self, queries: torch.Tensor, embedded: torch.Tensor, layer: int) -> torch.Tensor:
        """``page_logits`` for a decode step, through ``best_dot`` (``kernels/pages.c`` on the CPU: the
        stored float16 embeddings read in place, no float copy); the weights are taken detached, so it
        records no graph."""
        return best_dot(self._joined(queries).float() @ self._scaled_query(layer), embedded)
