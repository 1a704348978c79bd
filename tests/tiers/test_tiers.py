"""Host, disk and Redis tiers behind one interface, and their chain: budgets evict least recently
used values, disk writes are atomic and survive a new process, a real Redis server serves batches
and its death costs misses (never an exception) until it returns, and a chain promotes hits."""

from __future__ import annotations

import os
import signal
import time

import pytest
from redis_server import RedisServer

from kvfactory.errors import ConfigError
from kvfactory.tiers import DiskTier, HostTier, RedisTier, TierChain


def values(n: int, size: int = 40) -> list[tuple[str, bytes]]:
    return [(f"key{i}", bytes([i]) * size) for i in range(n)]


def test_host_tier_evicts_least_recently_used_within_its_budget() -> None:
    tier = HostTier(100)
    tier.put_many(values(2))
    assert tier.get("key0") == bytes([0]) * 40  # key0 is now the most recently used
    tier.put("key2", bytes([2]) * 40)
    assert tier.contains_many(["key0", "key1", "key2"]) == [True, False, True]
    assert tier.used_bytes == 80 and tier.stats.evictions == 1
    tier.put("huge", b"x" * 101)  # larger than the whole budget: dropped, nothing else evicted
    assert tier.get("huge") is None and len(tier) == 2 and tier.stats.dropped == 1
    stats = tier.stats.as_dict()
    assert (stats["hits"], stats["misses"], stats["writes"], stats["bytes_written"]) == (1, 1, 3, 120)


@pytest.mark.parametrize("budget", [0, -1, True, 1.5])
def test_budgets_must_be_positive_integers(budget, tmp_path) -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        HostTier(budget)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        DiskTier(tmp_path, budget)


def test_disk_tier_survives_a_new_process_and_evicts_oldest(tmp_path) -> None:
    tier = DiskTier(tmp_path, 100)
    tier.put_many(values(2))
    assert not list(tmp_path.glob(".tmp-*"))  # every write was renamed into place
    (tmp_path / ".tmp-left-by-a-killed-write").write_bytes(b"half")
    again = DiskTier(tmp_path, 100)  # another process opening the same folder
    assert not list(tmp_path.glob(".tmp-*"))
    assert again.get_many(["key0", "key1", "nope"]) == [bytes([0]) * 40, bytes([1]) * 40, None]
    again.get("key0")
    again.put("key2", bytes([2]) * 40)  # key1 is now the least recently used
    assert again.contains_many(["key0", "key1", "key2"]) == [True, False, True]
    assert again.used_bytes == 80 and len(list(tmp_path.glob("*.safetensors"))) == 2


def test_disk_tier_drops_a_write_the_disk_refuses(tmp_path, monkeypatch) -> None:
    tier = DiskTier(tmp_path, 1000)

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    tier.put("key0", b"abc")
    assert tier.get("key0") is None and tier.stats.errors == 1 and tier.stats.dropped == 1
    assert not list(tmp_path.iterdir())  # no temporary left behind


def test_redis_tier_reads_and_writes_batches(redis_url: str) -> None:
    tier = RedisTier(redis_url)
    tier.put_many(values(5, size=1000))
    assert tier.get_many(["key4", "missing", "key0"]) == [bytes([4]) * 1000, None, bytes([0]) * 1000]
    assert tier.contains_many(["key1", "missing"]) == [True, False]
    assert tier.stats.writes == 5 and tier.stats.hits == 2 and tier.stats.misses == 1
    assert RedisTier(redis_url).get("key3") == bytes([3]) * 1000  # another client, as another process


def test_redis_tier_expires_values_after_their_ttl(redis_url: str) -> None:
    tier = RedisTier(redis_url, ttl_s=0.05)
    tier.put("key0", b"v")
    assert tier.client.pttl("key0") > 0


def test_a_stalled_redis_costs_a_miss_after_the_read_timeout(redis_server: RedisServer) -> None:
    redis_server.flush()
    tier = RedisTier(redis_server.url, read_timeout_s=0.3, retry_s=0.2)
    tier.put("key0", b"before")
    redis_server.process.send_signal(signal.SIGSTOP)  # alive, connected, never answering
    try:
        began = time.monotonic()
        assert tier.get("key0") is None
        assert 0.3 <= time.monotonic() - began < 3 and tier.stats.errors == 1
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    time.sleep(0.2)  # retry_s
    assert tier.get("key0") == b"before"


def test_a_dead_redis_costs_misses_until_it_returns(redis_server: RedisServer) -> None:
    redis_server.flush()
    tier = RedisTier(redis_server.url, timeout_s=0.5, retry_s=0.2)
    tier.put("key0", b"before")
    redis_server.kill()
    assert tier.get("key0") is None  # unreachable: a miss, not an exception
    assert not tier.reachable and tier.stats.errors == 1
    tier.put("key1", b"during")  # dropped while the tier waits out retry_s
    assert tier.stats.dropped == 1 and tier.get("key1") is None
    redis_server.start()  # an empty server on the same port
    time.sleep(0.2)  # retry_s
    assert tier.get("key0") is None  # the old values died with the server
    tier.put("key1", b"after")
    assert tier.get("key1") == b"after" and tier.reachable


def test_chain_promotes_hits_and_writes_every_tier(tmp_path, redis_url: str) -> None:
    host, disk, shared = HostTier(10_000), DiskTier(tmp_path, 10_000), RedisTier(redis_url)
    chain = TierChain([host, disk, shared])
    chain.put("both", b"1")
    assert host.get("both") == disk.get("both") == shared.get("both") == b"1"
    RedisTier(redis_url).put("remote", b"2")  # written by another process
    assert chain.get_many(["remote", "nowhere"]) == [b"2", None]
    assert host.contains_many(["remote"]) == [True] and disk.contains_many(["remote"]) == [True]
    assert chain.contains_many(["remote", "nowhere"]) == [True, False]
    assert chain.stats.hits == 1 and chain.stats.misses == 1
    with pytest.raises(ConfigError, match="tiers"):
        TierChain([])


def test_chain_from_spec_builds_tiers_nearest_first_and_discards_everywhere(tmp_path, redis_url: str) -> None:
    chain = TierChain.from_spec(["host", f"disk:{tmp_path}", redis_url], host_bytes=1000, disk_bytes=1000)
    assert [tier.name for tier in chain.tiers] == ["host", "disk", "redis"]
    assert chain.tiers[0].capacity_bytes == 1000 and chain.tiers[1].path == tmp_path
    chain.put_many([("bad", b"x" * 100), ("good", b"y" * 100)])
    chain.discard_many(["bad", "never-stored"])
    assert [tier.contains_many(["bad", "good"]) for tier in chain.tiers] == [[False, True]] * 3
    assert chain.tiers[0].used_bytes == chain.tiers[1].used_bytes == 100
    with pytest.raises(ConfigError, match="tiers"):
        TierChain.from_spec(["memcached://x"])
