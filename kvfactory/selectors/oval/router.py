"""OVAL's router: which pages the next decode step needs, predicted from the decoder's own state.

OVAL's router: from the decoder's last hidden state of the
previous step, a small MLP (``width`` 64, its second layer a base plus a LoRA of rank 4, a learnable
temperature) produces a routing query per layer group and KV head; a page's logit is that query
dotted with the page's embedding (a learned projection of its summary: key maximum, minimum and mean
per channel) plus a positional decay ``exp(-Δpages / 32)`` from the current page. Scores are
content-based, so they generalise across sequences (logits over fixed page ids would not),
and inference takes a deterministic top-k.

Training applies the projection to the query side (``key_vectors``: one vector per layer group and
KV head in the page-summary space) and scores raw page features; inference applies it to the pages
as they fill (``embed_pages``, kept by the page summaries), so each decode step reads ``dim`` (32)
numbers per page instead of ``3 * head_dim`` (192). Weights and the architecture live in one
safetensors file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvfactory.selectors.oval.files import RouterModule, layer_index, load_module
from kvfactory.selectors.pages import best_dot

DECAY_PAGES = 32.0


@dataclass(frozen=True)
class RouterShape:
    """The architecture a router file was trained for."""

    hidden_size: int
    kv_heads: int
    head_dim: int
    layers: tuple[int, ...]  # model layers it routes (the sparse ones)
    group_size: int = 4  # layers sharing one routing query
    width: int = 64
    dim: int = 32  # routing query size
    rank: int = 4  # LoRA rank on the second layer
    model: str = ""  # what it was trained on (informational)

    @property
    def groups(self) -> int:
        return math.ceil(len(self.layers) / self.group_size)

    def index_of(self, layer_idx: int) -> int:
        return layer_index(self.layers, layer_idx)

    def group_of(self, layer_idx: int) -> int:
        return self.index_of(layer_idx) // self.group_size


class Router(RouterModule):
    """The OVAL router (see the module docstring)."""

    shape_type = RouterShape
    kind = "prefetch"
    embeds_pages = True

    def __init__(self, shape: RouterShape) -> None:
        super().__init__(shape)
        out = shape.groups * shape.kv_heads * shape.dim
        self.inp = torch.nn.Linear(shape.hidden_size, shape.width)
        self.out = torch.nn.Linear(shape.width, out)  # the base, frozen when only the LoRA adapts
        self.lora_a = torch.nn.Parameter(torch.randn(shape.rank, shape.width) / shape.width)
        self.lora_b = torch.nn.Parameter(torch.zeros(out, shape.rank))
        features = 3 * shape.head_dim
        self.page = torch.nn.Parameter(torch.randn(shape.groups, shape.kv_heads, shape.dim, features)
                                       / math.sqrt(features))
        self.log_temperature = torch.nn.Parameter(torch.zeros(()))
        self.decay = torch.nn.Parameter(torch.zeros(()))

    def routing_queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size]`` -> ``[N, groups, kv_heads, dim]``: the routing queries, over the
        temperature; a page's logit is one dotted with the page's embedding (``embed_pages``)."""
        s = self.shape
        x = F.gelu(self.inp(hidden.to(self.inp.weight.dtype)))
        query = self.out(x) + (x @ self.lora_a.T) @ self.lora_b.T
        return query.view(-1, s.groups, s.kv_heads, s.dim) / self.log_temperature.exp()

    def key_vectors(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size]`` -> ``[N, groups, kv_heads, 3 * head_dim]``: each routing query
        through its group's page projection (training scores raw page features with these)."""
        return torch.einsum("nghr,ghrf->nghf", self.routing_queries(hidden), self.page)

    def embed_pages(self, features: torch.Tensor, layer: int) -> torch.Tensor:
        """Page features ``[B, Hkv, n, 3 * head_dim]`` of model layer ``layer`` through its group's
        projection: ``[B, Hkv, n, dim]``, so that inference reads ``dim`` numbers per page instead of
        ``3 * head_dim``."""
        page = self.page[self.shape.group_of(layer)]
        return torch.einsum("bhpf,hrf->bhpr", features.to(self.page.dtype), page)

    def decay_bonus(self, distance: torch.Tensor) -> torch.Tensor:
        """The positional term of pages ``distance`` pages behind the current one."""
        return self.decay * torch.exp(-distance.clamp(min=0) / DECAY_PAGES)

    def positional(self, pages: int, device: torch.device) -> torch.Tensor:
        """The decay term ``[pages]`` of each page when the last one is being written."""
        return self.decay_bonus(torch.arange(pages - 1, -1, -1, device=device, dtype=self.decay.dtype))

    def logits(self, vectors: torch.Tensor, features: torch.Tensor, positional: torch.Tensor | None
               ) -> torch.Tensor:
        """Page logits ``[B, Hkv, pages]`` from one group's ``vectors [B, Hkv, F]`` and the pages'
        ``features [B, Hkv, pages, F]`` (routing queries with page embeddings, or key vectors with raw
        features), plus the ``positional`` term (None: the decay ablated)."""
        scores = best_dot(vectors[..., None, :], features)
        return scores if positional is None else scores + positional.to(scores.dtype)

    @classmethod
    def load(cls, path: str | Path) -> Router:
        return load_module(path, cls)
