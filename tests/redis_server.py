"""A real ``redis-server`` on 127.0.0.1 for the tier tests: started on a free port without
persistence, killable and restartable on the same port (a dead Redis, then its return)."""

from __future__ import annotations

import shutil
import subprocess
import time

import redis
from helpers import free_port

START_TIMEOUT = 20.0


class RedisServer:
    def __init__(self, maxmemory: str = "64mb") -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise RuntimeError("redis-server (or valkey-server) is not installed: `make test` installs "
                               "Debian's redis-server, or install Redis / Valkey yourself")
        self.binary, self.maxmemory = binary, maxmemory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, as a crashed Redis does."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def flush(self) -> None:
        redis.Redis.from_url(self.url).flushall()
