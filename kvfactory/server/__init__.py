"""``kvfactory serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

``runner.py`` gives the engine a thread of its own (``AsyncEngine``), ``protocol.py`` holds the
OpenAI request and response shapes, ``errors.py`` OpenAI-style error bodies, and ``app.py`` the
FastAPI routes (``create_app``). ``docs/serving.md`` is the reference.
"""

from kvfactory.server.app import create_app

__all__ = ["create_app"]
