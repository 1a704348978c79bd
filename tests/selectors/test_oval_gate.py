"""OVAL's block gate: distilled from a tiny model's page attention it ranks pages as its teacher does,
a decode step scores the page embeddings its summaries keep as training scored them, and a cache
decodes with it."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
from helpers import fit_tiny_scorer, generate
from tiny_models import random_prompt, tiny_model

from kvfactory import KVCacheFactory
from kvfactory.selectors import teacher
from kvfactory.selectors.oval import load_router
from kvfactory.selectors.oval import train as oval_train
from kvfactory.selectors.oval.gate import BlockGate, GateShape
from kvfactory.selectors.pages import PageSummaries


def trained_gate() -> tuple[BlockGate, list[teacher.Chunk], float, float]:
    return fit_tiny_scorer("gate", epochs=15)


def test_the_gate_learns_its_teachers_page_mass_and_ranks_as_decode_does() -> None:
    gate, chunks, before, after = trained_gate()
    assert after < before
    report = oval_train.evaluate(gate, chunks, 0.25)
    assert report["router"]["recall"] > report["quest"]["recall"] - 0.02
    assert all(report["oracle"]["recall"] >= v["recall"] - 1e-6 for v in report.values())
    # decode's path: page embeddings kept as the keys arrive, the step's queries scored against them
    chunk, layer = chunks[0], 1
    logits = oval_train.gate_logits(gate, chunk)
    for s in (0, 5):
        position = int(chunk.positions[s])
        summaries = PageSummaries(teacher.PAGE, with_mean=True, dtype=torch.float32)
        summaries.set_embedding(lambda features: gate.embed_pages(features, layer))
        summaries.append(chunk.keys[layer, :, :position + 1][None].float())
        queries = chunk.queries[s, layer].float().view(1, 2, 2, 16)  # [B, Hkv, query heads, D]
        scored = gate.score_pages(queries, summaries.embedded, layer)[0]
        whole = position // teacher.PAGE  # the pages full at this position score as in training
        torch.testing.assert_close(scored[:, :whole], logits[s, layer, :, :whole], atol=1e-4, rtol=1e-4)


def test_a_cache_decodes_with_a_trained_gate_and_reads_its_embeddings() -> None:
    gate, _, _, _ = trained_gate()
    path = Path(tempfile.mkdtemp()) / "gate.safetensors"
    gate.save(path)
    assert isinstance(load_router(str(path)), BlockGate)
    model = tiny_model("llama", max_position_embeddings=1024)
    config = {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 4},
        {"name": "oval", "router": str(path), "read_budget": 0.25, "dense_layers": 0}]}
    cache = KVCacheFactory(model.config, config).create_cache()
    generate(model, {"input_ids": random_prompt(60)}, cache, max_new_tokens=3, min_new_tokens=3)
    for layer in (0, 1):
        store = cache.layers[layer].store
        pages = store.summaries.pages
        assert store.summaries.scored.shape[-1] == gate.shape.dim  # 32 numbers per page read
        read = (store._last_read[..., :pages] == store.steps).sum(-1)
        assert (read == store.spec.pages_to_read(pages)).all()
    assert cache.routing_metrics()["read_fraction"] < 0.6


def test_decode_scoring_follows_the_weights_as_training_changes_them() -> None:
    """``score_pages`` (a decode step's path, which keeps each layer's scaled projection) equals
    ``page_logits`` (training's) for one new token and several, before and after the weights change in
    place, and in a copy trained apart."""
    gate = BlockGate(GateShape(query_heads=4, kv_heads=2, head_dim=16, layers=(0, 3), dim=8))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.page.normal_(generator=gen)
        gate.query.normal_(generator=gen)
    embedded = torch.randn(1, 2, 10, 8, generator=gen).half()
    for _ in range(2):
        for rows in (2, 6):  # one new token's two query heads, and three new tokens'
            queries = torch.randn(1, 2, rows, 16, generator=gen)
            expected = gate.page_logits(queries, embedded, 3).detach()
            torch.testing.assert_close(gate.score_pages(queries, embedded, 3), expected, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            gate.query.mul_(-2.0)  # as an optimiser's step changes them
    twin = copy.deepcopy(gate)  # its weights start at version 0; the projection it copied was made at 2
    with torch.no_grad():
        twin.query.add_(1.0)
        twin.query.add_(1.0)
    queries = torch.randn(1, 2, 2, 16, generator=gen)
    for module in (twin, gate):
        expected = module.page_logits(queries, embedded, 3).detach()
        torch.testing.assert_close(module.score_pages(queries, embedded, 3), expected, atol=1e-5, rtol=1e-5)
