"""``kvfactory oval calibrate``: measure a model's per-layer read-budget profile (``layer_budgets.py``).

The teacher pass of ``kvfactory oval train`` (``train.collect``) runs calibration text through the
frozen model with full attention, one ``context``-token window at a time. At the sampled query
positions every routed layer ranks its pages with the shipped Quest score, and the profile records
the attention mass the top pages hold at each read budget ``u/64``, counted as sparse decode
counts it (the sink and current page always read). A first pass finds each layer's query axes
(``train.query_axes``); each layer then ranks with the Quest bound scale (of ``SCALES``) whose
recall is highest over read budgets 1/16 to 1/4, with its bounds kept in the key channels or, where
that raises its recall by ``ROTATION_GAIN``, along those axes; the profile keeps that choice (the
rotation: the axes, or the identity) and its curve.
Calibrate on text the evaluation never uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvfactory.selectors.layer_budgets import STEPS, LayerProfile, model_shape
from kvfactory.selectors.oval import train
from kvfactory.selectors.quest import QuestSelector

SCALES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0)  # Quest bound scales each layer is tried with
CHOSEN_BY = (4, 16)  # a layer's scale: the best mean recall over read budgets 4/64 .. 16/64
# a layer's bounds go along its query axes only where that raises its recall this much: in SmolLM2
# the axes gain 0.015 to 0.07 in layers 5 to 8 and under 0.007 elsewhere, and rotating every layer
# that gained at all lost 4 of 25 needles in the harness (retrieval queries are not the typical ones)
ROTATION_GAIN = 0.01


def scale_variants(scales: Iterable[float], rotated: Iterable[bool] = (False, True)
                   ) -> list[train.QuestVariant]:
    """What the teacher must record (``collect(variants=...)``) to rank with each of ``scales``, in the
    key channels and (``rotated``) in the key rotation ``collect`` is given."""
    return [train.QuestVariant(scale, "softmax", rotated=turn)
            for turn in rotated for scale in sorted(set(scales))]


def profiled_variants(profile: LayerProfile) -> list[train.QuestVariant]:
    """The Quest ranking each layer of ``profile`` runs with (rotated: ``collect`` is to be given its
    ``key_rotations``)."""
    scales = profile.bound_scales or (QuestSelector.bound_scale,) * len(profile.layers)
    rotated = profile.key_rotations is not None
    return [train.QuestVariant(scale, "softmax", rotated=rotated) for scale in scales]


def recall_curves(chunks: Sequence[train.Chunk], variants: Sequence[train.QuestVariant] | None = None
                  ) -> torch.Tensor:
    """``[L, STEPS]``: mean mass recall of each layer when reading Quest's best pages at ``u/64``,
    ranked with the shipped Quest or, with ``variants``, layer ``i`` with ``variants[i]`` (recorded by
    the teacher as ``Chunk.quest_at``)."""
    total, count = None, 0
    budgets = torch.arange(1, STEPS + 1, dtype=torch.float64) / STEPS
    for chunk in chunks:
        mass = chunk.mass.float()  # [S, L, Hkv, P]
        pages = mass.shape[-1]
        allowed = train.candidates(chunk.current, pages)[:, None, None, :].expand(mass.shape)
        scores = chunk.quest if variants is None else torch.stack(
            [chunk.quest_at[variant][:, i] for i, variant in enumerate(variants)], 1)
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


def best_variants(chunks: Sequence[train.Chunk], variants: Sequence[train.QuestVariant]
                  ) -> tuple[list[train.QuestVariant], torch.Tensor]:
    """Each layer's best of ``variants`` (``CHOSEN_BY``) and its recall curves ``[L, STEPS]``; the
    teacher must have recorded every variant (``collect(variants=...)``)."""
    layers = chunks[0].mass.shape[1]
    curves = torch.stack([recall_curves(chunks, [v] * layers) for v in variants])  # [V, L, STEPS]
    pick = chosen_by(curves).argmax(0)  # [L]
    return [variants[i] for i in pick.tolist()], curves[pick, torch.arange(layers)]


def chosen_by(curves: torch.Tensor) -> torch.Tensor:
    """``[..., L]``: what a layer's ranking is chosen by, its mean recall over budgets ``CHOSEN_BY``."""
    return curves[..., CHOSEN_BY[0] - 1:CHOSEN_BY[1]].mean(-1)


def calibrate(model: Any, ids: torch.Tensor, name: str, layers: Sequence[int], context: int = 6144,
              windows: int = 4, positions: int = 48, text_names: Sequence[str] = (),
              advance: Callable[[], None] = lambda: None) -> LayerProfile:
    """The profile of ``layers`` from up to ``windows`` windows of ``context`` tokens of ``ids`` (1-D,
    ``text_names``: what to record as their source); ``advance`` is called twice per window."""
    ids = train.cap(ids, windows, context)
    if ids.numel() < context:
        raise ValueError(f"the calibration text has {ids.numel()} tokens, fewer than one window of {context}")
    axes = train.query_axes(model, ids, layers, context, advance)
    variants = scale_variants(SCALES)
    chunks = train.collect(model, ids, layers, positions, context, seed=0, advance=advance,
                           variants=variants, rotations=axes)
    chosen, curves = best_variants(chunks, [v for v in variants if not v.rotated])
    turned, turned_curves = best_variants(chunks, [v for v in variants if v.rotated])
    gain = chosen_by(turned_curves) - chosen_by(curves)
    for i in torch.nonzero(gain >= ROTATION_GAIN).flatten().tolist():
        chosen[i], curves[i] = turned[i], turned_curves[i]
    identity = torch.eye(axes.shape[-1]).expand_as(axes[0])
    rotations = torch.stack([axes[i] if v.rotated else identity for i, v in enumerate(chosen)])
    rotated = [layer for layer, variant in zip(layers, chosen, strict=True) if variant.rotated]
    return LayerProfile(name, model_shape(model.config), tuple(layers),
                        tuple(tuple(round(float(v), 6) for v in row) for row in curves),
                        {"texts": list(text_names), "context": context, "windows": len(chunks),
                         "positions": positions, "tokens": ids.numel(), "scales_tried": list(SCALES),
                         "rotated_layers": rotated},
                        tuple(v.scale for v in chosen), rotations)
