"""Packed weights for the engine's steps (``kvfactory.engine.weights``): the same products, the model's own
parameters, state dict and ties, a repack after an in-place change, the model's path elsewhere."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompt, tiny_model

from kvfactory.engine.weights import PackedLinear, pack_linear_weights, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN linear ops")


def test_packed_linear_layers_compute_the_same_products_for_every_row_count() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40)
    expected = {rows: linear(torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows)))
                for rows in (0, 1, 3, 4, 8, 32, 33, 70, 512)}
    model = torch.nn.Sequential(linear)
    assert pack_linear_weights(model) > 0 and type(linear) is PackedLinear
    with torch.no_grad():
        for rows, want in expected.items():
            got = linear(torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows)))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    x = torch.randn(2, 5, 48)  # [batch, tokens, features]
    with torch.no_grad():
        torch.testing.assert_close(linear(x), x @ linear.weight.T + linear.bias, atol=1e-5, rtol=1e-5)


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
