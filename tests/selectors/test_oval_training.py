"""OVAL router training: the teacher's record against a direct computation, and a short fit."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import fit_tiny_scorer
from tiny_models import random_prompt, tiny_model
from typer.testing import CliRunner

from kvfactory.cli import app
from kvfactory.selectors import teacher
from kvfactory.selectors.oval import train as oval_train
from kvfactory.selectors.oval.files import load_module
from kvfactory.selectors.oval.lowrank import LowRankScorer
from kvfactory.selectors.oval.router import Router
from kvfactory.selectors.pages import PageSummaries


def test_a_pages_impact_is_how_far_leaving_it_out_moves_the_attention_output() -> None:
    gen = torch.Generator().manual_seed(1)
    query, key = torch.randn(1, 4, 64, 8, generator=gen), torch.randn(1, 2, 64, 8, generator=gen)
    value = torch.randn(1, 2, 64, 8, generator=gen)
    positions = torch.tensor([40, 63])
    impact = teacher.page_record(query, key, positions, 0.5, value).impact
    assert impact.shape == (2, 2, 4)
    for s, t in enumerate(positions.tolist()):
        for h in range(2):
            moved = []
            for g in (2 * h, 2 * h + 1):
                probs = (query[0, g, t] @ key[0, h, :t + 1].T * 0.5).softmax(-1)
                out = probs @ value[0, h, :t + 1]
                per_page = []
                for page in range(4):
                    kept = torch.ones(t + 1, dtype=torch.bool)
                    kept[page * 16:(page + 1) * 16] = False
                    share = probs[kept].sum()
                    without = probs[kept] @ value[0, h, :t + 1][kept] / share
                    per_page.append((without - out).norm() * share / out.norm())  # the move times 1 - m_p
                moved.append(torch.stack(per_page))
            torch.testing.assert_close(impact[s, h], torch.stack(moved).mean(0), rtol=1e-4, atol=1e-6)


def test_the_teacher_records_full_attention_mass_per_page() -> None:
    gen = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 4, 64, 8, generator=gen), torch.randn(1, 2, 64, 8, generator=gen)
    positions = torch.tensor([20, 47, 63])
    features, mass, quest, impact = teacher.page_record(query, key, positions, 0.5)
    assert features.shape == (2, 4, 24) and mass.shape == quest.shape == (3, 2, 4) and impact is None
    for s, t in enumerate(positions.tolist()):
        for h in range(2):
            group = (2 * h, 2 * h + 1)
            probs = torch.stack([(query[0, g, t] @ key[0, h, :t + 1].T * 0.5).softmax(-1) for g in group])
            per_page = torch.zeros(64)
            per_page[:t + 1] = probs.mean(0)
            torch.testing.assert_close(mass[s, h], per_page.view(4, 16).sum(-1))
            pages = key[0, h].view(4, 16, 8)
            centre, half = (pages.amax(1) + pages.amin(1)) / 2, (pages.amax(1) - pages.amin(1)) / 2
            # Quest as the selector ranks pages: the paper's bound, the KV head's best query head
            bound = torch.stack([centre @ query[0, g, t] + half @ query[0, g, t].abs() for g in group])
            torch.testing.assert_close(quest[s, h], bound.amax(0))
            exact = torch.stack([(query[0, g, t] @ pages.transpose(-1, -2)).amax(-1) for g in group]).amax(0)
            assert (quest[s, h] >= exact - 1e-5).all()  # an upper bound of every key's score
    torch.testing.assert_close(features[..., 16:], key[0].view(2, 4, 16, 8).mean(2))


def test_a_short_fit_lowers_the_loss_and_reports_every_method() -> None:
    model = tiny_model("llama", max_position_embeddings=1024)
    ids = torch.cat([random_prompt(512, seed=s)[0] for s in range(2)])
    router = oval_train.new_router(model, 0, "tiny")
    before_teacher = model.config._attn_implementation
    chunks = teacher.collect(model, ids, router.shape.layers, 8, 256, seed=0)
    assert len(chunks) == 4 and chunks[0].mass.shape == (8, 2, 2, 16)
    assert torch.allclose(chunks[0].mass.float().sum(-1), torch.ones(8, 2, 2), atol=1e-2)
    with torch.no_grad():
        before = sum(float(oval_train.loss(router, c, 0.25)) for c in chunks)
    oval_train.train(router, chunks, epochs=15, budget=0.25)
    with torch.no_grad():
        after = sum(float(oval_train.loss(router, c, 0.25)) for c in chunks)
    assert after < before
    report = oval_train.evaluate(router, chunks, 0.25)
    assert set(report) == {"router", "quest", "recent", "oracle"}
    assert all(report["oracle"]["recall"] >= v["recall"] - 1e-6 for v in report.values())
    pooled = oval_train.evaluate(router, chunks, 0.25, ablations=True)
    assert set(pooled) == set(report) | {"router_no_decay", "random", "oracle_pooled"}
    assert pooled["oracle_pooled"]["recall"] >= pooled["oracle"]["recall"] - 1e-6  # a freer choice
    detail = oval_train.evaluate(router, chunks, 0.25, detail=True)
    for name, values in detail.items():
        assert values["recall"] == pytest.approx(report[name]["recall"])
        assert 0 <= values["recall_p01"] <= values["recall_p05"] <= values["recall"] + 1e-6
        assert 0 <= values["under_half"] <= 1 and set(values["per_layer"]) == set(router.shape.layers)
        mean_of_layers = sum(values["per_layer"].values()) / len(values["per_layer"])
        assert mean_of_layers == pytest.approx(values["recall"], abs=1e-5)  # as many samples per layer
    assert model.config._attn_implementation == before_teacher  # the teacher's attention is switched back


def test_output_errors_are_the_attention_over_the_pages_read() -> None:
    """The relative error of a query head's attention output over the pages read, against a direct
    computation; reading every page costs nothing; ``evaluate(detail=True)`` reports it per layer."""
    model = tiny_model("llama", max_position_embeddings=1024)
    ids = random_prompt(512, seed=0)[0]
    with pytest.raises(ValueError, match="keys=True"):
        teacher.collect(model, ids, (0, 1), 8, 256, seed=0, values=True)
    chunks = teacher.collect(model, ids, (0, 1), 8, 256, seed=0, keys=True, values=True)
    chunk = chunks[0]
    assert chunk.values.shape == chunk.keys.shape and chunk.scaling == pytest.approx(16 ** -0.5)
    every = torch.ones(chunk.mass.shape, dtype=torch.bool)
    sink = torch.zeros_like(every)
    sink[..., 0] = True
    errors = oval_train.output_errors(chunk, {"every": every, "sink": sink})
    assert errors["every"].shape == (8, 2, 4) and errors["every"].abs().max() < 1e-5
    for s, layer, head in ((0, 0, 0), (5, 1, 3)):
        t, q = int(chunk.positions[s]), chunk.queries[s, layer, head].float()
        keys, values = chunk.keys[layer, head // 2].float(), chunk.values[layer, head // 2].float()
        full = (q @ keys[:t + 1].T * chunk.scaling).softmax(-1) @ values[:t + 1]
        partial = (q @ keys[:16].T * chunk.scaling).softmax(-1) @ values[:16]
        expected = (partial - full).norm() / full.norm()
        assert float(errors["sink"][s, layer, head]) == pytest.approx(float(expected), rel=1e-4)
    router = oval_train.new_router(model, 0, "tiny")
    detail = oval_train.evaluate(router, chunks, 0.25, detail=True)
    for values in detail.values():
        per_layer = values["output_error_per_layer"]
        assert set(per_layer) == {0, 1} and values["output_error"] >= 0
        assert sum(per_layer.values()) / 2 == pytest.approx(values["output_error"], abs=1e-6)


def test_the_query_scorer_learns_the_teachers_page_mass_and_ranks_as_decode_does() -> None:
    """Trained end to end on a tiny model: the loss falls; the ranking the evaluation scores (int8
    codes) is the one a decode step computes from the codes its page summaries keep."""
    scorer, chunks, before, after = fit_tiny_scorer("query", epochs=10)
    chunk = chunks[0]
    assert chunk.keys.shape == (2, 2, 256, 16) and chunk.queries.shape == (8, 2, 4, 16)
    assert after < before
    report = oval_train.evaluate(scorer, chunks, 0.25)
    assert set(report) == {"router", "quest", "recent", "oracle"}
    assert all(report["oracle"]["recall"] >= v["recall"] - 1e-6 for v in report.values())
    # decode's path: codes kept as the keys arrive, the step's queries scored against them
    shares = oval_train.query_shares(scorer, chunk, quantized=True)
    layer = 1
    for s in (0, 5):
        position = int(chunk.positions[s])
        summaries = PageSummaries(teacher.PAGE, dtype=None)
        summaries.set_token_codes(lambda keys: scorer.encode(keys, layer))
        summaries.append(chunk.keys[layer, :, :position + 1][None].float())
        queries = chunk.queries[s, layer].float().view(1, 2, 2, 16)  # [B, Hkv, query heads, D]
        logged = scorer.page_log_mass(queries, summaries.codes, layer, teacher.PAGE)
        expected = shares[s, layer, :, :logged.shape[-1]]
        torch.testing.assert_close(logged.exp()[0], expected, atol=1e-5, rtol=1e-4)
    # the codes hold each projected key within half a code step of its scale (beyond the fitted range:
    # clipped)
    projected = chunk.keys[1].float() @ scorer.key[1].detach()
    decoded = scorer.encode(chunk.keys[1][None].float(), 1)[0].float() * scorer.code_scale[1, :, None]
    inside = projected.abs() <= scorer.code_scale[1, :, None] * 127
    step = scorer.code_scale[1, :, None].expand_as(projected)
    assert inside.float().mean() > 0.99
    assert ((decoded - projected).abs() <= step / 2 + 1e-6)[inside].all()


def test_a_gates_page_embedding_takes_the_numbers_asked_for(tmp_path) -> None:
    model = tiny_model("llama", max_position_embeddings=1024)
    gate = oval_train.new_router(model, 0, "tiny", "gate", dim=48)
    assert gate.shape.dim == 48 and gate.page.shape[-1] == gate.query.shape[-1] == 48
    gate.save(tmp_path / "gate.safetensors")
    loaded = load_module(tmp_path / "gate.safetensors")
    assert loaded.shape == gate.shape
    features = torch.randn(1, gate.shape.kv_heads, 5, 3 * gate.shape.head_dim)
    assert loaded.embed_pages(features, gate.shape.layers[0]).shape == (1, gate.shape.kv_heads, 5, 48)
    with pytest.raises(ValueError, match="dim=8 sizes a gate's page embedding; a query router has none"):
        oval_train.new_router(model, 0, "tiny", "query", dim=8)
    result = CliRunner().invoke(app, ["oval", "train", "--text", "a.txt", "--val-text", "b.txt",
                                      "--dim", "8"])
    assert result.exit_code == 2 and "a query router has none" in result.output



def test_a_router_file_loaded_in_inference_mode_still_scores(tmp_path) -> None:
    """As an evaluation loads a config's router file: inside ``inference_mode``."""
    gate = oval_train.new_router(tiny_model("llama", max_position_embeddings=1024), 0, "tiny", "gate", dim=48)
    gate.save(tmp_path / "gate.safetensors")
    with torch.inference_mode():
        inside = load_module(tmp_path / "gate.safetensors")
        queries = torch.randn(1, gate.shape.kv_heads, gate.group, gate.shape.head_dim)
        embedded = torch.randn(1, gate.shape.kv_heads, 7, 48).half()
        scores = inside.score_pages(queries, embedded, gate.shape.layers[0])
        assert scores.shape == (1, gate.shape.kv_heads, 7)


@pytest.mark.slow
def test_the_train_command_writes_a_router_and_its_curves(tmp_path) -> None:
    from helpers import DATA_DIR

    books = sorted(DATA_DIR.glob("pg*.txt"))
    if len(books) < 2:
        pytest.skip("the Gutenberg books of shared/data are not here")
    out, report = tmp_path / "router.safetensors", tmp_path / "train.json"
    result = CliRunner().invoke(app, [
        "oval", "train", "--text", str(books[0]), "--val-text", str(books[1]), "--out", str(out),
        "--chunks", "1", "--val-chunks", "1", "--chunk", "512", "--positions", "4", "--epochs", "2",
        "--objective", "output", "--json", str(report)])
    assert result.exit_code == 0, result.output
    scorer = load_module(out)
    assert isinstance(scorer, LowRankScorer) and scorer.shape.layers == tuple(range(2, 30))
    written = json.loads(report.read_text())
    curve = written["curve"]
    assert [c["epoch"] for c in curve] == [1, 2] and set(curve[-1]) >= {"router", "quest", "oracle"}
    # the per-layer mix, chosen by the held-out output errors the report carries, is saved with it
    errors = written["output_error_per_layer"]
    assert written["objective"] == "output" and set(errors) == {"router", "quest", "recent", "oracle"}
    handed = {int(layer): name for layer, name in written["layer_selectors"].items()}
    assert scorer.layer_selectors == handed
    for layer in range(2, 30):
        best = min(("router", "quest", "recent"), key=lambda name: errors[name][str(layer)])
        assert handed.get(layer, "router") == best
    # `oval mix` chooses again for a trained file, here with nothing handed over beforehand
    scorer.layer_selectors = {}
    scorer.save(out)
    result = CliRunner().invoke(app, ["oval", "mix", str(out), "--val-text", str(books[1]), "--val-chunks",
                                      "1", "--chunk", "512", "--positions", "4", "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert load_module(out).layer_selectors == handed  # the same held-out chunk, the same choice
    assert json.loads(report.read_text())["layer_selectors"] == written["layer_selectors"]
    result = CliRunner().invoke(app, [
        "oval", "train", "--kind", "prefetch", "--text", str(books[0]), "--val-text", str(books[1]),
        "--out", str(out), "--chunks", "1", "--val-chunks", "1", "--chunk", "512", "--positions", "4",
        "--epochs", "1"])
    assert result.exit_code == 0, result.output
    assert Router.load(out).shape.layers == tuple(range(2, 30))


@pytest.mark.parametrize(("batch", "new", "page", "tokens"),
                         [(1, 1, 16, 768), (3, 1, 4, 37), (2, 3, 16, 101), (1, 2, 32, 32), (2, 1, 16, 1)])
def test_the_page_kernel_scores_as_torch_does(batch: int, new: int, page: int, tokens: int) -> None:
    """``page_log_mass`` on the CPU (one C kernel call: softmax over the tokens, page sums) against
    the differentiable torch path training uses: several batch rows, new tokens, page sizes, a last page
    partly filled; a key far above the rest (its page's softmax dominates)."""
    from kvfactory.selectors.oval.lowrank import LowRankShape

    gen = torch.Generator().manual_seed(tokens)
    scorer = LowRankScorer(LowRankShape(query_heads=6, kv_heads=2, head_dim=16, layers=(0, 3)))
    with torch.no_grad():
        scorer.query.copy_(torch.randn(scorer.query.shape, generator=gen))
        scorer.code_scale.copy_(torch.rand(scorer.code_scale.shape, generator=gen) * 0.05 + 0.01)
    codes = torch.randint(-127, 128, (batch, 2, 4, tokens), dtype=torch.int8, generator=gen)
    codes[0, 0, :, tokens // 2] = 127
    queries = torch.randn(batch, 2, 3 * new, 16, generator=gen)
    kernel = scorer.page_log_mass(queries, codes, 3, page)
    expected = scorer.page_shares(queries, codes, 3, page).clamp(min=torch.finfo(torch.float32).tiny).log()
    assert kernel.shape == (batch, 2, -(-tokens // page))
    torch.testing.assert_close(kernel.exp(), expected.exp(), atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(kernel.exp().sum(-1), torch.ones(batch, 2))
