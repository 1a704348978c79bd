"""``kvfactory.roofline``: a model's FLOPs per token as torch's FLOP counter counts them, the keys a
sliding window lets a token read, and the positions each engine step computed (a prefix hit's
tokens are not computed again)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import GEMMA3_WINDOW, random_prompt, tiny_config, tiny_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from kvfactory.engine import Engine, SamplingParams
from kvfactory.roofline import _keys_through, gemm_rate, model_cost, read_rate


@pytest.mark.parametrize("name", ["llama", "gemma3", "phi3"])
def test_linear_and_head_flops_are_what_torch_counts(name: str) -> None:
    """torch's count of an eager forward's matrix products, less attention's scores and weighted values
    over the whole square that eager attention computes, is ``tokens * (linear_flops + head_flops)``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(name), attn_implementation="eager").eval()
    cost = model_cost(model)
    tokens = 24
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(random_prompt(tokens, seed=3)[0][None], use_cache=False)
    config = model.config.get_text_config(decoder=True)
    square = config.num_hidden_layers * tokens * tokens * cost.key_flops  # eager: every key, masked or not
    assert counter.get_total_flops() - square == tokens * (cost.linear_flops + cost.head_flops)
    assert cost.weight_bytes == sum(m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)
                                    for m in {id(m.weight): m for m in model.modules()
                                              if isinstance(m, torch.nn.Linear)}.values())


def test_a_sliding_window_caps_the_keys_each_token_reads() -> None:
    for window in (None, 1, 5, 8):
        for n in range(20):
            assert _keys_through(n, window) == sum(p + 1 if window is None else min(p + 1, window)
                                                   for p in range(n))
    cost = model_cost(tiny_model("gemma3"))
    assert dict(cost.windows) == {GEMMA3_WINDOW: 1, None: 1}
    keys = sum(p + 1 for p in range(10, 30)) + sum(min(p + 1, GEMMA3_WINDOW) for p in range(10, 30))
    assert cost.prefill_flops(10, 30) == 20 * cost.linear_flops + keys * cost.key_flops
    assert cost.prefill_flops(30, 30) == 0


def test_the_engine_reports_the_positions_each_step_computed() -> None:
    """Chunked prefills of 7 tokens, then one token per decode step; a second request sharing the
    first one's 16-token prefix computes from the first block it does not find in the prefix cache."""
    model = tiny_model("llama")
    prefix = random_prompt(16, seed=7)[0].tolist()
    engine = Engine(model, None, {"type": "paged", "page_size": 4}, pool_tokens=256, max_num_batched_tokens=7)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request(prefix + [5, 6], params)
    spans = []
    while engine.has_unfinished():
        engine.step()
        spans.append((engine.computed_spans, engine.logit_rows))
    assert spans == [([(0, 7)], 0), ([(7, 14)], 0), ([(14, 18)], 1), ([(18, 19)], 1), ([(19, 20)], 1)]
    engine.add_request(prefix + [9, 10, 11], params)
    engine.step()
    assert engine.computed_spans == [(16, 19)] and engine.logit_rows == 1


def test_the_measured_ceilings_are_rates() -> None:
    model = tiny_model("llama")
    assert gemm_rate(model, rows=8, runs=1) > 0
    assert read_rate(2**22, runs=1) > 0
