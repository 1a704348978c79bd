"""``kvfactory oval calibrate``: measure a model's per-layer read-budget profile (``layer_budgets.py``).

The teacher pass of ``kvfactory oval train`` (``train.collect``) runs calibration text through the
frozen model with full attention, one ``context``-token window at a time. At the sampled query
positions every routed layer ranks its pages with the shipped Quest score, and the profile records
the attention mass the top pages hold at each read budget ``u/64``, counted as sparse decode
counts it (the sink and current page always read). Each layer ranks with the Quest bound scale
(of ``SCALES``) whose recall is highest over read budgets 1/16 to 1/4, and the profile keeps that
scale and its curve. Calibrate on text the evaluation never uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvfactory.selectors.layer_budgets import STEPS, LayerProfile, model_shape
from kvfactory.selectors.oval import train

SCALES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0)  # Quest bound scales each layer is tried with
CHOSEN_BY = (4, 16)  # a layer's scale: the best mean recall over read budgets 4/64 .. 16/64


def scale_variants(scales: Iterable[float]) -> list[train.QuestVariant]:
    """What the teacher must record (``collect(variants=...)``) to rank with each of ``scales``."""
    return [train.QuestVariant(scale, "softmax") for scale in sorted(set(scales))]


def recall_curves(chunks: Sequence[train.Chunk], scales: Sequence[float] | None = None) -> torch.Tensor:
    """``[L, STEPS]``: mean mass recall of each layer when reading Quest's best pages at ``u/64``,
    ranked with the shipped Quest or, with ``scales``, layer ``i`` with bound scale ``scales[i]``
    (softmax aggregate, recorded by the teacher as ``Chunk.quest_at``)."""
    total, count = None, 0
    budgets = torch.arange(1, STEPS + 1, dtype=torch.float64) / STEPS
    for chunk in chunks:
        mass = chunk.mass.float()  # [S, L, Hkv, P]
        pages = mass.shape[-1]
        allowed = train.candidates(chunk.current, pages)[:, None, None, :].expand(mass.shape)
        scores = chunk.quest if scales is None else torch.stack(
            [chunk.quest_at[train.QuestVariant(scale, "softmax")][:, i] for i, scale in enumerate(scales)], 1)
        order = scores.float().masked_fill(~allowed, float("-inf")).argsort(-1, descending=True)
        ranked = (mass * allowed).gather(-1, order).cumsum(-1)
        ranked = torch.cat([torch.zeros_like(ranked[..., :1]), ranked], -1)  # [..., k]: the k best pages
        current = chunk.current[:, None, None, None].expand(*mass.shape[:3], 1)
        forced = mass[..., 0] + mass.gather(-1, current)[..., 0]  # the sink and current page
        eligible = allowed[:, 0, 0].sum(-1)  # [S]
        chosen = torch.stack([train.chosen_count(chunk.current, float(b)) for b in budgets], -1)  # [S, STEPS]
        chosen = torch.minimum(chosen, eligible[:, None])
        index = chosen[:, None, None, :].expand(*mass.shape[:3], STEPS)
        recall = forced[..., None] + ranked.gather(-1, index)  # [S, L, Hkv, STEPS]
        summed = recall.sum((0, 2))
        total = summed if total is None else total + summed
        count += mass.shape[0] * mass.shape[2]
    if total is None:
        raise ValueError("no calibration windows: give at least one text of --context tokens")
    return total / count


def best_scales(chunks: Sequence[train.Chunk], scales: Sequence[float] = SCALES
                ) -> tuple[list[float], torch.Tensor]:
    """Each layer's best of ``scales`` (``CHOSEN_BY``) and its recall curves ``[L, STEPS]``; the
    teacher must have recorded every scale (``collect(variants=...)``)."""
    layers = chunks[0].mass.shape[1]
    curves = torch.stack([recall_curves(chunks, [scale] * layers) for scale in scales])  # [V, L, STEPS]
    pick = curves[..., CHOSEN_BY[0] - 1:CHOSEN_BY[1]].mean(-1).argmax(0)  # [L]
    return [scales[i] for i in pick.tolist()], curves[pick, torch.arange(layers)]


def calibrate(model: Any, tokenizer: Any, texts: Sequence[str], name: str, layers: Sequence[int],
              context: int = 6144, windows: int = 4, positions: int = 48, text_names: Sequence[str] = (),
              advance: Callable[[], None] = lambda: None) -> LayerProfile:
    """The profile of ``layers`` from up to ``windows`` windows of ``context`` tokens of ``texts``
    (``text_names``: what to record as their source)."""
    ids = train.cap(train.tokens_of(tokenizer, texts), windows, context)
    if ids.numel() < context:
        raise ValueError(f"the calibration text has {ids.numel()} tokens, fewer than one window of {context}")
    chunks = train.collect(model, ids, layers, positions, context, seed=0, advance=advance,
                           variants=scale_variants(SCALES))
    scales, curves = best_scales(chunks)
    return LayerProfile(name, model_shape(model.config), tuple(layers),
                        tuple(tuple(round(float(v), 6) for v in row) for row in curves),
                        {"texts": list(text_names), "context": context, "windows": len(chunks),
                         "positions": positions, "tokens": ids.numel(), "scales_tried": list(SCALES)},
                        tuple(scales))
