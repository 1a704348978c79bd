"""OVAL's query-aware scorer: each step's own query against learned low-rank codes of every stored key.

Per routed layer a learned projection maps each key, as it is stored, to ``rank`` (4) numbers kept
as int8 codes with a fixed scale per channel: 4 bytes per token and KV head, a quarter of what
Quest's page bounds cost (two float16 vectors of ``head_dim`` per 16-token page). A decode step
projects its query with the layer's learned query projection (one per query head), scores every
stored token from the codes, takes each query head's softmax, averages a KV head's query heads and
sums the shares per page: an estimate of the attention mass each page will get, which the sparse
reader ranks (``kvfactory.selectors.sparse``). The projections are distilled from full attention's
page mass (``train.py``), the family of Loki (Singhania et al., 2024: keys are low-rank), Double
Sparsity (Yang et al., 2024: a few channels estimate the attention) and ShadowKV (Sun et al.,
2024: a small per-chunk summary chooses what to read); here the low-rank basis is learned from the
attention it must rank, not from the keys' variance alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfactory import kernels
from kvfactory.selectors.oval.basis import principal_key_directions
from kvfactory.selectors.oval.files import RouterModule, layer_index

CODE_LIMIT = 127  # int8 codes in [-127, 127]
SCALE_QUANTILE = 0.999  # a channel's code scale covers this quantile of its training values


@dataclass(frozen=True)
class LowRankShape:
    """The architecture a scorer file was trained for."""

    query_heads: int
    kv_heads: int
    head_dim: int
    layers: tuple[int, ...]  # model layers it scores (the sparse ones)
    rank: int = 4
    model: str = ""  # what it was trained on (informational)

    def index_of(self, layer_idx: int) -> int:
        return layer_index(self.layers, layer_idx)


class LowRankScorer(RouterModule):
    """Learned query and key projections per routed layer (see the module docstring)."""

    shape_type = LowRankShape
    kind = "query"
    encodes_keys = True

    def __init__(self, shape: LowRankShape) -> None:
        super().__init__(shape)
        layers, d, r = len(shape.layers), shape.head_dim, shape.rank
        self.query = torch.nn.Parameter(torch.zeros(layers, shape.query_heads, d, r))
        self.key = torch.nn.Parameter(torch.zeros(layers, shape.kv_heads, d, r))
        self.register_buffer("code_scale", torch.ones(layers, shape.kv_heads, r))

    @property
    def group(self) -> int:
        return self.shape.query_heads // self.shape.kv_heads

    def init_from_keys(self, keys: torch.Tensor) -> None:
        """Start from each layer's and KV head's principal key directions (Loki's training-free basis):
        ``keys [layers, Hkv, T, D]``, both projections."""
        basis = principal_key_directions(keys, self.shape.rank)
        with torch.no_grad():
            self.key.copy_(basis)
            self.query.copy_(basis.repeat_interleave(self.group, 1))

    def fit_code_scales(self, keys: torch.Tensor) -> None:
        """Per layer, KV head and channel, the scale whose codes cover ``SCALE_QUANTILE`` of the
        projected training ``keys [layers, Hkv, T, D]``."""
        projected = (keys.float() @ self.key.detach()).abs()  # [layers, Hkv, T, r]
        top = projected.transpose(2, 3).flatten(0, 2).quantile(SCALE_QUANTILE, dim=-1)
        self.code_scale.copy_(top.view_as(self.code_scale).clamp(min=1e-6) / CODE_LIMIT)

    def encode(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        """``keys [B, Hkv, n, D]`` of model layer ``layer`` -> int8 codes ``[B, Hkv, n, rank]``."""
        at = self.shape.index_of(layer)
        codes = (keys.to(self.key.dtype) @ self.key[at]) / self.code_scale[at, :, None]
        return codes.round_().clamp_(-CODE_LIMIT, CODE_LIMIT).to(torch.int8)

    def token_logits(self, queries: torch.Tensor, keys: torch.Tensor, layer: int) -> torch.Tensor:
        """``queries [B, Hkv, G, q, D]`` (a KV head's query heads) against projected ``keys [B, Hkv, T,
        rank]`` (codes as floats, or float projections when training): ``[B, Hkv, G, q, T]``."""
        at = self.shape.index_of(layer)
        projection = self.query[at].view(self.shape.kv_heads, self.group, *self.query.shape[2:])
        projected = torch.einsum("bhgqd,hgdr->bhgqr", queries.to(projection.dtype), projection)
        return projected.flatten(2, 3).matmul(keys.transpose(-1, -2)).view(*projected.shape[:4], -1)

    def scaled_queries(self, queries: torch.Tensor, layer: int) -> torch.Tensor:
        """``queries [B, Hkv, R, D]`` (R = the KV head's query heads x new tokens, head-major) projected
        by their heads' projections, with the code scales folded in: ``[B, Hkv, R, rank]`` float32, what
        scores the int8 codes directly."""
        b, h, rows, d = queries.shape
        at = self.shape.index_of(layer)
        projection = self.query[at].view(h, self.group, d, -1)
        projected = torch.einsum("bhgqd,hgdr->bhgqr", queries.view(b, h, self.group, rows // self.group, d)
                                 .to(projection.dtype), projection)
        return (projected * self.code_scale[at, :, None, None]).flatten(2, 3).float()

    def page_shares(self, queries: torch.Tensor, codes: torch.Tensor, layer: int, page_size: int
                    ) -> torch.Tensor:
        """Each page's estimated attention share ``[B, Hkv, pages]`` in torch (differentiable in the
        query projection): every query head's softmax over the stored tokens' codes ``[B, Hkv, rank,
        T]``, averaged, summed per page."""
        shares = (self.scaled_queries(queries, layer) @ codes.float()).softmax(-1).mean(2)  # [B, Hkv, T]
        b, h, tokens = shares.shape
        pages = math.ceil(tokens / page_size)
        return F.pad(shares, (0, pages * page_size - tokens)).view(b, h, pages, page_size).sum(-1)

    @torch.no_grad()
    def page_log_mass(self, queries: torch.Tensor, codes: torch.Tensor, layer: int, page_size: int
                      ) -> torch.Tensor:
        """The log of each page's estimated attention share, ``[B, Hkv, pages]``, for ``queries [B, Hkv,
        R, D]`` over the channel-major ``codes [B, Hkv, rank, T]`` (``PageSummaries.codes``), as
        ``page_shares``; on the CPU one C kernel call (``kernels/pages.c``)."""
        lib = kernels.load("pages") if codes.device.type == "cpu" else None
        if lib is None or codes.stride(-1) != 1:
            shares = self.page_shares(queries, codes, layer, page_size)
            return shares.clamp_(min=torch.finfo(torch.float32).tiny).log_()
        b, h, rows, _ = queries.shape
        scaled = self.scaled_queries(queries, layer).contiguous()
        tokens = codes.shape[-1]
        out = torch.empty((b, h, math.ceil(tokens / page_size)), dtype=torch.float32)
        if lib.token_shares(b, h, rows, codes.shape[2], tokens, page_size, scaled.data_ptr(),
                            codes.data_ptr(), *codes.stride()[:3], out.data_ptr()):
            raise MemoryError(f"token_shares: no memory for {rows} x {tokens} scores")
        return out
