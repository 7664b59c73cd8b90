"""Requests about one shard sent without waiting for their answers
(:class:`ShardCall`), and :class:`ShardPort`, the small interface a
:class:`~felix.ShardedGroup` has to what it sends through: one broker's
:class:`~felix.Client` (:class:`BrokerPort`) or the leaders of a cluster
(``felix.cluster._ClusterPort``)."""

import abc
import itertools
import math
import threading
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple, Union

from . import _wire
from ._connection import Connection, Pending
from ._durations import Seconds
from .errors import Disconnected, FelixError, Timeout, WrongCore
from .types import GroupRecord, StreamInfo, StreamRef

if TYPE_CHECKING:
    from .client import Client
    from .cluster import ClusterClient

#: Numbers the answers of every call in the order they land (``next`` on an
#: ``itertools.count`` is atomic).
_landings = itertools.count(1)


class NotSent(FelixError):
    """The answer of a call interrupted before its request went out: there is
    nothing to take in."""

    code = "not_sent"


def _raise_error(response: _wire.Response) -> _wire.Response:
    if response.name == "error":
        raise response.value
    return response


class ShardCall:
    """A request about one shard, sent without waiting for its answer and
    routed as :meth:`Client._call_shard` routes it (one ``wrong_core``
    redirect included). Several are in flight at once on the client's
    pipelined connections, and no thread waits for them.

    Sending takes two steps, so that what may block can run outside a
    caller's lock: :meth:`connection` finds the connection to the shard's
    core (refreshing the placement or connecting if need be: it may block),
    and :meth:`send` sends on it and returns at once (:meth:`start` does
    both). Once the answer (or a failure) is in, :attr:`landed` numbers it
    (answers of every call, in the order they landed) and ``notify(call)`` is
    called, from the connection's reader thread or the thread that failed.

    A call that landed with an answer it may still follow (:meth:`follow`)
    is sent again with :meth:`connection` and :meth:`send` (or
    :meth:`start`). A subclass that picks the client for each attempt
    (``felix.cluster._LeaderCall``) gives ``client`` and ``request`` as
    ``None`` and sets them in :meth:`connection`.
    """

    def __init__(
        self,
        client: Optional["Client"],
        stream: StreamRef,
        shard: int,
        request: Optional[_wire.WireRequest],
        wait: float,
        notify: Optional[Callable[["ShardCall"], None]],
    ) -> None:
        self._client = client
        self._stream = stream
        self.shard = shard
        self._request = request
        self._wait = wait
        self._notify = notify
        #: The ``wrong_core`` answer being followed, once.
        self._redirect: Optional[WrongCore] = None
        self._redirected = False
        self._pending: Optional[Pending] = None
        self._error: Optional[FelixError] = None
        self._landed_event = threading.Event()
        #: Set once the answer is in: the order it landed in.
        self.landed: Optional[int] = None

    @property
    def client(self) -> "Client":
        """The client the call was (last) sent through."""
        assert self._client is not None, "the call was not routed yet"
        return self._client

    # --- sending -------------------------------------------------------------

    def connection(self) -> Connection:
        """The connection to send on: the shard's core's or, after a
        ``wrong_core`` answer (:meth:`follow`), the core it names. May
        block (a placement refresh, a connect); raises what they raise."""
        client = self.client
        if self._redirect is not None:
            error, self._redirect = self._redirect, None
            self._redirected = True
            return client._conn(client._redirect_core(self._stream, self.shard, error))
        core = client._core_for(self._stream, self.shard)
        return client._conn_or_moved(core, lambda: client._core_for(self._stream, self.shard))

    def send(self, conn: Connection) -> None:
        """Send the request on ``conn`` without waiting; a failure to send is
        the answer. Quick: it only writes a small frame."""
        assert self._request is not None, "the call was not routed yet"
        self.landed = None
        self._landed_event.clear()
        self._pending, self._error = None, None
        try:
            self._pending = conn.start(self._request, self.client._timeout(self._wait), self._answered)
        except FelixError as error:
            self.fail(error)
        except BaseException:
            # Interrupted: if a part of the frame went out the connection is
            # closed, else nothing was sent. Either way the call has landed.
            self.fail(Disconnected("the send was interrupted") if conn.closed else NotSent("interrupted"))
            raise

    def start(self) -> "ShardCall":
        """:meth:`connection` and :meth:`send`; a failure to route is the answer."""
        try:
            conn = self.connection()
        except FelixError as error:
            self.fail(error)
            return self
        self.send(conn)
        return self

    def fail(self, error: FelixError) -> None:
        """Land the call with ``error`` as its answer."""
        self._error = error
        self._answered()

    def _answered(self) -> None:
        self.landed = next(_landings)
        self._landed_event.set()
        if self._notify is not None:
            self._notify(self)

    @property
    def resume_at(self) -> float:
        """When a call that :meth:`follow` says to send again may go
        (``time.monotonic()``): at once here; a cluster call waits out its
        backoff. :meth:`connection` waits until then itself; a caller that
        must not block waits for it instead."""
        return -math.inf

    # --- the answer ------------------------------------------------------------

    @property
    def deadline(self) -> float:
        """When the answer stops being awaited (``time.monotonic()``)."""
        if self._pending is None or self._error is not None:
            return -math.inf
        return self._pending.deadline

    def wait_landed(self, timeout: Optional[float] = None) -> bool:
        """Wait up to ``timeout`` for the answer to land; whether it has."""
        return self._landed_event.wait(timeout)

    def expire(self) -> bool:
        """Give up on an answer past its deadline: True if it had not come
        (the call lands with :class:`~felix.errors.Timeout`), False if it is
        in or landing."""
        if self.landed is not None or self._pending is None or not self._pending.cancel():
            return False
        assert self._request is not None  # It was sent.
        self.fail(Timeout(f"no answer to {self._request.name} within {self.client._timeout(self._wait):.3g} s"))
        return True

    def cancel(self) -> bool:
        """Stop waiting for the answer: True if it had not come (it is dropped
        if it comes); False if it is in, or landing (:meth:`wait_landed`)."""
        if self.landed is not None:
            return False
        if self._pending is None:
            return True
        return self._pending.cancel()

    def follow(self) -> bool:
        """Whether the call landed with an answer it may still follow: here a
        ``wrong_core`` answer, once; if so, the next :meth:`connection` is
        the right core's. Asked once for each landing."""
        if self.landed is None or self._error is not None or self._redirected or self._pending is None:
            return False
        error = self.error()
        if isinstance(error, WrongCore):
            self._redirect = error
            return True
        return False

    def error(self) -> Optional[FelixError]:
        """The error a landed call failed or was answered with; ``None`` for
        an answer that is not an error."""
        if self._error is not None:
            return self._error
        if self._pending is None:
            return None
        try:
            response = self._pending.outcome()
        except FelixError as error:
            return error
        return response.value if response.name == "error" else None

    def answer(self) -> _wire.Response:
        """The answer of a call that landed; an error (``wrong_core`` included) raised."""
        if self._error is not None:
            raise self._error
        assert self._pending is not None
        return _raise_error(self._pending.outcome())

    def result(self) -> _wire.Response:
        """Block for the answer, following a ``wrong_core`` redirect; an error raised."""
        while True:
            if self._pending is not None and self.landed is None:
                try:
                    self._pending.wait()
                except FelixError:
                    pass  # Timeout: the expire below lands it.
                if not self.expire():
                    self.wait_landed()
            if self.follow():
                self.start()
                continue
            return self.answer()


class ShardPort(abc.ABC):
    """What a :class:`~felix.ShardedGroup` needs of what it sends through, for
    one stream: the calls it makes per shard without waiting
    (:class:`ShardCall`, not sent yet), and :attr:`client`, whose public
    group calls (``group_ack``, ``group_nack``, ``group_describe_stream``,
    ...) it makes as they are."""

    #: A :class:`~felix.Client` or a :class:`~felix.ClusterClient`.
    client: Union["Client", "ClusterClient"]
    stream: StreamRef

    @abc.abstractmethod
    def member(self, consumer: Optional[str], reclaim: bool) -> Optional[_wire.GroupMember]:
        """The poll member named by ``consumer`` (checked)."""

    @abc.abstractmethod
    def visibility_ms(self, visibility: Optional[Seconds]) -> Optional[int]:
        """A poll visibility, checked, in milliseconds."""

    @abc.abstractmethod
    def describe(self) -> StreamInfo:
        """The stream, as :meth:`~felix.Client.describe_stream` has it."""

    @abc.abstractmethod
    def cores(self, info: StreamInfo) -> Tuple[int, ...]:
        """Which shards share a connection: the core of each shard, by shard
        (empty when that is not known)."""

    @abc.abstractmethod
    def poll_call(
        self,
        shard: int,
        group: str,
        max_records: int,
        wait_ms: int,
        member: Optional[_wire.GroupMember],
        visibility_ms: Optional[int],
        notify: Callable[[ShardCall], None],
    ) -> ShardCall:
        """A group poll of ``shard``, not sent yet."""

    @abc.abstractmethod
    def ack_call(self, shard: int, group: str, offsets: List[int]) -> ShardCall:
        """An ack of ``offsets`` of ``shard``, not sent yet."""

    @abc.abstractmethod
    def nack_call(self, shard: int, group: str, record: GroupRecord) -> ShardCall:
        """A nack (now, no reason) of ``record`` of ``shard``, not sent yet."""

    def records(self, call: ShardCall) -> List[GroupRecord]:
        """The records of a landed poll's answer (an error raised)."""
        response = call.answer()  # First: a call that never reached a broker has no client.
        return call.client._group_records(response)


class BrokerPort(ShardPort):
    """A :class:`ShardPort` for one broker's :class:`~felix.Client`: each
    shard's calls go to the core that owns it. Requests are built (and the
    features they need checked) when the call is made."""

    def __init__(self, client: "Client", stream: StreamRef) -> None:
        self.client = self._client = client
        self.stream = stream

    def member(self, consumer: Optional[str], reclaim: bool) -> Optional[_wire.GroupMember]:
        return self._client._member(consumer, reclaim)

    def visibility_ms(self, visibility: Optional[Seconds]) -> Optional[int]:
        return self._client._visibility_ms(visibility)

    def describe(self) -> StreamInfo:
        return self._client.describe_stream(self.stream)

    def cores(self, info: StreamInfo) -> Tuple[int, ...]:
        return info.placement

    def poll_call(
        self,
        shard: int,
        group: str,
        max_records: int,
        wait_ms: int,
        member: Optional[_wire.GroupMember],
        visibility_ms: Optional[int],
        notify: Callable[[ShardCall], None],
    ) -> ShardCall:
        request = self._client._group_poll_request(self.stream, shard, group, max_records, wait_ms, member, visibility_ms)
        return self._call(shard, request, wait_ms / 1000, notify)

    def ack_call(self, shard: int, group: str, offsets: List[int]) -> ShardCall:
        return self._call(shard, self._client._group_ack_request(self.stream, shard, group, offsets))

    def nack_call(self, shard: int, group: str, record: GroupRecord) -> ShardCall:
        return self._call(shard, self._client._group_nack_request(self.stream, shard, group, record, 0, None))

    def _call(
        self,
        shard: int,
        request: _wire.WireRequest,
        wait: float = 0.0,
        notify: Optional[Callable[[ShardCall], None]] = None,
    ) -> ShardCall:
        return ShardCall(self._client, self.stream, shard, request, wait, notify)
