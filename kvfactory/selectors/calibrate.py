"""``kvfactory selectors calibrate``: measure a model's per-layer read-budget profile (``layer_budgets.py``).

The teacher pass (``teacher.collect``) runs calibration text through the frozen model with full
attention, one ``context``-token window at a time. At the sampled query positions every routed
layer ranks its pages with Quest's bound, and the profile records the attention mass the top pages
hold at each read budget ``u/64``, counted as sparse decode counts it (the sink and current page
always read). Calibrate on text the evaluation never uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfactory.selectors import teacher
from kvfactory.selectors.layer_budgets import STEPS, LayerProfile, model_shape


def recall_curves(chunks: Sequence[teacher.Chunk]) -> torch.Tensor:
    """``[L, STEPS]``: mean mass recall of each layer when reading the best pages by ``Chunk.quest``
    (the teacher's Quest score) at ``u/64``."""
    total, count = None, 0
    budgets = torch.arange(1, STEPS + 1, dtype=torch.float64) / STEPS
    for chunk in chunks:
        mass = chunk.mass.float()  # [S, L, Hkv, P]
        pages = mass.shape[-1]
        allowed = teacher.candidates(chunk.current, pages)[:, None, None, :].expand(mass.shape)
        order = chunk.quest.float().masked_fill(~allowed, float("-inf")).argsort(-1, descending=True)
        ranked = (mass * allowed).gather(-1, order).cumsum(-1)
        ranked = torch.cat([torch.zeros_like(ranked[..., :1]), ranked], -1)  # [..., k]: the k best pages
        current = chunk.current[:, None, None, None].expand(*mass.shape[:3], 1)
        forced = mass[..., 0] + mass.gather(-1, current)[..., 0]  # the sink and current page
        eligible = allowed[:, 0, 0].sum(-1)  # [S]
        chosen = torch.stack([teacher.chosen_count(chunk.current, float(b)) for b in budgets], -1)  # [S, 64]
        chosen = torch.minimum(chosen, eligible[:, None])
        index = chosen[:, None, None, :].expand(*mass.shape[:3], STEPS)
        recall = forced[..., None] + ranked.gather(-1, index)  # [S, L, Hkv, STEPS]
        summed = recall.sum((0, 2))
        total = summed if total is None else total + summed
        count += mass.shape[0] * mass.shape[2]
    if total is None:
        raise ValueError("no calibration windows: give at least one text of --context tokens")
    return total / count


def calibrate(model: Any, tokenizer: Any, texts: Sequence[str], name: str, layers: Sequence[int],
              context: int = 6144, windows: int = 4, positions: int = 48, text_names: Sequence[str] = (),
              advance: Callable[[], None] = lambda: None) -> LayerProfile:
    """The profile of ``layers`` from up to ``windows`` windows of ``context`` tokens of ``texts``
    (``text_names``: what to record as their source)."""
    ids = teacher.cap(teacher.tokens_of(tokenizer, texts), windows, context)
    if ids.numel() < context:
        raise ValueError(f"the calibration text has {ids.numel()} tokens, fewer than one window of {context}")
    chunks = teacher.collect(model, ids, layers, positions, context, seed=0, advance=advance)
    curves = recall_curves(chunks)
    return LayerProfile(name, model_shape(model.config), tuple(layers),
                        tuple(tuple(round(float(v), 6) for v in row) for row in curves),
                        {"texts": list(text_names), "context": context, "windows": len(chunks),
                         "positions": positions, "tokens": ids.numel()})
