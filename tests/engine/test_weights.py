"""Packed weights for the engine's steps (``kvfactory.engine.weights``): the same products in panels and
in oneDNN's layout, the layout chosen by what the kernel and torch's threads allow, many rows through
the row-major GEMM where it was timed faster, the model's own parameters, state dict and ties, a
repack after an in-place change, the model's path elsewhere."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompt, tiny_model

from kvfactory import kernels
from kvfactory.engine import weights
from kvfactory.engine.weights import (
    GEMM_ROWS,
    PackedLinear,
    gemm_is_faster,
    pack_linear_weights,
    pack_weight,
    packing_available,
    panels_fit,
)

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN linear ops")
PANEL_KERNEL = bool((lib := kernels.load("linear")) and lib.linear_has_body())


@pytest.mark.parametrize("outputs", [40, 64, 96])  # 40: not whole panels of 32, so oneDNN's layout
def test_packed_linear_layers_compute_the_same_products_for_every_row_count(outputs: int) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, outputs)
    expected = {rows: linear(torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows)))
                for rows in (0, 1, 3, 4, 8, 9, 16, 17, 32, 33, 70, 512)}
    model = torch.nn.Sequential(linear)
    assert pack_linear_weights(model) > 0 and type(linear) is PackedLinear
    assert linear.packed.panels == (PANEL_KERNEL and outputs % 32 == 0)
    with torch.no_grad():
        for rows, want in expected.items():
            got = linear(torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows)))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    x = torch.randn(2, 5, 48)  # [batch, tokens, features]
    with torch.no_grad():
        torch.testing.assert_close(linear(x), x @ linear.weight.T + linear.bias, atol=1e-5, rtol=1e-5)
        rows = x.transpose(0, 1)  # not contiguous
        torch.testing.assert_close(linear(rows), rows @ linear.weight.T + linear.bias, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not PANEL_KERNEL, reason="kernels/linear.c has no AVX-512 body on this CPU")
def test_panels_are_chosen_on_one_thread_with_the_kernel_body_only(monkeypatch) -> None:
    """More threads: oneDNN's layout, which spreads over them; a build without AVX-512 has no body (its
    ``rows_linear`` computes nothing and says so), so oneDNN's layout again."""
    weight = torch.randn(64, 48)
    assert torch.get_num_threads() == 1 and panels_fit(weight) and pack_weight(weight).panels
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not panels_fit(weight) and not pack_weight(weight).panels
    monkeypatch.undo()
    avx2 = kernels.load("linear", ("-mno-avx512f",))
    out = torch.zeros(1, 64)
    assert avx2.linear_has_body() == 0
    assert avx2.rows_linear(M=1, N=64, K=48, x=torch.ones(1, 48).data_ptr(), xs=48, w=weight.data_ptr(),
                            bias=None, out=out.data_ptr(), os=64) == 0
    monkeypatch.setattr(kernels, "load", lambda name, extra=(): avx2)
    assert not panels_fit(weight) and not pack_weight(weight).panels
    assert not panels_fit(torch.randn(64, 48, dtype=torch.float64))


def test_a_weight_changed_in_place_is_packed_again_and_gradients_take_the_model_path() -> None:
    linear = torch.nn.Linear(16, 8, bias=False)
    pack_linear_weights(torch.nn.Sequential(linear))
    x = torch.randn(8, 16)
    with torch.no_grad():
        linear.weight.mul_(2.0)
        torch.testing.assert_close(linear(x), x @ linear.weight.T, atol=1e-5, rtol=1e-5)
    out = linear(x)  # gradients enabled, a trainable weight: the unpacked path, differentiable
    out.sum().backward()
    assert linear.weight.grad is not None


def test_a_packed_model_keeps_its_state_dict_ties_and_outputs() -> None:
    model = tiny_model("llama", tie_word_embeddings=True)
    keys = list(model.state_dict())
    prompt = random_prompt(12)
    with torch.no_grad():
        before = model(prompt).logits
        assert pack_linear_weights(model) > 0
        assert pack_linear_weights(model) == 0  # packed once
        after = model(prompt).logits
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.lm_head) is PackedLinear
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not PANEL_KERNEL, reason="kernels/linear.c has no AVX-512 body on this CPU")
@pytest.mark.parametrize("gemm_faster", [True, False])
def test_many_rows_take_the_gemm_where_it_was_timed_faster(monkeypatch, gemm_faster: bool) -> None:
    """A weight whose shape the GEMM multiplied faster takes it from ``GEMM_ROWS`` rows on, and panels
    below; one where the panels won takes them for every row count; the products agree either way."""
    assert isinstance(gemm_is_faster(64, 48), bool)
    monkeypatch.setattr(weights, "gemm_is_faster", lambda outputs, inputs: gemm_faster)
    linear = torch.nn.Linear(48, 64)
    pack_linear_weights(torch.nn.Sequential(linear))
    assert linear.packed.panels and linear.packed.gemm_rows == (GEMM_ROWS if gemm_faster else None)
    calls, panels = [], weights.panel_linear
    monkeypatch.setattr(weights, "panel_linear", lambda *args: calls.append(args) or panels(*args))
    for rows in (1, 8, GEMM_ROWS - 1, GEMM_ROWS, 512):
        x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            torch.testing.assert_close(linear(x), x @ linear.weight.T + linear.bias, atol=1e-5, rtol=1e-5)
        assert len(calls) == (0 if gemm_faster and rows >= GEMM_ROWS else 1), rows
        calls.clear()
