"""Tiny random-weight models of several architectures, built in-process (nothing is downloaded).

One row per architecture: ``(id, model_type, config kwargs)``. Every model has 2 layers, hidden 64,
4 query heads and 2 KV heads (GQA) where the architecture allows; ``llama-mqa`` has one KV head,
GPT-2 is multi-head only, and Mistral's ``sliding_window`` is smaller than the test prompts so the
window rule is exercised. ``gemma3`` is hybrid as Gemma 3 is: a sliding-window layer (window 8) then
a full-attention one, one KV head, each layer type with its own rotary base.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 256
PAD, BOS, EOS = 0, 1, 2
PROMPT_LEN = 20  # longer than Mistral's window below
MISTRAL_WINDOW = 8
GEMMA3_WINDOW = 8
GEMMA3_LAYERS = ("sliding_attention", "full_attention")
TINY_HIDDEN = 64  # 2 KV heads of 16 dims where the architecture has GQA

_COMMON = dict(vocab_size=VOCAB, hidden_size=TINY_HIDDEN, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)

TINY_MODELS: list[tuple[str, str, dict]] = [
    ("llama", "llama", _COMMON),
    ("llama-mqa", "llama", _COMMON | {"num_key_value_heads": 1}),
    ("qwen2", "qwen2", _COMMON),
    ("mistral-sw8", "mistral", _COMMON | {"sliding_window": MISTRAL_WINDOW}),
    ("phi3", "phi3", _COMMON),
    ("gpt2", "gpt2", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                          pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)),
    ("gemma", "gemma", _COMMON | {"head_dim": 16}),
    ("gemma3", "gemma3_text", _COMMON | {"head_dim": 16, "num_key_value_heads": 1,
                                         "query_pre_attn_scalar": 16, "sliding_window": GEMMA3_WINDOW,
                                         "layer_types": list(GEMMA3_LAYERS)}),
]
TINY_IDS = [row[0] for row in TINY_MODELS]
_ROWS = {row[0]: row for row in TINY_MODELS}


def tiny_config(name: str, **overrides):
    """The transformers config of table row ``name`` (``overrides`` replace its kwargs)."""
    _, model_type, kwargs = _ROWS[name]
    return AutoConfig.for_model(model_type, **(kwargs | overrides))


@functools.cache
def _build(name: str, overrides: tuple) -> torch.nn.Module:
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **dict(overrides)))
    return model.float().eval()


def tiny_model(name: str, **overrides) -> torch.nn.Module:
    """A seeded random fp32 model in eval mode (built once per process and kwargs)."""
    return _build(name, tuple(sorted(overrides.items())))


def random_prompt(length: int, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` token ids that avoid the special tokens."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(EOS + 1, VOCAB, (1, length), generator=gen)


def left_padded_batch(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of prompts of ``lengths``, padded on the left."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = random_prompt(n, seed + row)[0]
        mask[row, width - n:] = 1
    return {"input_ids": ids, "attention_mask": mask}
