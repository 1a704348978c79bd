"""A packed step whose sequences read their K/V through a shared read workspace.

Blocks freed by finished sequences come back in any order, so later sequences hold non-consecutive
blocks and a layer gathers their K/V (or decodes their quantized pages) into a workspace buffer
shared by every cache of the pool. Every sequence of a step reads before any attends: each must
attend to its own K/V, not to what the next sequence's read left in the buffer.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from tiny_tokenizer import tiny_tokenizer

from kvfactory.engine import Engine, SamplingParams

CONFIGS = {"paged": {"type": "paged", "page_size": 4},
           "int8": {"type": "paged", "page_size": 4, "quantization": "int8"}}


@pytest.mark.parametrize("name", CONFIGS)
def test_sequences_of_one_step_attend_to_their_own_kv(name: str) -> None:
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (40,), generator=gen).tolist() for _ in range(12)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def run(max_num_seqs: int) -> list[list[int]]:
        engine = Engine(model, tiny_tokenizer(), CONFIGS[name], pool_tokens=4 * 44, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=4096, prefix_caching=False)
        return [output.token_ids for output in engine.generate(prompts, params)]

    assert run(max_num_seqs=4) == run(max_num_seqs=1)  # four per step (reusing freed blocks), and alone
