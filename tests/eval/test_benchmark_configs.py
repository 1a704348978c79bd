"""The configs the sparse-read tables run (``benchmarks/configs/NAME_true_N.yaml``): each is a valid
cache config whose layers read, together, a true 1/N of the tokens on the embedded model's 30 layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfactory import KVCacheFactory, models
from kvfactory.eval.runner import resolve_cache

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "configs").glob("*.yaml"))
SMOLLM2_LAYERS = 30


def test_there_are_configs() -> None:
    assert len(CONFIGS) >= 9


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_config_reads_the_fraction_its_name_gives(path: Path) -> None:
    config = resolve_cache(str(path)).config
    selector = config["strategies"][1]
    dense = selector["dense_layers"] / SMOLLM2_LAYERS
    fraction = dense + (1 - dense) * selector["read_budget"]
    assert fraction == pytest.approx(1 / int(path.stem.rsplit("_", 1)[1]), abs=1e-3)
    assert selector["layer_budgets"] == "uniform"  # one budget per routed layer: the fraction holds per layer
    KVCacheFactory(models.load_config("smollm2"), config).create_cache()  # the model they were made for
