"""One vLLM process (the CPU build in ``.venv-vllm``, ``make vllm-venv``) per call, for the connector's
tests: ``require_vllm()`` skips a test module where that virtualenv is not made (and fails under
``make test``, which makes it); ``run_vllm`` runs ``kvfactory.integrations.vllm_run`` on a spec."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvfactory.integrations.vllm_run import launch

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def require_vllm() -> None:
    """Call at a test module's top: skip it without vLLM's virtualenv, unless the run requires it."""
    if VLLM_PYTHON.exists():
        return
    if os.environ.get("KVFACTORY_REQUIRE_VLLM"):  # `make test` sets it after making the virtualenv
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run `make vllm-venv`")
    pytest.skip("vLLM's virtualenv is not made (`make vllm-venv`)", allow_module_level=True)


def run_vllm(tmp: Path, name: str, model: Path, max_tokens: int, **spec: Any) -> dict[str, Any]:
    """One vLLM process serving ``model`` (eager mode, which starts in seconds where compiling takes a
    minute) on ``spec``: its result (its log stays in ``tmp``)."""
    spec = {"model": str(model), "max_tokens": max_tokens, "enforce_eager": True, **spec}
    return launch(VLLM_PYTHON, spec, tmp / f"{name}.log")
