"""OVAL's per-layer mix and its output objective: a router file hands layers to Quest or recent pages
(chosen on held-out text by ``kvfactory oval train``), ``"mix": true`` reads them with those, each
layer at its own read budget; a scorer fitted to the pages' pull on the attention output ranks pages
as that teacher does."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from helpers import generate, tiny_router
from tiny_models import random_prompt, tiny_model

from kvfactory import ConfigError, KVCacheFactory
from kvfactory.selectors import teacher
from kvfactory.selectors.layer_budgets import STEPS, LayerProfile, model_shape
from kvfactory.selectors.oval import OvalSelector, load_router
from kvfactory.selectors.oval import train as oval_train
from kvfactory.selectors.oval.files import load_module
from kvfactory.selectors.quest import QuestSelector
from kvfactory.selectors.recent import RecentSelector

PAGE = 4
LAYERS = (0, 1, 2, 3)


def mixed_router(handed: dict[int, str]) -> str:
    """A copy of the tiny query scorer that hands ``handed`` layers to other selectors."""
    scorer = load_module(tiny_router(64, 2, 16, LAYERS))
    scorer.layer_selectors = handed
    path = Path(tempfile.mkdtemp()) / "mixed.safetensors"
    scorer.save(path)
    return str(path)


def config(router: str, **options) -> dict:
    entry = {"name": "oval", "router": router, "read_budget": 0.25, "dense_layers": 0} | options
    return {"type": "composite", "strategies": [{"name": "paged", "page_size": PAGE}, entry]}


def test_a_router_file_keeps_the_layers_it_hands_to_other_selectors(tmp_path) -> None:
    path = mixed_router({1: "quest", 3: "recent"})
    assert load_router(path).layer_selectors == {1: "quest", 3: "recent"}
    for wrong in ({7: "quest"}, {1: "oval"}, {1: "random"}):
        broken = mixed_router(wrong)
        with pytest.raises(ConfigError, match="layer_selectors"):
            load_module(broken)


def test_choose_layers_hands_a_layer_to_the_selector_with_the_lower_output_error() -> None:
    errors = {"router": {2: 0.10, 3: 0.20, 4: 0.30}, "quest": {2: 0.15, 3: 0.18, 4: 0.35},
              "recent": {2: 0.40, 3: 0.19, 4: 0.25}}
    report = {name: {"output_error_per_layer": per_layer} for name, per_layer in errors.items()}
    assert oval_train.choose_layers(report) == {3: "quest", 4: "recent"}


def test_the_mix_reads_each_layer_with_its_selector_at_its_own_budget() -> None:
    """Layers 1 and 3 are handed to Quest and recent pages; each of the four layers reads its own
    share of a split read budget and keeps its own selector's page summaries (Quest's bounds cost
    more bytes than OVAL's codes; recent pages read none). Without ``mix`` OVAL reads every layer."""
    model = tiny_model("llama", num_hidden_layers=4)
    router = mixed_router({1: "quest", 3: "recent"})
    with pytest.raises(ConfigError, match="mix"):
        KVCacheFactory(model.config, config(router, mix="yes"))
    plain = KVCacheFactory(model.config, config(router))
    assert {spec.selector for spec in plain.layer_selectors.values()} == {"oval"}
    factory = KVCacheFactory(model.config, config(router, mix=True))
    chosen = [factory.layer_selectors[layer].selector for layer in LAYERS]
    assert chosen == ["oval", "quest", "oval", "recent"]
    assert factory.layer_selectors[3].prompt_weight == RecentSelector.prompt_weight  # its own default
    cache = factory.create_cache()
    generate(model, {"input_ids": random_prompt(60)}, cache, max_new_tokens=3, min_new_tokens=3)
    kinds = (OvalSelector, QuestSelector, OvalSelector, RecentSelector)
    for layer, kind in zip(LAYERS, kinds, strict=True):
        store = cache.layers[layer].store
        assert type(store.selector) is kind
        pages = store.summaries.pages
        read = (store._last_read[..., :pages] == store.steps).sum(-1)
        assert (read == factory.layer_selectors[layer].pages_to_read(pages)).all(), layer
    summary_bytes = [cache.layers[layer].store.summaries.scored.nbytes for layer in (0, 1)]
    assert summary_bytes[1] > summary_bytes[0] > 0  # Quest's bounds against OVAL's int8 codes
    assert not cache.layers[3].store.selector.reads_summaries


def test_a_budget_split_between_layers_applies_to_the_layers_handed_over(tmp_path) -> None:
    model = tiny_model("llama", num_hidden_layers=4)
    steps = torch.arange(1, STEPS + 1, dtype=torch.float64) / STEPS
    curves = tuple(tuple((steps ** (0.2 + 0.4 * layer)).tolist()) for layer in LAYERS)
    profile = tmp_path / "profile.json"
    LayerProfile("tiny", model_shape(model.config), LAYERS, curves, {}).save(profile)
    factory = KVCacheFactory(model.config, config(mixed_router({1: "quest"}), mix=True,
                                                  layer_budgets=str(profile)))
    split = {layer: spec.read_budget for layer, spec in factory.layer_selectors.items()}
    assert len(set(split.values())) > 1 and sum(split.values()) / 4 == pytest.approx(0.25, abs=1e-6)
    assert factory.layer_selectors[1].selector == "quest"


def test_a_scorer_fitted_to_the_output_ranks_pages_as_that_teacher_does() -> None:
    """Trained on a tiny model's page impact (``objective="output"``): its top pages agree with the
    teacher's top pages by impact more than before training and more than Quest's do."""
    model = tiny_model("llama", max_position_embeddings=1024)
    ids = torch.cat([random_prompt(512, seed=s)[0] for s in range(2)])
    scorer = oval_train.new_router(model, 0, "tiny", "query")
    with pytest.raises(ValueError, match="impact=True"):
        oval_train.query_loss(scorer, teacher.collect(model, ids, scorer.shape.layers, 8, 256, seed=0,
                                                      keys=True)[0], "output")
    chunks = teacher.collect(model, ids, scorer.shape.layers, 8, 256, seed=0, keys=True, impact=True)
    assert chunks[0].impact.shape == chunks[0].mass.shape

    def agreement(ranked: str) -> float:
        hits = []
        for chunk in chunks:
            allowed = teacher.candidates(chunk.current, chunk.mass.shape[-1])[:, None, None, :]
            k = teacher.chosen_count(chunk.current, 0.25)[:, None, None, None]
            scores = chunk.quest.float() if ranked == "quest" else oval_train.ranking(scorer, chunk)
            mine = oval_train._top(scores, allowed, k)
            truth = oval_train._top(chunk.impact.float(), allowed, k)
            hits.append((mine & truth).sum() / truth.sum())
        return float(torch.stack(hits).mean())

    scorer.init_from_keys(oval_train._sample_keys(chunks))
    scorer.fit_code_scales(oval_train._sample_keys(chunks))
    before = agreement("scorer")
    with torch.no_grad():
        loss_before = sum(float(oval_train.query_loss(scorer, c, "output")) for c in chunks)
    oval_train.train(scorer, chunks, epochs=10, budget=0.25, objective="output")
    with torch.no_grad():
        loss_after = sum(float(oval_train.query_loss(scorer, c, "output")) for c in chunks)
    after = agreement("scorer")
    assert loss_after < loss_before
    assert after > before and after > agreement("quest"), (before, after, agreement("quest"))
    with pytest.raises(ValueError, match="objective"):
        oval_train.query_loss(scorer, chunks[0], "recall")
