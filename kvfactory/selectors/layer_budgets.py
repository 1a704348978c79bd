"""Per-layer read budgets: the layers whose attention spreads widest read more of their pages.

A trained model concentrates attention in some layers and spreads it in others, so one read budget
for every layer over-serves the first and starves the second. A ``LayerProfile`` holds, for each
routed layer, the attention-mass recall page selection reaches there at read budgets ``u/64``
(u = 1..64), measured once by a teacher pass on calibration text (``kvfactory selectors calibrate``,
``calibrate.py``). ``allocate`` splits a mean read budget between the layers so that the
mean recall is highest (an exact knapsack over the 64 steps); a decode step reads as many pages
in all as with one budget for every layer, and every layer at least 1/64 of its pages (no floor:
a floor of 3/4 of the budget read less on held-out books, ``docs/sparse-reads.md``). PyramidKV
(Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling") sizes per-layer caches by a fixed pyramid; this sizes per-layer reads, fitted to the
model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvfactory.errors import ConfigError

STEPS = 64  # budgets measured: 1/64, 2/64, ..., 1
EMBEDDED_PROFILE = "smollm2_layer_budgets.json"
SHAPE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size")


def model_shape(model_config: Any) -> dict[str, Any]:
    """What a profile must match: the decoder's architecture and sizes."""
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") \
        else model_config
    return {key: getattr(text, key, None) for key in SHAPE_KEYS}


def embedded_profile_path() -> Path:
    return Path(str(resources.files("kvfactory.selectors").joinpath(EMBEDDED_PROFILE)))


@dataclass(frozen=True)
class LayerProfile:
    """``recall[i][u - 1]``: mean attention-mass recall of layer ``layers[i]`` at read budget ``u/64``."""

    model: str
    shape: dict[str, Any]
    layers: tuple[int, ...]
    recall: tuple[tuple[float, ...], ...]
    source: dict[str, Any]  # how it was measured (text, context, positions)

    def __post_init__(self) -> None:
        if len(self.recall) != len(self.layers) or any(len(row) != STEPS for row in self.recall):
            raise ValueError(f"a profile needs {STEPS} recall values for each of its {len(self.layers)} "
                             f"layers, got {[len(row) for row in self.recall]}")

    def matches(self, model_config: Any) -> bool:
        return model_shape(model_config) == self.shape

    def mean_recall(self, budgets: dict[int, float]) -> float:
        """The profile's mean recall over the layers of ``budgets`` (layer: read budget, nearest 1/64)."""
        return sum(self.recall[self.layers.index(layer)][min(STEPS, max(1, round(b * STEPS))) - 1]
                   for layer, b in budgets.items()) / len(budgets)

    def allocate(self, budget: float, layers: Sequence[int]) -> dict[int, float]:
        """Read budgets of ``layers`` (all in the profile), each at least 1/64, whose mean is
        ``budget`` (to 1/64 per layer in all) and whose summed recall is highest. Where no such split
        exists (budgets under 1/64) every layer reads ``budget``."""
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise ConfigError("layer_budgets", self.model, f"a profile covering the routed layers "
                              f"(it has {self.layers[0]}..{self.layers[-1]}, not {missing})")
        units = round(budget * STEPS * len(layers))
        if len(layers) > units:
            return dict.fromkeys(layers, budget)
        curves = torch.tensor([self.recall[self.layers.index(layer)] for layer in layers],
                              dtype=torch.float64)
        best = torch.full((units + 1,), float("-inf"), dtype=torch.float64)
        best[0] = 0.0
        picks = torch.zeros((len(layers), units + 1), dtype=torch.long)
        for i in range(len(layers)):  # best[t]: the highest summed recall of the layers so far at t units
            grown = torch.full_like(best, float("-inf"))
            for u in range(1, min(STEPS, units) + 1):
                candidate = torch.full_like(best, float("-inf"))
                candidate[u:] = best[:-u] + curves[i, u - 1]
                better = candidate > grown
                grown[better], picks[i, better] = candidate[better], u
            best = grown
        chosen, left = {}, units
        for i in reversed(range(len(layers))):
            u = int(picks[i, left])
            chosen[layers[i]], left = u / STEPS, left - u
        return dict(sorted(chosen.items()))

    def save(self, path: str | Path) -> None:
        """JSON, written to a temporary name and renamed, so a reader never sees half a file."""
        path = Path(path)
        scratch = path.with_name(path.name + ".tmp")
        head = json.dumps({"model": self.model, "shape": self.shape, "source": self.source,
                           "layers": list(self.layers), "steps": STEPS}, indent=1)
        rows = ",\n".join(f"  {json.dumps(list(row))}" for row in self.recall)  # one line per layer
        scratch.write_text(f'{head[:-2]},\n "recall": [\n{rows}\n ]\n}}\n')
        os.replace(scratch, path)

    @classmethod
    def load(cls, path: str | Path) -> LayerProfile:
        try:
            data = json.loads(Path(path).read_text())
            if data.get("steps") != STEPS:
                raise ValueError(f"steps {data.get('steps')}, not {STEPS}")
            return cls(str(data["model"]), dict(data["shape"]), tuple(int(x) for x in data["layers"]),
                       tuple(tuple(float(v) for v in row) for row in data["recall"]), dict(data["source"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError("layer_budgets", str(path), f"a profile written by `kvfactory selectors "
                              f"calibrate` ({type(exc).__name__}: {exc})") from None


def resolve(setting: str, model_config: Any) -> LayerProfile | None:
    """The profile ``setting`` names for this model: ``"uniform"`` none; ``"auto"`` the shipped
    profile when the model has the embedded model's shape, else none; a path that file's profile,
    which must match the model."""
    if setting == "uniform":
        return None
    if setting == "auto":
        profile = LayerProfile.load(embedded_profile_path())
        return profile if profile.matches(model_config) else None
    profile = LayerProfile.load(setting)
    if not profile.matches(model_config):
        raise ConfigError("layer_budgets", setting, f"a profile for this model: it was measured on "
                          f"{profile.shape}, the model is {model_shape(model_config)}")
    return profile
