"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling").

Lower layers spread attention widely, upper layers focus it: SnapKV's scores with a budget that
falls linearly with depth, from ``2 * kept - kept / beta`` at the first layer to ``kept / beta`` at
the last, averaging the cache-wide target; the budget shape follows the paper's reference code.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfactory.eviction.base import check_positive
from kvfactory.eviction.snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV scores, budgets decreasing with depth."""

    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("beta", self.beta)

    def layer_budget(self, kept: int, stored: int, layer_idx: int, num_layers: int) -> int:
        window = self.window_size
        low = kept / self.beta
        high = 2 * kept - low
        if high >= stored - window:
            high = stored - window
            low = 2 * kept - high
        if not stored >= high >= low >= window:
            return kept  # too short to shape: every layer keeps the target
        steps = (high - low) / max(num_layers - 1, 1)
        return round(high - layer_idx * steps)
