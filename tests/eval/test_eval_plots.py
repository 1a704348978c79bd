"""The evaluation's plots read at a glance: at most 8 series per chart, each its own colour, every one
of kvfactory's configs shown, however many presses a peer adds."""

from __future__ import annotations

import copy

import pytest
from eval_pipeline import CONTEXTS, TASKS, pipeline_results
from matplotlib.colors import to_hex

from kvfactory.eval.exchange import EXTERNAL
from kvfactory.eval.plots import MAX_SERIES, label, ppl_figure, tradeoff_figure

PRESSES = 11  # more than one chart's worth


@pytest.fixture(scope="module")
def results() -> dict:
    """The tiny pipeline's run, with a peer's no-press baseline and 11 presses merged (their rows are
    the baseline's, at half the bytes)."""
    results = copy.deepcopy({k: v for k, v in pipeline_results().items() if k != "_units"})
    baseline = [r for r in results["rows"] if r["config"] == "DynamicCache"]
    for name, ratio in [("kvpress/none@0", 1.0)] + [(f"kvpress/press{i}@0.5", 0.5) for i in range(PRESSES)]:
        results["configs"].append({"name": name, "kind": EXTERNAL, "config": None, "source": "test"})
        for row in baseline:
            results["rows"].append(row | {"config": name, "bytes_per_token_ratio": ratio})
    return results


def colour(handle) -> str:
    if hasattr(handle, "get_facecolor"):
        face = handle.get_facecolor()
        return to_hex(face[0] if len(face) and not isinstance(face[0], float) else face)
    return to_hex(handle.get_color())


def series(container) -> tuple[list[str], list[str]]:
    handles, labels = container.get_legend_handles_labels()
    return labels, [colour(h) for h in handles]


def kvfactory_configs(results: dict) -> list[str]:
    return [label(c["name"]) for c in results["configs"] if c["kind"] == "kvfactory"]


def test_the_ppl_chart_is_one_bar_per_config_coloured_by_family(results) -> None:
    fig = ppl_figure(results)
    labels, colours = [t.get_text() for t in fig.legends[0].get_texts()], [
        to_hex(p.get_facecolor()) for p in fig.legends[0].get_patches()]
    assert labels == ["lossless", "quantization", "sparse reads", "transformers", "peer presses"]
    assert len(set(colours)) == len(colours) <= MAX_SERIES
    assert len(fig.axes) == len(CONTEXTS)
    for ax in fig.axes:
        names = [t.get_text() for t in ax.get_yticklabels()]
        assert set(kvfactory_configs(results)) <= set(names) and "DynamicCache" not in names
        assert len(ax.patches) == len(names)  # a bar per config, no series per config


@pytest.mark.parametrize("task", TASKS)
def test_a_tradeoff_chart_holds_at_most_eight_distinct_series(results, task) -> None:
    fig = tradeoff_figure(results, task)
    assert fig is not None
    rows = 1 + -(-PRESSES // MAX_SERIES)  # the configs, then the presses 8 to a panel
    assert len(fig.axes) == rows * len(CONTEXTS)
    pressed = []
    for ax in fig.axes:
        labels, colours = series(ax)
        assert 0 < len(labels) <= MAX_SERIES and len(set(colours)) == len(colours), (labels, colours)
        if "presses" in ax.get_title():
            pressed += labels
        else:
            annotated = {text.get_text() for text in ax.texts}
            assert set(kvfactory_configs(results)) <= annotated and "DynamicCache" in labels
    assert sorted(pressed) == sorted([f"kvpress/press{i}" for i in range(PRESSES)] * len(CONTEXTS))
