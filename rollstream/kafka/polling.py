"""A kafka-python consumer polled by a thread of its own, so records are read while their owner is
busy elsewhere (the trainer trains a step, fetches payloads or commits a batch).

kafka-python's consumer is not thread-safe, so the consumer is used by one thread at a time: the
poller between its polls, the owner inside ``with poller.paused() as consumer:``. While paused,
no poll is in flight and no record is added, so what the owner drains then is everything the
consumer has read: the consumer's positions are exactly past the records drained (what a commit
of "everything read so far" needs).

Records wait in memory until the owner takes them; the poller stops polling while
``max_buffered`` records are waiting (the consumer then reads no further ahead of its owner).
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Iterator

from rollstream.runtime import now_ms

POLL_TIMEOUT_MS = 20  # the longest an owner waits in ``paused()`` for a poll to end
MAX_BUFFERED = 10_000


class ConsumerPoller:
    """Poll ``consumer`` in a daemon thread named ``name``; hand the records over as
    ``(record, arrived_ms)`` pairs (``arrived_ms``: epoch ms when its poll returned).

    An exception raised by ``poll`` ends the thread and is raised again by the owner's next
    ``take``.
    """

    def __init__(self, consumer, name: str, max_records: int, max_buffered: int = MAX_BUFFERED) -> None:
        self.consumer = consumer
        self.max_records = max_records
        self.max_buffered = max_buffered
        self._records: deque = deque()
        self._cv = threading.Condition()
        self._pauses = 0  # owners inside paused()
        self._polling = False
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Records read and not taken yet."""
        with self._cv:
            return len(self._records)

    def take(self, timeout_s: float) -> list[tuple[object, int]]:
        """The records read so far, oldest first; waits up to ``timeout_s`` for the first one.
        Raises what ``poll`` raised in the thread."""
        with self._cv:
            self._cv.wait_for(lambda: self._records or self._error is not None or self._stopping, timeout_s)
            if self._error is not None:
                raise self._error
            return self._drain()

    @contextmanager
    def paused(self) -> Iterator[object]:
        """The consumer, for the owner's use alone while the block runs (no poll is in flight).
        ``drain()`` inside the block returns every record read up to the consumer's positions."""
        with self._cv:
            self._pauses += 1
            self._cv.wait_for(lambda: not self._polling)
        try:
            yield self.consumer
        finally:
            with self._cv:
                self._pauses -= 1
                self._cv.notify_all()

    def drain(self) -> list[tuple[object, int]]:
        """The records read so far, without waiting; inside ``paused()``, all of them."""
        with self._cv:
            return self._drain()

    def close(self) -> None:
        """Stop the thread (it ends its poll in flight first); the consumer is the owner's to close."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()

    def _drain(self) -> list[tuple[object, int]]:
        out = list(self._records)
        self._records.clear()
        self._cv.notify_all()  # room again for the poller
        return out

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or (not self._pauses
                                                             and len(self._records) < self.max_buffered))
                if self._stopping:
                    return
                self._polling = True
            try:
                polled = self.consumer.poll(timeout_ms=POLL_TIMEOUT_MS, max_records=self.max_records)
            except BaseException as exc:  # handed to the owner: its next take raises it
                with self._cv:
                    self._polling, self._error = False, exc
                    self._cv.notify_all()
                return
            arrived = now_ms()
            with self._cv:
                self._polling = False
                for records in polled.values():
                    self._records.extend((record, arrived) for record in records)
                self._cv.notify_all()
