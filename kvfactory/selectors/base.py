"""The selector interface: score a layer's pages for one decode step, read the best.

A selector is a dataclass whose fields are its hyperparameters. ``page_scores`` sees the step's
queries grouped by KV head and the layer's page bases (``kvfactory.selectors.pages``) and returns
one score per page and KV head, higher = read; ``kvfactory.selectors.sparse.SparseStore`` always
adds the sink and local pages and reads the top-scoring rest up to the read budget.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfactory.selectors.pages import PageBases


@dataclass
class Selector(ABC):
    """Scores pages of one layer; one instance per layer store."""

    reads_all: ClassVar[bool] = False  # True: decode reads every page whatever the budget
    reads_bases: ClassVar[bool] = True  # scoring reads the page bases (counted in the bytes read)

    @abstractmethod
    def page_scores(self, queries: torch.Tensor, bases: PageBases) -> torch.Tensor:
        """``queries [B, Hkv, R, D]`` (the query heads of each KV head, after RoPE) against the
        ``bases.pages`` stored pages: ``[B, Hkv, pages]`` scores, higher = read."""
