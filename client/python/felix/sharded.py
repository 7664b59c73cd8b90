"""A consumer group read across every shard of a stream: :class:`ShardedGroup`.

A group is per shard on the broker; a :class:`ShardedGroup` is the client
polling all of a stream's shards as one queue. It assigns nothing: every
``ShardedGroup`` of a group polls every shard, and the broker's one claim per
record is what divides the work between them. It mirrors the Rust client's
``felix_client::ShardedGroup``.

How it waits on several shards at once, without threads of its own: each
per-shard poll is sent on the client's pipelined connection to the shard's
core and not waited for (a :class:`~felix._shard_calls.ShardCall`). When its
answer lands, the connection's reader thread only wakes the group up; the
group takes answers in by looking through the calls it has out for those
that landed, in the order they landed. A wake-up lost to an interrupt is
harmless, so a poll can be interrupted at any point without losing what its
requests claim, and nothing is left running once
:meth:`ShardedGroup.close` returns.

Over a cluster (:meth:`felix.ClusterClient.sharded_group`, the Rust client's
``ShardedGroup::on_cluster``) each shard's calls go to the broker that leads
it: a call that lands with ``not_leader``, or fails in a way the cluster
client tries again, is sent again from the group's own thread, to the
leader named or the next broker, once the cluster client's backoff is over:
the group keeps it aside until then, taking the other shards' answers in
meanwhile (it never sleeps through a backoff). The requests of
:meth:`ShardedGroup.ack_many` and the nacks of :meth:`ShardedGroup.close`
run in short-lived threads, one per request, so that their retries proceed
alongside each other.
"""

import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from . import _wire
from ._durations import Seconds, ms_u32, seconds
from ._shard_calls import NotSent, ShardCall, ShardPort
from .errors import ConnectionFailed, Disconnected, FelixError, InvalidArgument, ProtocolError, StaleClaim
from .types import GroupInfo, GroupRecord, Header, StreamRef, check_int, check_name

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
#: How long :meth:`ShardedGroup.close` waits for an answer already being
#: handed over when it gives up on a poll.
_LANDING = 1.0

#: The most threads :meth:`ShardedGroup.ack_many` and :meth:`ShardedGroup.close`
#: run their requests in (one per request, up to this many).
_MAX_CALL_THREADS = 128

#: Answers that say the connection of the shard's core is gone.
_CONNECTION_LOST = (Disconnected, ConnectionFailed)


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
    with :meth:`Client.sharded_group`, or :meth:`ClusterClient.sharded_group`
    for a cluster (each shard's calls then go to the broker that leads it);
    use it as a context manager or call :meth:`close`.

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
    requests claim for the next one: each record is then either returned or
    held. A record held twice (a reconnect and a reclaim can hand out again a
    record still held) is held once, with its latest attempt. An error a shard answers while records
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
        port: ShardPort,
        group: str,
        *,
        consumer: Optional[str] = None,
        reclaim: bool = False,
        visibility: Optional[Seconds] = None,
        wait_slice: Seconds = DEFAULT_WAIT_SLICE,
    ) -> None:
        """Use :meth:`Client.sharded_group` or :meth:`ClusterClient.sharded_group`."""
        self._port = port
        self._client = port.client
        self._stream = port.stream
        self._group = check_name("group", group)
        self._member = port.member(consumer, reclaim)
        self._visibility_ms = port.visibility_ms(visibility)
        self._wait_slice = max(min(seconds("wait_slice", wait_slice), _MAX_WAIT), MIN_WAIT_SLICE)
        info = port.describe()
        if info.shards == 0:
            raise InvalidArgument(f"{self._stream} has no shards")
        self._shards = info.shards
        #: The broker core of each shard: shards on one core share a connection.
        self._placement = port.cores(info)
        #: Polls take turns under it, for as long as they last.
        self._turn = threading.Lock()
        #: Closes take turns under it.
        self._closing = threading.Lock()
        #: The state below; held only for quick steps, never across a
        #: connect, a placement refresh or a wait.
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: Set once close() handed everything back.
        self._finished = False
        #: Where the next sweep (and the next rotating wait) starts.
        self._next = 0
        #: Claimed, not yet handed out, by (shard, offset), in the order
        #: claimed; handed out before anything else.
        self._ready: Dict[Tuple[int, int], ShardedRecord] = {}
        #: An error answered while records were at hand, for the next poll with none.
        self._deferred: Optional[FelixError] = None
        #: The poll out on each shard (at most one each).
        self._out: Dict[int, ShardCall] = {}
        #: Polls to send again once their ``resume_at`` comes (a cluster
        #: call's backoff), by shard: waited for here, never slept on, so
        #: the other shards' answers are taken in meanwhile.
        self._later: Dict[int, ShardCall] = {}
        #: No new waiting poll goes to a shard before this (its last one's
        #: slice), so waits the broker ends early are not re-sent in a loop.
        self._quiet_until = [0.0] * self._shards
        #: Wake-ups: bumped (by the connections' reader threads, or close)
        #: whenever an answer lands. Only a hint to look at ``_out`` again.
        self._wake = threading.Condition(threading.Lock())
        self._wakes = 0

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

    def poll(self, max_records: int = 16, *, wait: Seconds = 0) -> List[ShardedRecord]:
        """Claim up to ``max_records`` records from any of the stream's shards,
        waiting up to ``wait`` seconds for one when none is available. An
        empty list means nothing was (or the group was closed meanwhile).
        Raises :class:`~felix.errors.Disconnected` once closed."""
        check_int("max_records", max_records, (1 << 32) - 1, minimum=1)
        wait_s = min(seconds("wait", wait), _MAX_WAIT)
        with self._turn:
            if self._closed.is_set():
                raise Disconnected("the ShardedGroup is closed")
            return self._poll(max_records, wait_s)

    def _poll(self, max_records: int, wait: float) -> List[ShardedRecord]:
        deadline = time.monotonic() + wait
        # Answers that landed since the last poll.
        self._defer(self._gather())
        handed = self._hand_out(max_records)
        if handed:
            return handed
        with self._lock:
            error, self._deferred = self._deferred, None
        if error is not None:
            raise error

        # Every poll, waiting or not, is taken in from `_out`, and what it
        # claims goes to `_ready` before it is handed out: a poll interrupted
        # at any point leaves the records here for the next one.
        n = self._shards
        start = self._next
        self._next = (self._next + 1) % n
        for i in range(n):
            shard = (start + i) % n
            # A waiting poll is already out there and gets what arrives (or
            # goes again when its backoff ends).
            if shard in self._out or shard in self._later:
                continue
            want = max_records - len(self._ready)
            if want <= 0 or not self._spawn(shard, want, 0.0):
                break
            while shard in self._out:
                seen = self._wakes
                self._note(self._gather())
                if shard in self._out:
                    self._sleep(seen, self._due())
        if self._ready or wait <= 0:
            return self._hand_out(max_records)

        # Nothing anywhere: wait.
        while True:
            # Read before looking, so that an answer landing after the look
            # ends the sleep below.
            seen = self._wakes
            self._note(self._gather())
            if self._ready:
                return self._hand_out(max_records)
            now = time.monotonic()
            if deadline - now < 0.001 or self._closed.is_set():
                return []
            free_at = self._spread_waits(max_records, deadline - now, now)
            self._sleep(seen, min(deadline, free_at or math.inf, self._due()))

    def _spread_waits(self, max_records: int, remaining: float, now: float) -> Optional[float]:
        """Send waiting polls for up to ``max_records`` records in all, so that
        what they claim after the first answer never exceeds it. With at
        least as many records as shards, every shard waits for its part, a
        wait slice at a time; with fewer, one record each on as many shards
        as records, in turn, a short slice at a time. A shard whose last
        wait's slice is not over yet waits its turn; returns the earliest
        such turn."""
        n = self._shards
        plan: List[Tuple[int, int]] = []
        with self._lock:
            busy = set(self._out) | set(self._later)

            def free(shard: int) -> bool:
                return shard not in busy and self._quiet_until[shard] <= now

            if max_records >= n:
                base, extra = divmod(max_records, n)
                slice_ = min(remaining, self._wait_slice)
                plan = [(s, base + (1 if s < extra else 0)) for s in range(n) if free(s)]
            else:
                slice_ = min(remaining, SHORT_WAIT_SLICE)
                for _ in range(len(busy), max_records):
                    idle = next((s for s in ((self._next + i) % n for i in range(n)) if free(s)), None)
                    if idle is None:
                        break
                    self._next = (idle + 1) % n
                    busy.add(idle)
                    plan.append((idle, 1))
            for shard, _ in plan:
                self._quiet_until[shard] = now + slice_
                busy.add(shard)
            turns = [self._quiet_until[s] for s in range(n) if s not in busy and self._quiet_until[s] > now]
        # Sent outside the lock: routing may connect.
        for shard, count in plan:
            if not self._spawn(shard, count, slice_):
                break
        return min(turns, default=None)

    def _spawn(self, shard: int, max_records: int, wait: float) -> bool:
        """Send a poll to ``shard``; False (nothing sent) once closed."""
        wait_ms = ms_u32("wait", wait)
        call = self._port.poll_call(
            shard, self._group, max_records, wait_ms, self._member, self._visibility_ms, self._notify
        )
        return self._send(call)

    def _send(self, call: ShardCall) -> bool:
        """Route ``call`` (which may block: a connect, a placement refresh)
        without the lock, then, under it, send it and count it out, unless
        the group was closed meanwhile (False: nothing sent)."""
        try:
            conn = call.connection()
            failure: Optional[FelixError] = None
        except FelixError as error:
            conn, failure = None, error
        with self._lock:
            if self._closed.is_set():
                return False
            # Counted out first: however the send ends, the call lands.
            self._out[call.shard] = call
            if conn is None:
                assert failure is not None
                call.fail(failure)
            else:
                call.send(conn)
        return True

    def _notify(self, call: Optional[ShardCall]) -> None:
        """A call landed (or close() wants the polls to look up)."""
        with self._wake:
            self._wakes += 1
            self._wake.notify_all()

    def _sleep(self, seen: int, until: float) -> None:
        """Wait until a wake-up after the ``seen``-th, or ``until``."""
        with self._wake:
            while self._wakes == seen:
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return
                self._wake.wait(min(remaining, _MAX_WAIT))

    def _due(self) -> float:
        """The earliest deadline of the calls out that have not landed, or
        time to send a call again."""
        with self._lock:
            waits = [c.deadline for c in self._out.values() if c.landed is None]
            waits += [c.resume_at for c in self._later.values()]
        return min(waits, default=math.inf)

    def _gather(self, closing: bool = False) -> List[FelixError]:
        """Take in every answer that landed (timing out overdue polls), in the
        order they landed; returns their errors. A ``wrong_core`` answer is
        sent again to the right core, and a cluster call to follow (a
        ``not_leader``, a lost leader) once its backoff is over; not when
        ``closing``: such a call claimed nothing."""
        redirects: List[ShardCall] = []
        errors: List[FelixError] = []
        with self._lock:
            now = time.monotonic()
            for shard, call in list(self._later.items()):
                if closing or call.resume_at <= now:
                    del self._later[shard]
                    if not closing:
                        redirects.append(call)
            for call in list(self._out.values()):
                if call.landed is None and call.deadline <= now:
                    call.expire()
            landed = sorted((c for c in self._out.values() if c.landed is not None), key=lambda c: c.landed or 0)
            for call in landed:
                if call.follow():
                    if self._out.get(call.shard) is call:
                        del self._out[call.shard]
                        if not closing:
                            if call.resume_at > time.monotonic():
                                self._later[call.shard] = call
                            else:
                                redirects.append(call)
                    continue
                error = self._take(call, closing)
                if error is not None:
                    errors.append(error)
        # Outside the lock: the redirect refreshes the placement and may connect.
        for call in redirects:
            self._send(call)
        return errors

    def _take(self, call: ShardCall, closing: bool = False) -> Optional[FelixError]:
        """Under the lock: a landed answer's records join ``_ready`` before
        the call stops being out (taken twice, it is held once); its error
        is returned."""
        shard = call.shard
        if self._out.get(shard) is not call:
            return None  # Taken in or given up on already.
        try:
            records = self._port.records(call)
        except NotSent:
            del self._out[shard]
            return None
        except FelixError as error:
            reclaims = self._member is not None and self._member.reclaim
            if isinstance(error, _CONNECTION_LOST) and reclaims and not closing:
                self._drop_core(shard)
            del self._out[shard]
            return error
        self._hold(ShardedRecord(shard, record) for record in records)
        del self._out[shard]
        return None

    def _hold(self, records: Iterable[ShardedRecord]) -> None:
        """Under the lock: add to ``_ready``, once per (shard, offset), keeping
        the later attempt."""
        for record in records:
            key = (record.shard, record.offset)
            held = self._ready.get(key)
            if held is None or record.attempts > held.attempts:
                self._ready[key] = record

    def _drop_core(self, shard: int) -> None:
        """Under the lock: the connection of ``shard``'s core dropped. A member
        that reclaims takes back, on its first poll of each shard over the
        new connection, what the old one held, so records held here from
        that core's shards would come out twice: let the reclaim hand them
        out instead."""
        lost = self._core(shard)

        def gone(s: int) -> bool:
            return s == shard or (lost is not None and self._core(s) == lost)

        self._ready = {key: r for key, r in self._ready.items() if not gone(r.shard)}

    def _core(self, shard: int) -> Optional[int]:
        return self._placement[shard] if shard < len(self._placement) else None

    def _defer(self, errors: List[FelixError]) -> None:
        with self._lock:
            if errors and self._deferred is None:
                self._deferred = errors[0]

    def _note(self, errors: List[FelixError]) -> None:
        """An error is the caller's only when no records are at hand to
        return first; else (and the others) it waits in ``_deferred``."""
        if errors and not self._ready:
            self._defer(errors[1:])
            raise errors[0]
        self._defer(errors)

    def _hand_out(self, max_records: int) -> List[ShardedRecord]:
        """Up to ``max_records`` held records, taken off ``_ready`` in one step
        after they were copied out (nothing once closed: close() hands them
        back)."""
        with self._lock:
            if self._closed.is_set():
                return []
            handed = list(itertools.islice(self._ready.values(), max_records))
            if handed:
                self._ready = dict(itertools.islice(self._ready.items(), len(handed), None))
        return handed

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
        """Finish several records: one request per shard, all sent at once
        (over a cluster, each retried alongside the others). On an error every
        request is still awaited and the first error raised."""
        by_shard: Dict[int, List[int]] = {}
        for record in records:
            by_shard.setdefault(self._check(record).shard, []).append(record.offset)
        calls = []
        step = _wire.MAX_ITEMS_PER_VEC
        for shard in sorted(by_shard):
            offsets = by_shard[shard]
            for at in range(0, len(offsets), step):
                calls.append(self._port.ack_call(shard, self._group, offsets[at : at + step]))
        self._run_all(calls, "group_ack")

    def _run_all(self, calls: List[ShardCall], call: str, ignore_stale: bool = False) -> None:
        """Run every call at once and await every answer (each must be
        ``ok``); the first error, in the calls' order, is raised.

        The calls run in short-lived threads, one per call (up to
        :data:`_MAX_CALL_THREADS`, which then take the rest in turn; a single
        call runs on the calling thread), so that what may block in a call,
        a connect, a placement refresh and, over a cluster, the pauses and
        attempts it is retried with (up to a call's budget, about 18 s),
        proceeds alongside the other calls': the batch takes about as long
        as its slowest call, not the sum of them (as the Rust client's
        hand-back runs a task per nack). Nothing is left running once it
        returns; interrupted, the calls still out run to their end."""
        outcomes: List[Optional[BaseException]] = [None] * len(calls)
        # `next` on an itertools.count is atomic: each call is run once.
        taken = itertools.count()

        def run() -> None:
            while True:
                i = next(taken)
                if i >= len(calls):
                    return
                try:
                    response = calls[i].start().result()
                    if response.name != "ok":
                        raise ProtocolError(f"broker answered {call} with {response.name}")
                except BaseException as error:  # noqa: B902 - raised by the caller below
                    outcomes[i] = error

        if len(calls) == 1:
            run()
        else:
            threads = [
                threading.Thread(target=run, name=f"felix-{call}", daemon=True)
                for _ in range(min(len(calls), _MAX_CALL_THREADS))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        for error in outcomes:
            if error is None or (ignore_stale and isinstance(error, StaleClaim)):
                continue
            raise error

    def nack(self, record: ShardedRecord, *, reason: Optional[str] = None) -> None:
        """Hand a record back now, owed to the group again. Raises
        :class:`~felix.errors.StaleClaim` if the claim lapsed and the record
        went out again."""
        self._check(record)
        self._client.group_nack(self._stream, record.shard, self._group, record.record, reason=reason)

    def nack_after(
        self, record: ShardedRecord, delay: Seconds, *, reason: Optional[str] = None
    ) -> None:
        """Hand a record back, owed again once ``delay`` has passed."""
        self._check(record)
        self._client.group_nack_after(
            self._stream, record.shard, self._group, record.record, delay, reason=reason
        )

    def extend(self, record: ShardedRecord, by: Seconds) -> float:
        """Let the claim on a record stand for ``by`` from now (which can
        shorten it); returns how long it now stands, in seconds."""
        self._check(record)
        return self._client.group_extend(self._stream, record.shard, self._group, record.record, by)

    def dead_letter(self, record: ShardedRecord, *, reason: Optional[str] = None) -> None:
        """Give up on a record: list it (with ``reason``) as a dead letter of its
        shard's group and finish it."""
        self._check(record)
        self._client.group_dead_letter(
            self._stream, record.shard, self._group, record.record, reason=reason
        )

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
        returns nothing. Raises the first error met; every record is still
        tried; an error a shard answered that no ``poll`` raised yet is raised
        too. Once it has handed everything back, later calls do nothing;
        if it was interrupted before, the next call tries again."""
        self._closed.set()
        self._notify(None)  # Wakes a waiting poll.
        with self._closing:
            if self._finished:
                return
            errors: List[FelixError] = []
            deadline = time.monotonic() + self._wait_slice + CLOSE_GRACE
            while True:
                seen = self._wakes
                # Also the last look before giving up: what landed is taken in.
                errors += self._gather(closing=True)
                if not self._out or time.monotonic() >= deadline:
                    break
                self._sleep(seen, min(deadline, self._due()))
            errors += self._give_up()
            errors += self._hand_back()
            self._finished = True
        if errors:
            raise errors[0]

    def _give_up(self) -> List[FelixError]:
        """Stop waiting for the polls still out; one whose answer is in (or
        being handed over) is taken in all the same."""
        errors: List[FelixError] = []
        with self._lock:
            lost = 0
            for call in list(self._out.values()):
                if call.cancel():
                    lost += 1
                    del self._out[call.shard]
                    continue
                call.wait_landed(_LANDING)
                error = self._take(call, closing=True)
                if error is not None:
                    errors.append(error)
            self._out.clear()
        if lost:
            _log.warning(
                "felix: %d polls of a closed ShardedGroup did not answer in time; "
                "what they claim goes back to the group when its claims lapse",
                lost,
            )
        return errors

    def _hand_back(self) -> List[FelixError]:
        """Nack every held record; they leave ``_ready`` only once the nacks
        were answered, so an interrupted close() tries them again."""
        errors: List[FelixError] = []
        with self._lock:
            held = list(self._ready.values())
            # An error answered that no poll raised yet: close() raises it.
            if self._deferred is not None:
                errors.append(self._deferred)
            self._deferred = None
        calls = []
        for record in held:
            try:
                calls.append(self._port.nack_call(record.shard, self._group, record.record))
            except FelixError as error:
                errors.append(error)
        try:
            self._run_all(calls, "group_nack", ignore_stale=True)
        except FelixError as error:
            errors.append(error)
        with self._lock:
            for record in held:
                key = (record.shard, record.offset)
                if self._ready.get(key) is record:
                    del self._ready[key]
        return errors
