"""``BackgroundWriter``: batches written off the caller's thread in order, a full queue drops and
counts rather than waits, a batch that fails to encode is logged and the writer goes on."""

from __future__ import annotations

import threading

import pytest

from kvfactory.tiers import BackgroundWriter, HostTier


class HeldTier(HostTier):
    """A host tier whose writes wait until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.release = threading.Event()

    def _put_many(self, items: list[tuple[str, bytes]]) -> None:
        assert self.release.wait(30)
        super()._put_many(items)


def test_batches_are_written_in_order_once_flushed() -> None:
    tier = HostTier(1 << 20)
    writer = BackgroundWriter(tier)
    assert writer.submit(2, 8, lambda: [("a", b"1"), ("b", b"1")])
    assert writer.submit(1, 8, lambda: [("a", b"2")])
    assert writer.flush(timeout=30)
    assert tier.get_many(["a", "b"]) == [b"2", b"1"] and writer.written == 3
    assert writer.pending_bytes == 0 and writer.dropped == 0


def test_a_full_queue_drops_and_counts_instead_of_waiting() -> None:
    tier = HeldTier()
    writer = BackgroundWriter(tier, max_pending_bytes=100)
    assert writer.submit(1, 60, lambda: [("first", b"x")])  # held in the tier
    assert not writer.submit(3, 60, lambda: [("second", b"x")] * 3)  # 120 bytes would wait: dropped
    assert writer.dropped == 3 and writer.pending_bytes == 60
    tier.release.set()
    assert writer.flush(timeout=30)
    assert tier.get_many(["first", "second"]) == [b"x", None]
    assert writer.submit(1, 200, lambda: [("alone", b"y")])  # a batch over the limit, with none queued
    assert writer.flush(timeout=30) and tier.get("alone") == b"y"


def test_a_batch_that_fails_is_logged_and_the_next_is_written(caplog: pytest.LogCaptureFixture) -> None:
    tier = HostTier(1 << 20)
    writer = BackgroundWriter(tier)

    def broken() -> list[tuple[str, bytes]]:
        raise ValueError("cannot encode")

    writer.submit(1, 8, broken)
    writer.submit(1, 8, lambda: [("after", b"z")])
    assert writer.flush(timeout=30)
    assert tier.get("after") == b"z" and "could not be written" in caplog.text and writer.pending_bytes == 0
