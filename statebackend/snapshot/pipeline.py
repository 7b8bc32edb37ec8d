"""Producing a snapshot's chunks on a thread of their own, ahead of their upload.

The asynchronous part of a snapshot encodes chunks (CPU, mostly Python) and writes them
(I/O: a local write, an S3 part upload). ``prefetched`` runs the encoding on a producer
thread that keeps up to ``depth`` chunks ready in a bounded queue, so that the write of
chunk k overlaps the encoding of chunk k+1 while memory stays bounded.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class _Failed:
    """Queued by the producer when the source raised: the consumer re-raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()
"""Queued by the producer after the source's last chunk."""


class Prefetched(Generic[T]):
    """An iterator over a source's chunks, produced ahead on a thread of its own.

    Chunks come in the source's order; an exception the source raises is raised by the
    consumer's ``next`` after the chunks that came before it. ``close()`` (or leaving the
    ``with`` block) stops the producer at its next chunk boundary, closes the source (a
    generator's ``finally`` blocks run on the producer thread) and returns only once the
    producer thread has ended, so that what the source reads (a snapshot's cut) may be
    released right after. Use it as a context manager: a consumer that stops early (a
    cancelled upload) must close it, or the producer waits for room in the queue forever.
    """

    def __init__(self, source: Iterable[T], depth: int, name: str) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, not {depth}")
        self._source = iter(source)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, name=name)
        self._thread.start()

    def _produce(self) -> None:
        source, put, stop = self._source, self._queue.put, self._stop
        try:
            for chunk in source:
                if stop.is_set():
                    return
                put(chunk)
                if stop.is_set():
                    return
            put(_END)
        except BaseException as exc:  # handed to the consumer, which raises it
            # The traceback would keep the source's locals (a RocksDB iterator) alive
            # as long as the error is kept: drop them, keep the lines.
            traceback.clear_frames(exc.__traceback__)
            put(_Failed(exc))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._done = True
            raise item.error
        return cast(T, item)

    def close(self) -> None:
        """Stop the producer, close the source and wait until the producer thread ends."""
        self._done = True
        self._stop.set()
        # Make room, so that a producer blocked on a full queue sees the stop. It puts
        # at most one more item before it checks again, and there is room for that.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()

    def __enter__(self) -> Prefetched[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def prefetched(source: Iterable[T], depth: int, name: str = "statebackend-encode") -> Prefetched[T]:
    """Iterate ``source`` on a new producer thread, at most ``depth`` chunks ahead.

    ``with prefetched(chunks, 4) as ahead: write(ahead)``: see ``Prefetched``.
    """
    return Prefetched(source, depth, name)
