"""Waiting for a server started as a subprocess: a free local port to give it, and its ``/health``.

What scripts and tests that start ``kvfactory serve`` (or vLLM's OpenAI server) need before their
first request: the server is ready once ``GET /health`` answers 200; a process that exits first, or
a deadline passed, is an error that carries the tail of its log.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx2


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float, interval: float = 0.25
                 ) -> None:
    """Return once ``{url}/health`` answers 200; ``RuntimeError`` with the log's tail if ``process``
    exits first or ``timeout`` seconds pass (the process is then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:4]} exited with {process.returncode}:\n{_tail(log)}")
        try:
            if httpx2.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        time.sleep(interval)
    process.kill()
    raise RuntimeError(f"{process.args[:4]} was not ready in {timeout:.0f} s:\n{_tail(log)}")


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:]
