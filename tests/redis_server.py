"""A real ``redis-server`` on 127.0.0.1 for the tier tests: started on a free port without
persistence, killable and restartable on the same port (a dead Redis, then its return); and a
proxy in front of it that holds each reply back, as a distant Redis does."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time

import redis

from kvfactory.server.process import free_port

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


class SlowProxy:
    """A TCP proxy on 127.0.0.1 in front of ``port`` that holds back each reply (the first bytes the
    server sends after a request) ``delay_s`` seconds, then forwards it as it comes."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.upstream, self.delay_s = port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            asked = threading.Event()  # a request went up and its reply has not started yet
            threading.Thread(target=self._pipe, args=(client, server, asked, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, asked, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, asked: threading.Event, reply: bool) -> None:
        try:
            while data := source.recv(1 << 20):
                if not reply:
                    asked.set()
                elif asked.is_set():
                    asked.clear()
                    time.sleep(self.delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                end.close()

    def close(self) -> None:
        self.listener.close()
