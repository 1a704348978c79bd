"""Running the app under uvicorn, with a SIGTERM that lets requests finish, then aborts them.

On SIGTERM (or Ctrl-C) the engine stops taking requests: the listener stays open and new ones are
answered 503 with ``Retry-After``, while those in flight get ``shutdown_timeout`` seconds before they
are aborted (``AsyncEngine.drain``), so every stream still ends well-formed (``finish_reason:
"abort"``, ``data: [DONE]``). Once none is left, uvicorn stops as it does on a signal: it closes the
listener, waits for the open connections and runs the lifespan's end, which stops the engine thread
and logs the pool. A second signal stops uvicorn at once. uvicorn raises the signal again once it is
done; the handler installed here turns that into exit status 0.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

BACKSTOP = 5.0  # seconds beyond shutdown_timeout before uvicorn cancels what is still running


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._runner, self._shutdown_timeout = app.state.runner, shutdown_timeout
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._runner.drain(self._shutdown_timeout)
        threading.Thread(target=self._exit_when_drained, args=(sig,), name="kvfactory-drain",
                         daemon=True).start()

    def _exit_when_drained(self, sig: int) -> None:
        self._runner.drained.wait(self._shutdown_timeout + BACKSTOP)
        super().handle_exit(sig, None)  # sets should_exit, which uvicorn's main loop polls


def run(app: FastAPI, host: str, port: int, shutdown_timeout: float, log_level: str = "info") -> None:
    """Serve ``app`` (from ``create_app``) until SIGTERM or Ctrl-C."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + BACKSTOP)
    server = _Server(config, app, shutdown_timeout)
    signal.signal(signal.SIGTERM, _exit)
    server.run()


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
