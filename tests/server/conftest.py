"""The ``start_server`` fixture of the server tests (the helpers are in ``tests/servers.py``: test modules
import from there, never from a conftest, whose name the root conftest shares)."""

from __future__ import annotations

import pytest
from servers import ServerProcess


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """``start_server(*args)``: a running server; every one left running is stopped at the end."""
    servers: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(tmp_path_factory.mktemp("serve") / "server.log", *args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        if server.process.poll() is None:
            server.stop()
