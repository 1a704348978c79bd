"""Tiers nearest first (host, then disk, then Redis), read in order with promotion on a hit."""

from __future__ import annotations

from kvfactory.errors import ConfigError
from kvfactory.tiers.base import Tier


class TierChain(Tier):
    """``tiers`` nearest first. A read asks each tier only for the keys the tiers before it missed,
    and copies what a farther tier found into the nearer ones (promotion: the next read of it is
    local). A write goes to every tier, so processes that share the farther tiers (a disk folder,
    a Redis server) find it too."""

    name = "chain"

    def __init__(self, tiers: list[Tier]) -> None:
        if not tiers:
            raise ConfigError("tiers", tiers, "at least one tier")
        super().__init__()
        self.tiers = list(tiers)

    @classmethod
    def from_spec(cls, specs: list[str], host_bytes: int = 4 << 30, disk_bytes: int = 64 << 30) -> TierChain:
        """A chain from strings, nearest first: ``"host"`` (``host_bytes`` of memory),
        ``"disk:PATH"`` (``disk_bytes`` in folder PATH), ``"redis://HOST:PORT/DB"`` (a Redis or Valkey
        server), as a connector's or a server's configuration names them."""
        from kvfactory.tiers.disk import DiskTier
        from kvfactory.tiers.host import HostTier
        from kvfactory.tiers.redis_tier import RedisTier

        tiers: list[Tier] = []
        for spec in specs:
            if spec == "host":
                tiers.append(HostTier(host_bytes))
            elif spec.startswith("disk:"):
                tiers.append(DiskTier(spec.removeprefix("disk:"), disk_bytes))
            elif spec.startswith(("redis://", "rediss://", "unix://")):
                tiers.append(RedisTier(spec))
            else:
                raise ConfigError("tiers", spec, '"host", "disk:PATH" or "redis://HOST:PORT/DB"')
        return cls(tiers)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        found: list[bytes | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for depth, tier in enumerate(self.tiers):
            if not missing:
                break
            values = tier.get_many([keys[i] for i in missing])
            hits = [(keys[i], value) for i, value in zip(missing, values, strict=True) if value is not None]
            for nearer in self.tiers[:depth]:
                nearer.put_many(hits)
            for i, value in zip(missing, values, strict=True):
                found[i] = value
            missing = [i for i, value in zip(missing, values, strict=True) if value is None]
        return found

    def _put_many(self, items: list[tuple[str, bytes]]) -> None:
        for tier in self.tiers:
            tier.put_many(items)
        with self._lock:
            for _, value in items:
                self._took(value)

    def _discard_many(self, keys: list[str]) -> None:
        for tier in self.tiers:
            tier.discard_many(keys)

    def _contains_many(self, keys: list[str]) -> list[bool]:
        held = [False] * len(keys)
        for tier in self.tiers:
            missing = [i for i, h in enumerate(held) if not h]
            if not missing:
                break
            for i, h in zip(missing, tier.contains_many([keys[i] for i in missing]), strict=True):
                held[i] = h
        return held
