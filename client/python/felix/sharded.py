"""A consumer group read across every shard of a stream: :class:`ShardedGroup`.

A group is per shard on the broker; a :class:`ShardedGroup` is the client
polling all of a stream's shards as one queue. It assigns nothing: every
``ShardedGroup`` of a group polls every shard, and the broker's one claim per
record is what divides the work between them. It mirrors the Rust client's
``felix_client::ShardedGroup``.

How it waits on several shards at once, without threads of its own: each
per-shard poll is sent on the client's pipelined connection to the shard's
core and not waited for (:meth:`Client._start_shard`). When its answer
arrives, the connection's reader thread drops a note on this group's answer
queue, and :meth:`ShardedGroup.poll` (the only reader of that queue) takes
the answer in. So the waits of every shard run concurrently, a poll can be
interrupted at any point without losing what its requests claim, and nothing
is left running once :meth:`ShardedGroup.close` returns.
"""

import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Deque, Dict, Iterable, List, Optional, Tuple, Union

from . import _wire
from .errors import Disconnected, FelixError, InvalidArgument, ProtocolError, StaleClaim
from .types import Feature, GroupInfo, GroupRecord, Header, StreamLike, StreamRef, check_int, check_name

if TYPE_CHECKING:
    from datetime import timedelta

    from .client import Client, _ShardCall

__all__ = ["ShardedGroup", "ShardedRecord"]

_log = logging.getLogger("felix")

#: How long a waiting poll lasts before it is sent again, unless
#: ``wait_slice`` says otherwise.
DEFAULT_WAIT_SLICE = 1.0
#: The shortest ``wait_slice``.
MIN_WAIT_SLICE = 0.010
#: With fewer records wanted than shards, how long each of the rotating
#: waiting polls lasts.
SHORT_WAIT_SLICE = 0.100
#: How long :meth:`ShardedGroup.close` waits for answers beyond the wait
#: the polls still out were sent with.
CLOSE_GRACE = 5.0

_MAX_WAIT = 365 * 86400.0

#: An item of the answer queue: the shard and its call, or ``None`` (a wake-up).
_Answer = Optional[Tuple[int, "_ShardCall"]]


@dataclass(frozen=True)
class ShardedRecord:
    """A record claimed through a :class:`ShardedGroup`, with the shard it came
    from (acks, nacks and extensions go to that shard's group). The record's
    fields are also readable here directly (``offset``, ``payload``, ...)."""

    shard: int
    record: GroupRecord

    @property
    def offset(self) -> int:
        return self.record.offset

    @property
    def attempts(self) -> int:
        return self.record.attempts

    @property
    def payload(self) -> bytes:
        return self.record.payload

    @property
    def key(self) -> Optional[bytes]:
        return self.record.key

    @property
    def headers(self) -> Tuple[Header, ...]:
        return self.record.headers

    @property
    def timestamp_ms(self) -> int:
        return self.record.timestamp_ms

    @property
    def skipped_before(self) -> Optional[int]:
        return self.record.skipped_before


class ShardedGroup:
    """One consumer of a consumer group on every shard of a stream. Make one
    with :meth:`Client.sharded_group`; use it as a context manager or call
    :meth:`close`.

    :meth:`poll` first claims what is available on the shards without
    waiting, starting from a different shard each time so that none is served
    before the others for ever. When none has anything and the poll may wait,
    it sends waiting polls to the shards (all in flight at once on the
    client's connections) and answers as soon as one of them brings records.

    The broker cannot take a sent poll back, so the waiting polls still out
    when the first one answers keep waiting, and what they claim later is
    kept here and handed out first by the next :meth:`poll` (:attr:`held`
    counts it). Those records' visibility timeouts run from when they were
    claimed, so keep polling. The waiting polls of one ``poll`` ask for
    ``max_records`` in all: each shard its part when there are at least as
    many records as shards; otherwise one record each on as many shards as
    records, taking turns in slices of 100 ms. Each lasts at most a
    ``wait_slice`` (a second unless set) and is sent again, no sooner, while
    the ``poll``'s own wait lasts.

    :meth:`close` waits for the polls still out (about a wait slice, at most
    5 s more) and hands back (nacks) everything claimed and not yet returned,
    so another consumer gets it at once; a handed-back record has had the
    attempt counted, as any nack does. A ``ShardedGroup`` dropped without
    ``close()`` hands nothing back: its claims lapse to the group after
    their visibility timeout.

    A ``poll`` interrupted at any point (``KeyboardInterrupt``) keeps what its
    requests claim for the next one. An error a shard answers while records
    from others are at hand is raised by the next ``poll`` that has no
    records to give.

    Acks, nacks, extensions and dead letters take the :class:`ShardedRecord`
    and go to its shard. Thread-safe: every method may be called from any
    thread; polls (and ``close``) take turns, one at a time, while acks and
    the rest run alongside them. ``close()`` from another thread ends a
    waiting ``poll`` early (it returns what it has, or nothing). Several
    ``ShardedGroup``\\ s of one group may share a :class:`Client`.
    """

    def __init__(
        self,
        client: "Client",
        stream: StreamLike,
        group: str,
        *,
        consumer: Optional[str] = None,
        reclaim: bool = False,
        visibility: Optional[Union[float, "timedelta"]] = None,
        wait_slice: Union[float, "timedelta"] = DEFAULT_WAIT_SLICE,
    ) -> None:
        """Use :meth:`Client.sharded_group`."""
        from .client import _seconds

        self._client = client
        self._stream = StreamRef.parse(stream)
        self._group = check_name("group", group)
        self._member = client._member(consumer, reclaim)
        self._visibility_ms = client._visibility_ms(visibility)
        self._wait_slice = max(min(_seconds("wait_slice", wait_slice), _MAX_WAIT), MIN_WAIT_SLICE)
        info = client.describe_stream(self._stream)
        if info.shards == 0:
            raise InvalidArgument(f"{self._stream} has no shards")
        self._shards = info.shards
        #: The broker core of each shard: shards on one core share a connection.
        self._placement = info.placement
        #: Polls take turns; the state below is only touched under it.
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._finished = False
        #: Where the next sweep (and the next rotating wait) starts.
        self._next = 0
        #: Claimed, not yet handed out; handed out before anything else.
        self._ready: Deque[ShardedRecord] = deque()
        #: An error answered while records were at hand, for the next poll with none.
        self._deferred: Optional[FelixError] = None
        #: The poll out on each shard (at most one each).
        self._out: Dict[int, "_ShardCall"] = {}
        #: No new waiting poll goes to a shard before this (its last one's
        #: slice), so waits the broker ends early are not re-sent in a loop.
        self._quiet_until = [0.0] * self._shards
        #: Answers, put by the connections' reader threads.
        self._answers: "queue.SimpleQueue[_Answer]" = queue.SimpleQueue()

    # --- what it is ----------------------------------------------------------

    @property
    def stream(self) -> StreamRef:
        return self._stream

    @property
    def group(self) -> str:
        """The group's name."""
        return self._group

    @property
    def shards(self) -> int:
        """The stream's shard count."""
        return self._shards

    @property
    def wait_slice(self) -> float:
        """How long each waiting poll lasts before it is sent again, in seconds."""
        return self._wait_slice

    @property
    def held(self) -> int:
        """Records claimed by earlier polls' waiting polls and not yet returned
        by :meth:`poll` (answers still on their way not counted)."""
        return len(self._ready)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.held} held"
        return f"<felix.ShardedGroup {self._group!r} on {self._stream} ({self._shards} shards) {state}>"

    def __enter__(self) -> "ShardedGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- polling ---------------------------------------------------------------

    def poll(self, max_records: int = 16, *, wait: Union[float, "timedelta"] = 0) -> List[ShardedRecord]:
        """Claim up to ``max_records`` records from any of the stream's shards,
        waiting up to ``wait`` seconds for one when none is available. An
        empty list means nothing was (or the group was closed meanwhile).
        Raises :class:`~felix.errors.Disconnected` once closed."""
        from .client import _seconds

        check_int("max_records", max_records, (1 << 32) - 1, minimum=1)
        wait_s = min(_seconds("wait", wait), _MAX_WAIT)
        with self._lock:
            if self._closed.is_set():
                raise Disconnected("the ShardedGroup is closed")
            return self._poll(max_records, wait_s)

    def _poll(self, max_records: int, wait: float) -> List[ShardedRecord]:
        deadline = time.monotonic() + wait
        # Answers that came in since the last poll.
        self._drain()
        if self._ready:
            return self._hand_out(max_records)
        if self._deferred is not None:
            error, self._deferred = self._deferred, None
            raise error

        # Every poll, waiting or not, answers through the queue, and what it
        # claims goes to `_ready` before it is handed out: a poll interrupted
        # at any point leaves the records here for the next one.
        n = self._shards
        start = self._next
        self._next = (self._next + 1) % n
        for i in range(n):
            shard = (start + i) % n
            # A waiting poll is already out there and gets what arrives.
            if shard in self._out:
                continue
            want = max_records - len(self._ready)
            if want <= 0:
                break
            self._spawn(shard, want, 0.0)
            while shard in self._out:
                answer = self._wait_answer(math.inf)
                if answer is not None:
                    self._note(answer)
        if self._ready or wait <= 0:
            return self._hand_out(max_records)

        # Nothing anywhere: wait.
        while True:
            now = time.monotonic()
            if deadline - now < 0.001 or self._closed.is_set():
                return []
            free_at = self._spread_waits(max_records, deadline - now, now)
            answer = self._wait_answer(deadline if free_at is None else min(free_at, deadline))
            if answer is None:
                continue  # The deadline, a shard that may wait again, or close().
            self._note(answer)
            if self._ready:
                self._drain()
                return self._hand_out(max_records)

    def _spread_waits(self, max_records: int, remaining: float, now: float) -> Optional[float]:
        """Send waiting polls for up to ``max_records`` records in all, so that
        what they claim after the first answer never exceeds it. With at
        least as many records as shards, every shard waits for its part, a
        wait slice at a time; with fewer, one record each on as many shards
        as records, in turn, a short slice at a time. A shard whose last
        wait's slice is not over yet waits its turn; returns the earliest
        such turn."""
        n = self._shards

        def free(shard: int) -> bool:
            return shard not in self._out and self._quiet_until[shard] <= now

        if max_records >= n:
            base, extra = divmod(max_records, n)
            slice_ = min(remaining, self._wait_slice)
            for shard in range(n):
                if free(shard):
                    self._spawn_wait(shard, base + (1 if shard < extra else 0), slice_, now)
        else:
            slice_ = min(remaining, SHORT_WAIT_SLICE)
            for _ in range(len(self._out), max_records):
                idle = next((s for s in ((self._next + i) % n for i in range(n)) if free(s)), None)
                if idle is None:
                    break
                self._next = (idle + 1) % n
                self._spawn_wait(idle, 1, slice_, now)
        turns = [self._quiet_until[s] for s in range(n) if s not in self._out and self._quiet_until[s] > now]
        return min(turns, default=None)

    def _spawn_wait(self, shard: int, max_records: int, slice_: float, now: float) -> None:
        self._quiet_until[shard] = now + slice_
        self._spawn(shard, max_records, slice_)

    def _spawn(self, shard: int, max_records: int, wait: float) -> None:
        """Send a poll to ``shard``; its answer comes through the queue."""
        from .client import _ms_u32

        wait_ms = _ms_u32("wait", wait)
        request = self._client._group_poll_request(
            self._stream, shard, self._group, max_records, wait_ms, self._member, self._visibility_ms
        )
        answers = self._answers

        def notify(call: "_ShardCall", shard: int = shard) -> None:
            answers.put((shard, call))

        # The answer may be queued before this returns; it is only read
        # (under the lock this holds) once `_out` names the call.
        self._out[shard] = self._client._start_shard(self._stream, shard, request, wait_ms / 1000, notify)

    def _wait_answer(self, until: float) -> _Answer:
        """The next answer, waiting until ``until`` at most (``None`` then, or
        for a wake-up). A poll whose deadline passed unanswered answers
        :class:`~felix.errors.Timeout`."""
        while True:
            now = time.monotonic()
            due = math.inf
            for shard, call in self._out.items():
                if call.done():
                    continue  # Its answer is in the queue (or about to be).
                if call.deadline <= now:
                    if call.expire():
                        return shard, call
                    continue
                due = min(due, call.deadline)
            wake = min(until, due)
            try:
                if wake == math.inf:
                    return self._answers.get()
                return self._answers.get(timeout=min(max(wake - now, 0.0), _MAX_WAIT))
            except queue.Empty:
                if time.monotonic() >= until:
                    return None

    def _hand_out(self, max_records: int) -> List[ShardedRecord]:
        count = min(max_records, len(self._ready))
        return [self._ready.popleft() for _ in range(count)]

    def _drain(self) -> None:
        """Take in every answer already here (and time out overdue polls);
        errors wait in ``_deferred``."""
        now = time.monotonic()
        for shard, call in list(self._out.items()):
            if not call.done() and call.deadline <= now and call.expire():
                self._answers.put((shard, call))
        while True:
            try:
                answer = self._answers.get_nowait()
            except queue.Empty:
                return
            if answer is None:
                continue
            error = self._take(answer)
            if error is not None and self._deferred is None:
                self._deferred = error

    def _note(self, answer: Tuple[int, "_ShardCall"]) -> None:
        """Take in one answer: an error is the caller's only when no records
        are at hand to return first."""
        error = self._take(answer)
        if error is None:
            return
        if not self._ready:
            raise error
        if self._deferred is None:
            self._deferred = error

    def _take(self, answer: Tuple[int, "_ShardCall"], closing: bool = False) -> Optional[FelixError]:
        """An answer's records join ``_ready``; its error is returned."""
        shard, call = answer
        if self._out.get(shard) is not call:
            return None  # Given up on already.
        try:
            response = call.answer()
            if response is None:
                return None  # Sent again to the right core: still out.
            del self._out[shard]
            records = self._client._group_records(response)
        except FelixError as error:
            self._out.pop(shard, None)
            if isinstance(error, Disconnected) and not closing and self._member is not None and self._member[1]:
                # The connection of the shard's core dropped. A member that
                # reclaims takes back, on its first poll of each shard over
                # the new connection, what the old one held, so records held
                # here from that core's shards would come out twice: let the
                # reclaim hand them out instead.
                lost = self._core(shard)
                keep = [r for r in self._ready if not (r.shard == shard or (lost is not None and self._core(r.shard) == lost))]
                self._ready = deque(keep)
            return error
        self._ready.extend(ShardedRecord(shard, record) for record in records)
        return None

    def _core(self, shard: int) -> Optional[int]:
        return self._placement[shard] if shard < len(self._placement) else None

    # --- finishing records ---------------------------------------------------

    @staticmethod
    def _check(record: ShardedRecord) -> ShardedRecord:
        if not isinstance(record, ShardedRecord):
            raise InvalidArgument(f"expected a ShardedRecord this group's poll returned, not {type(record).__name__}")
        return record

    def ack(self, record: ShardedRecord) -> None:
        """Finish a record."""
        self._check(record)
        self._client.group_ack(self._stream, record.shard, self._group, record.record)

    def ack_many(self, records: Iterable[ShardedRecord]) -> None:
        """Finish several records: one request per shard, all sent before any
        answer is awaited. On an error every request is still awaited and the
        first error raised."""
        by_shard: Dict[int, List[int]] = {}
        for record in records:
            by_shard.setdefault(self._check(record).shard, []).append(record.offset)
        requests = []
        for shard in sorted(by_shard):
            offsets = by_shard[shard]
            for at in range(0, len(offsets), _wire.MAX_ITEMS_PER_VEC):
                requests.append((shard, _wire.group_ack(self._stream, shard, self._group, offsets[at : at + _wire.MAX_ITEMS_PER_VEC])))
        if requests:
            self._client._require(Feature.GROUPS, "group_ack")
        self._run_all(requests, "group_ack")

    def _run_all(self, requests: List[Tuple[int, _wire.WireRequest]], call: str, ignore_stale: bool = False) -> None:
        """Send every request, then await every answer (each must be ``ok``);
        the first error is raised."""
        first: Optional[FelixError] = None
        pending = []
        for shard, request in requests:
            started = self._client._start_shard(self._stream, shard, request)
            pending.append(started)
        for started in pending:
            try:
                response = started.result()
                if response.name != "ok":
                    raise ProtocolError(f"broker answered {call} with {response.name}")
            except StaleClaim as error:
                if not ignore_stale and first is None:
                    first = error
            except FelixError as error:
                if first is None:
                    first = error
        if first is not None:
            raise first

    def nack(self, record: ShardedRecord, *, reason: Optional[str] = None) -> None:
        """Hand a record back now, owed to the group again. Raises
        :class:`~felix.errors.StaleClaim` if the claim lapsed and the record
        went out again."""
        self._check(record)
        self._client.group_nack(self._stream, record.shard, self._group, record.record, reason=reason)

    def nack_after(
        self, record: ShardedRecord, delay: Union[float, "timedelta"], *, reason: Optional[str] = None
    ) -> None:
        """Hand a record back, owed again once ``delay`` has passed."""
        self._check(record)
        self._client.group_nack_after(self._stream, record.shard, self._group, record.record, delay, reason=reason)

    def extend(self, record: ShardedRecord, by: Union[float, "timedelta"]) -> float:
        """Extend the claim on a record by ``by``; returns how long it now
        stands, in seconds."""
        self._check(record)
        return self._client.group_extend(self._stream, record.shard, self._group, record.record, by)

    def dead_letter(self, record: ShardedRecord, *, reason: Optional[str] = None) -> None:
        """Give up on a record: list it (with ``reason``) as a dead letter of its
        shard's group and finish it."""
        self._check(record)
        self._client.group_dead_letter(self._stream, record.shard, self._group, record.record, reason=reason)

    # --- the group on every shard -------------------------------------------

    def describe(self) -> List[GroupInfo]:
        """The group on every shard, in shard order."""
        return self._client.group_describe_stream(self._stream, self._group)

    def lag(self) -> int:
        """Records published to the stream and not yet finished by the group,
        over every shard."""
        return sum(info.lag for info in self.describe())

    # --- closing ---------------------------------------------------------------

    def close(self) -> None:
        """Wait for the polls still out (about a wait slice; at most that plus
        5 s, after which what they claim lapses back to the group) and hand
        back every record claimed and not yet returned by :meth:`poll`, all
        nacks sent at once (a :class:`~felix.errors.StaleClaim` is ignored:
        the record already went back). A ``poll`` waiting in another thread
        returns first. Raises the first error met; every record is still
        tried. Later calls do nothing."""
        self._closed.set()
        self._answers.put(None)  # Wakes a waiting poll.
        with self._lock:
            if self._finished:
                return
            self._finished = True
            first: Optional[FelixError] = None
            deadline = time.monotonic() + self._wait_slice + CLOSE_GRACE
            while self._out and time.monotonic() < deadline:
                answer = self._wait_answer(deadline)
                if answer is not None:
                    error = self._take(answer, closing=True)
                    if error is not None and first is None:
                        first = error
            if self._out:
                _log.warning(
                    "felix: %d polls of a closed ShardedGroup did not answer in time; "
                    "what they claim goes back to the group when its claims lapse",
                    len(self._out),
                )
                for call in self._out.values():
                    call.cancel()
                self._out.clear()
            held, self._ready = list(self._ready), deque()
            self._deferred = None
            requests = []
            for record in held:
                try:
                    requests.append(
                        (record.shard, self._client._group_nack_request(self._stream, record.shard, self._group, record.record, 0, None))
                    )
                except FelixError as error:
                    if first is None:
                        first = error
            try:
                self._run_all(requests, "group_nack", ignore_stale=True)
            except FelixError as error:
                if first is None:
                    first = error
        if first is not None:
            raise first
