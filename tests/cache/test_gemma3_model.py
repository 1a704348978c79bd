"""The second packaged model, Gemma 3 270M (hybrid attention: sliding window 512 in 15 of 18 layers,
one KV head of 256 channels), loaded by its short name; the user's three lines with lossless paged
storage over a prompt longer than the window equal ``DynamicCache`` (tokens, logits within 1e-5);
the CLI takes the name."""

from __future__ import annotations

import pytest
import typer
from helpers import assert_same_generation, generate
from transformers import DynamicCache

from kvfactory import KVCacheFactory, cli, models
from kvfactory.texts import shipped_text

pytestmark = pytest.mark.slow

NAME = "gemma3-270m"


def test_the_name_loads_the_hybrid_model(gemma3) -> None:
    model, tokenizer = gemma3
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (18, 1, 256)
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17] and config.sliding_window == 512
    assert models.load_config(NAME).layer_types == config.layer_types
    assert tokenizer("The capital of France is")["input_ids"][0] == tokenizer.bos_token_id


def test_paged_storage_through_the_three_lines_equals_dynamic_cache(gemma3) -> None:
    model, tokenizer = gemma3
    ids = tokenizer(shipped_text()[:8000], return_tensors="pt")["input_ids"][:, :700]  # beyond the 512 window
    inputs = {"input_ids": ids, "attention_mask": ids.new_ones(ids.shape)}
    reference = generate(model, inputs, DynamicCache(config=model.config))
    cache = KVCacheFactory(model.config, {"type": "paged", "page_size": 16}).create_cache()
    assert_same_generation(reference, generate(model, inputs, cache))


def test_the_cli_takes_the_name() -> None:
    assert cli._model(NAME) == NAME
    with pytest.raises(typer.BadParameter, match="neither one of"):
        cli.load_config("no-such-model")
