"""Serving many requests over one model and one KV pool: continuous batching (``engine.py``), the
scheduler with preemption (``scheduler.py``), sampling (``params.py``, ``sampler.py``), the packed
step (``batch.py``) and Prometheus metrics (``metrics.py``). ``kvfactory serve`` puts an
OpenAI-compatible HTTP server in front (``kvfactory.server``)."""

from kvfactory.engine.engine import AdmissionError, Engine, EngineFullError
from kvfactory.engine.params import SamplingParams
from kvfactory.engine.request import RequestOutput

__all__ = ["AdmissionError", "Engine", "EngineFullError", "RequestOutput", "SamplingParams"]
