"""Running the app under uvicorn, with a SIGTERM that lets requests finish, then aborts them.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits for the open ones; first the
engine stops taking requests and gives those in flight ``shutdown_timeout`` seconds before it aborts
them (``AsyncEngine.drain``), so every stream still ends well-formed (``finish_reason: "abort"``,
``data: [DONE]``) and uvicorn has nothing to cancel. Then the lifespan stops the engine thread and
logs the pool. uvicorn raises the signal again once it is done; the handler installed here turns
that into exit status 0.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

BACKSTOP = 5.0  # seconds beyond shutdown_timeout before uvicorn cancels what is still running


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._on_exit()
        super().handle_exit(sig, frame)


def run(app: FastAPI, host: str, port: int, shutdown_timeout: float, log_level: str = "info") -> None:
    """Serve ``app`` (from ``create_app``) until SIGTERM or Ctrl-C."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + BACKSTOP)
    server = _Server(config, lambda: app.state.runner.drain(shutdown_timeout))
    signal.signal(signal.SIGTERM, _exit)
    server.run()


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
