"""Router files: a trained OVAL scorer's weights, kind and architecture in one safetensors file.

Three kinds (``docs/sparse-reads.md``): ``"query"`` (``lowrank.LowRankScorer``, the step's own query
against learned low-rank key codes), ``"gate"`` (``gate.BlockGate``, the step's pooled queries against
learned page embeddings) and ``"prefetch"`` (``router.Router``, pages predicted from the previous
step's hidden state). Files written before the kinds existed hold a prefetch router.

A file may also name routed layers another selector reads better (``layer_selectors``, ``{layer:
"quest" | "recent"}``, chosen on held-out text by ``kvfactory oval train``): the per-layer mix a
selector config turns on with ``"mix": true``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from kvfactory.errors import ConfigError

Module = TypeVar("Module", bound=torch.nn.Module)


def layer_index(layers: tuple[int, ...], layer_idx: int) -> int:
    """Where model layer ``layer_idx`` is among the ``layers`` a router was trained for; a
    ``ConfigError`` when it is not one of them."""
    if layer_idx not in layers:
        raise ConfigError("router layers", list(layers), f"a router trained for layer {layer_idx}: train one "
                          f"with `kvfactory oval train` for this model and dense_layers")
    return layers.index(layer_idx)


MIXED = ("quest", "recent")  # selectors a router file may hand a layer to


class RouterModule(torch.nn.Module):
    """What every kind of router file holds: its ``kind``, its architecture (``shape``, a frozen
    dataclass of ``shape_type``) and the routed layers it hands to another selector. What the page
    summaries keep for it is declared: ``encodes_keys``, a code per token (``encode(keys, layer)``);
    ``embeds_pages``, an embedding per page (``embed_pages(features, layer)``)."""

    kind: ClassVar[str]
    shape_type: ClassVar[type]
    encodes_keys: ClassVar[bool] = False
    embeds_pages: ClassVar[bool] = False

    def __init__(self, shape: Any) -> None:
        super().__init__()
        self.shape = shape
        self.layer_selectors: dict[int, str] = {}  # routed layers another selector reads

    def save(self, path: str | Path) -> None:
        """Weights with ``kind``, ``shape`` and ``layer_selectors`` as metadata in one safetensors file,
        written to a temporary name and renamed, so a failed write leaves any earlier file whole."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        metadata = {"kind": self.kind, "shape": json.dumps(asdict(self.shape)),
                    "layer_selectors": json.dumps(self.layer_selectors)}
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(path)

    @classmethod
    def from_metadata(cls, shape: dict[str, Any]) -> RouterModule:
        return cls(cls.shape_type(**(shape | {"layers": tuple(shape["layers"])})))


def check_layer_selectors(choice: dict[Any, Any], layers: tuple[int, ...]) -> dict[int, str]:
    """``{layer: selector}`` with int layers among ``layers`` and selectors in ``MIXED``; else
    ``ValueError``."""
    checked = {int(layer): name for layer, name in choice.items()}
    wrong = {layer: name for layer, name in checked.items() if layer not in layers or name not in MIXED}
    if wrong:
        raise ValueError(f"layer_selectors {wrong}: routed layers {list(layers)} handed to one of {MIXED}")
    return checked


def load_module(path: str | Path, expected: type[Module] | None = None) -> Any:
    """The scorer in ``path`` (of class ``expected`` when given), in eval mode; a ``ConfigError`` naming
    the file for anything else."""
    from kvfactory.selectors.oval.gate import BlockGate
    from kvfactory.selectors.oval.lowrank import LowRankScorer
    from kvfactory.selectors.oval.router import Router

    kinds = {cls.kind: cls for cls in (LowRankScorer, Router, BlockGate)}
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if "router_shape" in meta:  # a prefetch router written before files named their kind
            meta = {"kind": Router.kind, "shape": meta["router_shape"]}
        cls = kinds[meta["kind"]]
        with torch.inference_mode(False):  # weights a later step may version-check or retrain
            module = cls.from_metadata(json.loads(meta["shape"]))
            module.load_state_dict(load_file(str(path)))
        module.layer_selectors = check_layer_selectors(json.loads(meta.get("layer_selectors", "{}")),
                                                       module.shape.layers)
    except (OSError, KeyError, ValueError, RuntimeError, TypeError, SafetensorError) as exc:
        raise ConfigError("router", str(path), f"an OVAL router file written by `kvfactory oval train` "
                          f"({type(exc).__name__}: {exc})") from exc
    if expected is not None and not isinstance(module, expected):
        raise ConfigError("router", str(path), f"a {expected.kind} router (this file holds a {module.kind} "
                          f"one)")
    return module.eval()
