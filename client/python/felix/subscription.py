"""Follow one shard record by record."""

import time
from collections import deque
from typing import TYPE_CHECKING, Deque, Iterator, Optional, Union

from .errors import ProtocolError
from .types import ReadBatch, Record, StartPosition, StreamRef

if TYPE_CHECKING:
    from datetime import timedelta

    from .client import Client
    from .cluster import ClusterClient

__all__ = ["Subscription"]

#: An empty answer faster than this means the broker did not wait: pause
#: before asking again rather than spin.
_TOO_FAST = 0.020
_EMPTY_PAUSE = 0.050
#: Pause after a failed read before the next one: the client's initial
#: reconnect backoff, but at least this (as in the Rust client).
_MIN_ERROR_PAUSE = 0.100


def check_batch(from_offset: Optional[int], batch: ReadBatch) -> ReadBatch:
    """A read's answer must move forward from where it was asked to start:
    records ascending at or above it, and the next position past them.
    Anything else would repeat or skip records: :class:`ProtocolError`."""
    previous: Optional[int] = None
    for record in batch.records:
        if (from_offset is not None and record.offset < from_offset) or (
            previous is not None and record.offset <= previous
        ):
            raise ProtocolError(
                f"read answer out of order: record {record.offset} after {previous}, asked from {from_offset}"
            )
        previous = record.offset
    if (previous is not None and batch.next_offset <= previous) or (
        from_offset is not None and batch.next_offset < from_offset
    ):
        raise ProtocolError(
            f"read answer's next offset {batch.next_offset} does not move past its records "
            f"(last {previous}, asked from {from_offset})"
        )
    return batch


class Subscription(Iterator[Record]):
    """An endless iterator over one shard's records in offset order,
    long-polling the broker at the tail. Made by :meth:`Client.subscribe`
    (or :meth:`ClusterClient.subscribe`).

    ``next()`` blocks until a record is available. A failed read raises its
    error from ``next()``; calling ``next()`` again retries from the same
    position after a short pause, so a loop that catches and continues rides
    out a broker restart (the pause is the client's
    ``reconnect_backoff_initial``, at least 100 ms). Not thread-safe: use one
    per thread.
    """

    def __init__(
        self,
        client: Union["Client", "ClusterClient"],
        stream: StreamRef,
        shard: int,
        start: StartPosition,
        max_records: int,
        wait: Union[float, "timedelta"],
    ) -> None:
        """Use :meth:`Client.subscribe` or :meth:`ClusterClient.subscribe`."""
        self._client = client
        self._stream = stream
        self._shard = shard
        self._position = start
        self._max_records = max_records
        self._wait = wait
        self._buffered: Deque[Record] = deque()
        self._pause_until = 0.0
        self._skipped = 0

    @property
    def position(self) -> StartPosition:
        """Where the next read will start. Records fetched but not yet
        returned are below it."""
        return self._position

    @property
    def skipped_by_retention(self) -> int:
        """How many offsets retention removed before this subscription read them."""
        return self._skipped

    def __iter__(self) -> "Subscription":
        return self

    def __next__(self) -> Record:
        while not self._buffered:
            self._fetch()
        return self._buffered.popleft()

    def _fetch(self) -> None:
        time.sleep(max(self._pause_until - time.monotonic(), 0))
        from_offset = self._position.offset
        started = time.monotonic()
        try:
            batch = check_batch(
                from_offset,
                self._client.read(
                    self._stream, self._shard, self._position, max_records=self._max_records, wait=self._wait
                ),
            )
        except Exception:
            pause = max(float(self._client.config.reconnect_backoff_initial), _MIN_ERROR_PAUSE)
            self._pause_until = time.monotonic() + pause
            raise
        if from_offset is not None and batch.start_offset > from_offset:
            self._skipped += batch.start_offset - from_offset
        self._position = StartPosition.at(batch.next_offset)
        if not batch.records and time.monotonic() - started < _TOO_FAST:
            self._pause_until = time.monotonic() + _EMPTY_PAUSE
        self._buffered.extend(batch.records)
