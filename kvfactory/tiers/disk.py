"""Chunks as files on local disk: written atomically, least recently used deleted beyond a budget."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

from kvfactory.errors import ConfigError
from kvfactory.tiers.base import Tier

logger = logging.getLogger("kvfactory.tiers")
SUFFIX = ".safetensors"  # a chunk's bytes are a safetensors file (kvfactory.tiers.chunk)


class DiskTier(Tier):
    """One file per key in ``path``, named by the key's SHA-256. A write goes to a temporary file in
    the same folder, is flushed to disk and renamed over the target, so a crash leaves a whole
    chunk or none (temporaries a killed write left are removed when a tier opens the folder).
    Beyond ``capacity_bytes`` the least recently used files are deleted; files an earlier process
    wrote are found again, oldest first by modification time, and a hit refreshes a file's time.
    A write the disk refuses (full, read-only) is dropped and counted in ``stats.errors``."""

    name = "disk"

    def __init__(self, path: str | Path, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ConfigError("capacity_bytes", capacity_bytes, "an integer >= 1")
        super().__init__()
        self.path, self.capacity_bytes = Path(path), capacity_bytes
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.glob(".tmp-*"):
            stale.unlink(missing_ok=True)
        files = sorted(self.path.glob(f"*{SUFFIX}"), key=lambda f: f.stat().st_mtime)
        self._index: OrderedDict[str, int] = OrderedDict((f.name, f.stat().st_size) for f in files)
        self.used_bytes = sum(self._index.values())
        with self._lock:
            self._evict()

    def _file(self, key: str) -> Path:
        return self.path / (hashlib.sha256(key.encode()).hexdigest() + SUFFIX)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for key in keys:
            file = self._file(key)
            try:
                value = file.read_bytes()
                os.utime(file)
            except FileNotFoundError:  # never written, evicted, or deleted by another process
                value = None
            values.append(value)
            with self._lock:
                if value is None:
                    self.used_bytes -= self._index.pop(file.name, 0)
                else:
                    self.used_bytes += len(value) - self._index.pop(file.name, 0)
                    self._index[file.name] = len(value)
        return values

    def _put_many(self, items: list[tuple[str, bytes]]) -> None:
        for key, value in items:
            if len(value) > self.capacity_bytes:
                self.stats.dropped += 1
                continue
            file = self._file(key)
            try:
                self._write(file, value)
            except OSError as exc:
                logger.warning("disk tier %s: dropped a %d-byte write: %s", self.path, len(value), exc)
                with self._lock:
                    self.stats.errors += 1
                    self.stats.dropped += 1
                continue
            with self._lock:
                self.used_bytes += len(value) - self._index.pop(file.name, 0)
                self._index[file.name] = len(value)
                self._took(value)
                self._evict()

    def _write(self, file: Path, value: bytes) -> None:
        handle, temporary = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(value)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, file)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def _evict(self) -> None:
        while self.used_bytes > self.capacity_bytes and self._index:
            name, size = self._index.popitem(last=False)
            (self.path / name).unlink(missing_ok=True)
            self.used_bytes -= size
            self.stats.evictions += 1

    def _contains_many(self, keys: list[str]) -> list[bool]:
        return [self._file(key).exists() for key in keys]

    def _discard_many(self, keys: list[str]) -> None:
        for key in keys:
            file = self._file(key)
            file.unlink(missing_ok=True)
            with self._lock:
                self.used_bytes -= self._index.pop(file.name, 0)
