"""prefetched: order, failure propagation, and stopping the producer thread on close."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from statebackend.snapshot.pipeline import prefetched

WAIT = 10.0


def producer_threads(name: str) -> list[threading.Thread]:
    """Live threads of that name."""
    return [t for t in threading.enumerate() if t.name == name]


class Source:
    """A generator of chunks that records what the producer did with it."""

    def __init__(self, count: int | None = None, fail_at: int | None = None) -> None:
        self.count = count
        self.fail_at = fail_at
        self.produced = 0
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[bytes]:
        self.thread = threading.current_thread()
        try:
            n = 0
            while self.count is None or n < self.count:
                if n == self.fail_at:
                    raise RuntimeError(f"encoding failed at chunk {n}")
                self.produced = n + 1
                yield n.to_bytes(4, "big")
                n += 1
        finally:
            self.closed.set()


def test_chunks_come_in_order_from_another_thread() -> None:
    source = Source(count=1000)
    with prefetched(source, 3, name="test-order") as chunks:
        assert [int.from_bytes(c, "big") for c in chunks] == list(range(1000))
    assert source.thread is not None and source.thread is not threading.current_thread()
    assert source.closed.is_set()
    assert producer_threads("test-order") == []


def test_producer_stays_at_most_depth_chunks_ahead() -> None:
    source = Source()
    with prefetched(source, 4, name="test-depth") as chunks:
        assert next(chunks) == (0).to_bytes(4, "big")
        # 1 consumed, 4 queued and 1 produced that waits for room in the queue.
        deadline = time.monotonic() + WAIT
        while source.produced < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert source.produced == 6


def test_close_mid_stream_ends_the_producer_and_closes_the_source() -> None:
    source = Source()  # endless: only close() can end it
    chunks = prefetched(source, 2, name="test-cancel")
    for _ in range(5):
        next(chunks)
    time.sleep(0.05)  # the producer is now blocked on the full queue
    assert len(producer_threads("test-cancel")) == 1
    chunks.close()
    assert producer_threads("test-cancel") == []
    assert source.closed.is_set()  # the generator's finally ran: its resources are freed
    produced = source.produced
    time.sleep(0.05)
    assert source.produced == produced
    with pytest.raises(StopIteration):
        next(chunks)
    chunks.close()  # idempotent


def test_consumer_failure_inside_the_block_ends_the_producer() -> None:
    source = Source()
    with (
        pytest.raises(OSError, match="disk full"),
        prefetched(source, 2, name="test-consumer-fails") as chunks,
    ):
        next(chunks)
        raise OSError("disk full")
    assert producer_threads("test-consumer-fails") == []
    assert source.closed.is_set()


def test_producer_exception_fails_the_consumer_after_the_earlier_chunks() -> None:
    source = Source(fail_at=7)
    received: list[int] = []
    with (
        pytest.raises(RuntimeError, match="encoding failed at chunk 7") as info,
        prefetched(source, 3, name="test-fails") as chunks,
    ):
        for chunk in chunks:
            received.append(int.from_bytes(chunk, "big"))
    assert received == list(range(7))
    assert producer_threads("test-fails") == []
    # The traceback still names where it failed, but holds no frame's locals any more.
    frames = []
    tb = info.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    source_frames = [f for f in frames if f.f_code.co_name == "__iter__"]
    assert source_frames and all(not f.f_locals for f in source_frames)


def test_close_before_consuming_anything() -> None:
    source = Source()
    with prefetched(source, 1, name="test-early"):
        pass
    assert producer_threads("test-early") == []
    assert source.closed.is_set()


def test_close_waits_for_a_chunk_being_produced() -> None:
    """The producer is done with its source when close() returns, even mid-chunk."""
    started, finished = threading.Event(), threading.Event()

    def slow() -> Iterator[bytes]:
        started.set()
        time.sleep(0.2)
        finished.set()
        yield b"late"

    chunks = prefetched(slow(), 1, name="test-slow")
    assert started.wait(WAIT)
    chunks.close()
    assert finished.is_set()
    assert producer_threads("test-slow") == []


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        prefetched([b"x"], 0)
