"""One small ``kvfactory eval`` pipeline on the tiny random Llama, run once per test process."""

from __future__ import annotations

import functools
import importlib.util

from tiny_models import tiny_model
from tiny_tokenizer import VOCAB, tiny_tokenizer

from kvfactory.eval.data import Corpus
from kvfactory.eval.runner import resolve_caches, run_eval
from kvfactory.eval.settings import EvalSettings
from kvfactory.texts import shipped_text

CONTEXTS = (400, 600)
TASKS = ("ppl", "passkey", "needle", "multiturn")
# head_dim 64 as SmolLM2's: quanto's groups of 64 must divide the quantized axis
MODEL_KWARGS = dict(vocab_size=VOCAB, max_position_embeddings=4096, head_dim=64)
QUEST = ('{"type": "composite", "strategies": [{"name": "paged", "page_size": 16}, '
         '{"name": "quest", "read_budget": 0.25, "dense_layers": 0, "shadow_every": 1}]}')
CACHES = ["dense", '{"type": "paged", "page_size": 16}', "transformers/sliding-window-64",
          '{"type": "dense", "quantization": {"codec": "int8", "residual": 16}}', QUEST]
if importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None:
    CACHES.append("transformers/quanto-int4")
if importlib.util.find_spec("hqq") is not None:
    CACHES.append("transformers/hqq-int2")


SETTINGS = EvalSettings(contexts=CONTEXTS, depths=(0.2, 0.8), ppl_continuation=8, facts=1)


def corpus() -> Corpus:
    return Corpus(shipped_text(), "shipped excerpt")


@functools.cache
def pipeline_results() -> dict:
    model = tiny_model("llama", **MODEL_KWARGS)
    model.set_attn_implementation("kvfactory")  # selectors read pages inside kvfactory's attention
    units: list = []
    results = run_eval(model, tiny_tokenizer(), resolve_caches(CACHES), TASKS, SETTINGS, corpus(),
                       on_unit=lambda unit, done: units.append((unit, done)))
    return results | {"command": "kvfactory eval (test)", "model": "tiny llama", "started": "now",
                      "wall_s": 1.5, "_units": units}
