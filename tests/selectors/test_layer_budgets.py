"""Per-layer read budgets: the split, the profile file, how a config picks it, and its calibration."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from helpers import attn_implementation
from tiny_models import left_padded_batch, random_prompt, tiny_config, tiny_model
from transformers import AutoConfig
from typer.testing import CliRunner

from kvfactory import ConfigError, KVCacheFactory
from kvfactory.cli import app
from kvfactory.selectors import calibrate, teacher
from kvfactory.selectors.layer_budgets import STEPS, LayerProfile, embedded_profile_path, model_shape, resolve
from kvfactory.selectors.oval import train as oval_train
from kvfactory.selectors.spec import SelectorSpec

PAGE = 4


def profile_of(curves: torch.Tensor, layers: tuple[int, ...], config=None) -> LayerProfile:
    shape = model_shape(config or tiny_config("llama"))
    return LayerProfile("tiny", shape, layers, tuple(tuple(float(v) for v in row) for row in curves), {})


def rising_curves(layers: int, seed: int) -> torch.Tensor:
    """Recall curves that rise with the budget, not all concave (so greedy splits can go wrong)."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.rand(layers, STEPS, generator=gen) ** 3
    return (steps.cumsum(-1) / steps.sum(-1, keepdim=True)).to(torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [1 / 16, 0.125, 0.3])
def test_the_split_is_the_best_one_with_the_same_mean_budget(seed: int, budget: float) -> None:
    curves = rising_curves(3, seed)
    profile = profile_of(curves, (2, 3, 4))
    split = profile.allocate(budget, [2, 3, 4])
    units = round(budget * STEPS * 3)
    assert sum(split.values()) * STEPS == pytest.approx(units)  # as many pages in all as one budget
    assert min(split.values()) >= 1 / STEPS
    best = max(sum(curves[i, u - 1] for i, u in enumerate(us))
               for us in itertools.product(range(1, STEPS + 1), repeat=3) if sum(us) == units)
    assert profile.mean_recall(split) * 3 == pytest.approx(float(best))
    assert profile.mean_recall(split) >= profile.mean_recall(dict.fromkeys(split, budget)) - 1e-12


def test_a_layer_that_saturates_gives_its_pages_to_one_that_does_not() -> None:
    quick = torch.ones(STEPS, dtype=torch.float64)  # all its mass in its first 1/64
    slow = torch.arange(1, STEPS + 1, dtype=torch.float64) / STEPS  # recall equal to the budget
    profile = profile_of(torch.stack([quick, slow]), (0, 1))
    assert profile.allocate(0.25, [0, 1]) == {0: 1 / STEPS, 1: 0.5 - 1 / STEPS}


def test_the_split_covers_only_the_layers_asked_and_small_budgets_stay_even() -> None:
    profile = profile_of(rising_curves(3, 0), (2, 3, 4))
    assert set(profile.allocate(0.125, [3, 4])) == {3, 4}
    assert profile.allocate(0.01, [2, 3, 4]) == dict.fromkeys([2, 3, 4], 0.01)  # under 1/64 a layer
    with pytest.raises(ConfigError, match=r"layer_budgets.*not \[1\]"):
        profile.allocate(0.125, [1, 2])


def test_a_profile_round_trips_and_broken_files_are_refused(tmp_path) -> None:
    path = tmp_path / "profile.json"
    profile = profile_of(rising_curves(2, 0), (0, 1))
    profile.save(path)
    assert LayerProfile.load(path) == profile and [p.name for p in tmp_path.iterdir()] == ["profile.json"]
    text = path.read_text()
    data = json.loads(text)
    broken = {"truncated": text[:len(text) // 2],
              "other steps": json.dumps(data | {"steps": 32}),
              "short row": json.dumps(data | {"recall": [data["recall"][0][:10], data["recall"][1]]}),
              "no layers": json.dumps({k: v for k, v in data.items() if k != "layers"})}
    for content in broken.values():
        path.write_text(content)
        with pytest.raises(ConfigError, match="layer_budgets.*kvfactory selectors calibrate"):
            LayerProfile.load(path)
    with pytest.raises(ConfigError, match="FileNotFoundError"):
        LayerProfile.load(tmp_path / "missing.json")


def test_auto_uses_the_shipped_profile_only_for_the_embedded_models_shape(tmp_path) -> None:
    shipped = LayerProfile.load(embedded_profile_path())
    sizes = {key: value for key, value in shipped.shape.items() if key != "model_type"}
    smollm2_shape = AutoConfig.for_model("llama", **sizes)
    assert resolve("auto", smollm2_shape) == shipped
    assert shipped.layers == tuple(range(2, 30)) and shipped.source["context"] == 6144
    assert resolve("auto", tiny_config("llama")) is None
    assert resolve("uniform", smollm2_shape) is None
    path = tmp_path / "smollm2.json"
    shipped.save(path)
    assert resolve(str(path), smollm2_shape) == shipped
    with pytest.raises(ConfigError, match="a profile for this model: it was measured on .*576"):
        resolve(str(path), tiny_config("llama"))


def test_the_shipped_split_reads_one_eighth_in_all_and_more_where_attention_spreads() -> None:
    shipped = LayerProfile.load(embedded_profile_path())
    split = shipped.allocate(0.125, list(shipped.layers))
    assert sum(split.values()) / len(split) == pytest.approx(0.125)
    assert shipped.mean_recall(split) > shipped.mean_recall(dict.fromkeys(split, 0.125)) + 0.01
    spread = min(shipped.layers, key=lambda layer: shipped.recall[shipped.layers.index(layer)][7])
    assert split[spread] > 0.125  # the layer whose pages hold least at 1/8 reads more
    assert max(split.values()) > 2 * 0.125 > 2 * min(split.values())  # layers differ widely


def test_a_config_names_a_profile_file_with_a_read_budget(tmp_path) -> None:
    with pytest.raises(ConfigError, match="layer_budgets.*'auto', 'uniform'"):
        SelectorSpec.parse("quest", {"layer_budgets": str(tmp_path / "missing.json")})
    path = tmp_path / "profile.json"
    profile_of(rising_curves(2, 0), (0, 1)).save(path)
    with pytest.raises(ConfigError, match="no floor"):
        SelectorSpec.parse("quest", {"layer_floor": 0.5})
    with pytest.raises(ConfigError, match="with read_budget, not top_k"):
        SelectorSpec.parse("quest", {"layer_budgets": str(path), "top_k": 4})
    spec = SelectorSpec.parse("quest", {"layer_budgets": str(path), "read_budget": 0.25, "dense_layers": 0})
    layers = spec.per_layer(tiny_config("llama"), [0, 1])
    assert sum(s.read_budget for s in layers.values()) / 2 == pytest.approx(0.25)
    assert all(s.layer_budgets == "uniform" and s.selector == "quest" for s in layers.values())
    top_k = SelectorSpec.parse("quest", {"top_k": 3}).per_layer(tiny_config("llama"), [0, 1])
    assert all(s.top_k == 3 for s in top_k.values())


def test_a_cache_reads_each_layers_share_of_the_budget(tmp_path) -> None:
    model = tiny_model("llama")
    quick = torch.ones(STEPS, dtype=torch.float64)
    slow = torch.arange(1, STEPS + 1, dtype=torch.float64) / STEPS
    path = tmp_path / "profile.json"
    profile_of(torch.stack([quick, slow]), (0, 1)).save(path)  # layer 0 needs 1/64, layer 1 the rest
    reads = {}
    for setting in ("uniform", str(path)):
        config = {"type": "composite", "strategies": [
            {"name": "paged", "page_size": PAGE},
            {"name": "quest", "read_budget": 0.25, "dense_layers": 0, "layer_budgets": setting,
             "prompt_weight": 0}]}  # pages counted over steps: Quest's own choice
        with attn_implementation(model, "kvfactory"), torch.no_grad():
            cache = KVCacheFactory(model.config, config).create_cache()
            out = model.generate(**left_padded_batch([60, 45], seed=4), past_key_values=cache,
                                 max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert out.shape[1] > 60
        reads[setting] = [int(layer.store._last_read[:, :, :16].gt(0).sum()) for layer in cache.layers]
        assert cache.routing_metrics()["read_fraction"] < 0.45  # about a quarter in all, both ways
    assert reads["uniform"][0] == reads["uniform"][1]
    assert reads[str(path)][0] < reads["uniform"][0] < reads[str(path)][1]


def test_the_curves_are_the_teachers_quest_recall_at_each_budget() -> None:
    model = tiny_model("llama", max_position_embeddings=1024)
    ids = torch.cat([random_prompt(512, seed=s)[0] for s in range(2)])
    router = oval_train.new_router(model, 0, "tiny")
    chunks = teacher.collect(model, ids, router.shape.layers, 8, 256, seed=0)
    curves = calibrate.recall_curves(chunks)
    assert curves.shape == (2, STEPS) and bool((curves.diff(dim=-1) >= -1e-6).all())
    for u in (4, 8, 16, 40):
        expected = oval_train.evaluate(router, chunks, u / STEPS)["quest"]["recall"]
        assert float(curves[:, u - 1].mean()) == pytest.approx(expected, abs=1e-5)
    assert curves[:, -1].tolist() == pytest.approx([1.0, 1.0], abs=1e-2)  # every page: all the mass


def test_read_budget_calibration_moved_out_of_oval() -> None:
    result = CliRunner().invoke(app, ["oval", "calibrate", "--text", "book.txt"])
    assert result.exit_code != 0 and "kvfactory selectors calibrate" in result.output


@pytest.mark.slow
def test_the_calibrate_command_writes_a_profile_the_config_accepts(tmp_path, smollm2) -> None:
    from helpers import DATA_DIR

    book = DATA_DIR / "pg84_frankenstein.txt"
    if not book.exists():
        pytest.skip("the Gutenberg books of shared/data are not here")
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["selectors", "calibrate", "--text", str(book), "--out", str(out),
                                      "--context", "1024", "--windows", "1", "--positions", "8"])
    assert result.exit_code == 0, result.output
    assert "recall" in result.output and "layer_budgets" in result.output
    profile = LayerProfile.load(out)
    assert profile.layers == tuple(range(2, 30)) and profile.source["texts"] == [book.name]
    model, _ = smollm2
    assert resolve(str(out), model.config) == profile


@pytest.mark.slow
def test_the_shipped_profile_reads_more_attention_on_a_book_it_was_not_fitted_on(smollm2) -> None:
    """Fitted on *Pride and Prejudice*; on a 6144-token window of *Frankenstein* the shipped split
    holds more of Quest's attention mass at 1/8 than one budget for every layer."""
    from helpers import DATA_DIR

    book = DATA_DIR / "pg84_frankenstein.txt"
    if not book.exists():
        pytest.skip("the Gutenberg books of shared/data are not here")
    model, tokenizer = smollm2
    shipped = LayerProfile.load(embedded_profile_path())
    ids = teacher.tokens_of(tokenizer, [book.read_text(encoding="utf-8")])[30000:30000 + 6144]
    chunks = teacher.collect(model, ids, shipped.layers, 16, 6144, seed=1)
    measured = profile_of(calibrate.recall_curves(chunks), shipped.layers, model.config)
    split = shipped.allocate(0.125, list(shipped.layers))
    assert measured.mean_recall(split) > measured.mean_recall(dict.fromkeys(split, 0.125)) + 0.005
