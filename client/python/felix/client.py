"""The Felix :class:`Client`: connections per core, placement, and every call."""

import socket
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _wire
from ._connection import MAX_WAIT, Connection, SockAddr
from ._durations import MAX_U32 as _MAX_U32
from ._durations import Seconds
from ._durations import ms_u32 as _ms_u32
from ._durations import ms_u64 as _ms_u64
from ._durations import seconds as _seconds
from ._shard_calls import BrokerPort
from ._stream_groups import StreamGroupCalls
from ._version import __version__
from .errors import (
    AlreadyExists,
    ConnectionFailed,
    Disconnected,
    FelixError,
    InvalidArgument,
    InvalidRequest,
    NotFound,
    ProtocolError,
    Unsupported,
    WrongCore,
)
from .routing import shard_for_key
from .sharded import ShardedGroup
from .subscription import Subscription
from .types import (
    ClusterInfo,
    DeadLetterInfo,
    DeadLetterPage,
    Feature,
    GroupInfo,
    GroupRecord,
    Payload,
    Published,
    ReadBatch,
    RecordIn,
    ReplicaInfo,
    ShardInfo,
    Start,
    StartPosition,
    StreamInfo,
    StreamLike,
    StreamRef,
    NAME_MAX_BYTES,
    check_int,
    check_name,
    check_u32,
    check_u64,
    check_utf8,
    to_bytes,
)

__all__ = ["Client", "ClientConfig", "Seconds", "RecordLike"]

#: A record to publish: a :class:`RecordIn`, or just its payload.
RecordLike = Union[RecordIn, Payload]

_MAX_U63 = (1 << 63) - 1
#: Seconds fields of :class:`ClientConfig`.
_DURATIONS = ("request_timeout", "connect_timeout", "reconnect_backoff_initial", "reconnect_backoff_max")


@dataclass(frozen=True)
class ClientConfig:
    """How a :class:`Client` connects and behaves. Pass one to
    :meth:`Client.connect` as ``config=``, or its fields as keyword arguments.
    Durations are seconds or :class:`datetime.timedelta` (stored as ``float``
    seconds); a bad value raises :class:`~felix.errors.InvalidArgument`.

    Attributes:
        token: authentication token sent in HELLO. A broker with a tokens
            file requires one it lists; a broker without one refuses any.
        ack_on_commit: answer publishes only once their records are durable
            (commit acks). Needs :attr:`Feature.PUBLISH_ACK_MODE`; publishes
            to a broker without it raise :class:`~felix.errors.Unsupported`.
        request_timeout: seconds to wait for an answer. A request that asks
            the broker to wait (a long poll) gets that wait on top.
        connect_timeout: seconds to open a connection and complete HELLO.
        client_name: sent in HELLO; shows up in the broker's logs (at most
            65535 bytes of UTF-8).
        max_frame_bytes: largest response frame accepted.
        reconnect_backoff_initial: first delay before reconnecting after a
            failed connection attempt, in seconds.
        reconnect_backoff_max: the delay doubles after each failure up to this.
    """

    token: Optional[str] = None
    ack_on_commit: bool = False
    request_timeout: Seconds = 30.0
    connect_timeout: Seconds = 5.0
    client_name: str = f"felix-client-py/{__version__}"
    max_frame_bytes: int = 64 << 20
    reconnect_backoff_initial: Seconds = 0.1
    reconnect_backoff_max: Seconds = 5.0

    def __post_init__(self) -> None:
        for name in _DURATIONS:
            seconds = _seconds(name, getattr(self, name))
            if seconds <= 0:
                raise InvalidArgument(f"{name} must be more than zero, not {getattr(self, name)!r}")
            object.__setattr__(self, name, seconds)
        check_int("max_frame_bytes", self.max_frame_bytes, _MAX_U32, minimum=4096)
        if not isinstance(self.ack_on_commit, bool):
            raise InvalidArgument(f"ack_on_commit must be a bool, not {type(self.ack_on_commit).__name__}")
        if self.token is not None and len(check_utf8("token", self.token)) > 0xFFFF:
            raise InvalidArgument("token is over 65535 bytes")
        if len(check_utf8("client_name", self.client_name)) > 0xFFFF:
            raise InvalidArgument("client_name is over 65535 bytes")


@dataclass(frozen=True)
class _Placement:
    """Shard count and owning core per shard of one stream."""

    shards: int
    cores: Tuple[int, ...]


class _Slot:
    """The connection to one core, and its reconnect state."""

    def __init__(self, backoff: float, conn: Optional[Connection] = None) -> None:
        self.lock = threading.Lock()
        self.conn = conn
        self.backoff = backoff
        self.retry_at: Optional[float] = None
        self.last_error: Optional[FelixError] = None
        #: Bumped after every connection attempt, so callers that queued
        #: behind a failed attempt share its failure instead of each retrying.
        self.attempts = 0


def _copy_error(error: FelixError) -> FelixError:
    """A fresh instance of ``error`` (one exception object is never raised in
    two threads), keeping its code, number, core, leader, not_applied and cause."""
    copy = type(error)(
        error.message,
        number=error.number,
        core=error.core,
        leader=error.leader,
        not_applied=error.not_applied,
    )
    copy.__cause__ = error.__cause__
    return copy


def _unexpected(response: _wire.Response, call: str) -> ProtocolError:
    return ProtocolError(f"broker answered {call} with {response.name}")


def _expect(response: _wire.Response, call: str, *names: str) -> _wire.Response:
    if response.name not in names:
        raise _unexpected(response, call)
    return response


def client_config(config: Optional[ClientConfig], **options: object) -> ClientConfig:
    """``config`` (a :class:`ClientConfig`; its defaults if ``None``) with the
    fields named in ``options`` that are not ``None`` replaced: what
    :meth:`Client.connect` and :meth:`~felix.ClusterClient.connect` take."""
    if config is None:
        config = ClientConfig()
    elif not isinstance(config, ClientConfig):
        raise InvalidArgument(f"config must be a ClientConfig, not {type(config).__name__}")
    given = {k: v for k, v in options.items() if v is not None}
    return replace(config, **given) if given else config


def _parse_addr(addr: Union[str, Tuple[str, int]]) -> Tuple[str, int]:
    if isinstance(addr, tuple):
        if len(addr) != 2:
            raise InvalidArgument(f"broker address {addr!r} must be a (host, port) tuple")
        host, port = addr
    elif isinstance(addr, str) and ":" in addr:
        host, _, port_text = addr.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not port_text.isdigit():
            raise InvalidArgument(f"broker address {addr!r} must be host:port")
        port = int(port_text)
    else:
        raise InvalidArgument(f"broker address {addr!r} must be 'host:port' or a (host, port) tuple")
    if not isinstance(host, str) or not host:
        raise InvalidArgument(f"broker host must be a non-empty str, not {host!r}")
    check_int("port", port, 65535, minimum=1)
    return host, port


def _resolve(host: str, port: int) -> List[SockAddr]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConnectionFailed(f"cannot resolve {host!r}: {e}") from e
    except UnicodeError as e:
        raise InvalidArgument(f"broker host {host!r} is not a valid host name: {e}") from None
    if not infos:
        raise InvalidArgument(f"broker address {host}:{port} resolved to nothing")
    return [(family, sockaddr) for family, _, _, _, sockaddr in infos]


#: How long close() waits for each reader thread to end.
_CLOSE_WAIT = 1.0


def _close_slots(lock: threading.Lock, slots: Dict[int, _Slot], closed: threading.Event, wait: float) -> None:
    """Close a client's connections (:meth:`Client.close`, or its finalizer).
    Takes the client's state, never the client, so a finalizer can call it."""
    with lock:
        closed.set()
        items = list(slots.values())
    for slot in items:
        with slot.lock:
            conn, slot.conn = slot.conn, None
        if conn is not None:
            conn.close("the client was closed", wait)


def _check_group(group: str) -> str:
    return check_name("group", group)


def _check_shard(shard: int) -> int:
    return check_u32("shard", shard)


def _check_record(item: RecordLike) -> RecordIn:
    if isinstance(item, RecordIn):
        return item
    return RecordIn.of(item)


def check_records(records: Iterable[RecordLike], key: Optional[bytes] = None) -> List[RecordIn]:
    """Records to publish, checked; ``key`` is given to those without one."""
    if isinstance(records, (bytes, bytearray, memoryview, str, RecordIn)):
        raise InvalidArgument("publish_batch takes a list of records, not a single record")
    out = [_check_record(r) for r in records]
    if not out:
        raise InvalidArgument("a publish needs at least one record")
    if len(out) > _wire.MAX_ITEMS_PER_VEC:
        raise InvalidArgument(
            f"publish of {len(out)} records: a request carries at most {_wire.MAX_ITEMS_PER_VEC}; split it"
        )
    if key is not None:
        out = [r if r.key is not None else replace(r, key=key) for r in out]
    return out


#: What an ack takes: an offset, a :class:`GroupRecord`, or an iterable of either.
Offsets = Union[int, GroupRecord, Iterable[Union[int, GroupRecord]]]


def check_ack_offsets(offsets: Offsets) -> List[int]:
    """The offsets of an ack, checked: at most a request's worth."""
    if isinstance(offsets, (int, GroupRecord)):
        items = [offsets]
    elif isinstance(offsets, (str, bytes)) or not hasattr(offsets, "__iter__"):
        raise InvalidArgument(f"an ack takes an offset, a GroupRecord, or an iterable of them, not {offsets!r}")
    else:
        items = list(offsets)
    batch = [check_u64("offset", o.offset if isinstance(o, GroupRecord) else o) for o in items]
    if len(batch) > _wire.MAX_ITEMS_PER_VEC:
        raise InvalidArgument(f"an ack carries at most {_wire.MAX_ITEMS_PER_VEC} offsets, not {len(batch)}")
    return batch


def _check_dead_letter_page(from_offset: int, page: DeadLetterPage) -> None:
    """A page must move forward: letters ascending from ``from_offset``, below
    ``next``, and not empty while more are promised."""
    previous: Optional[int] = None
    for letter in page.letters:
        if letter.offset < from_offset or (previous is not None and letter.offset <= previous):
            raise ProtocolError(f"dead-letter page from {from_offset} lists offset {letter.offset} out of order")
        previous = letter.offset
    if page.next is not None and previous is None:
        raise ProtocolError(f"empty dead-letter page from {from_offset} promised more from {page.next}")
    if page.next is not None and previous is not None and page.next <= previous:
        raise ProtocolError(f"dead-letter page from {from_offset} ends at {previous} but says next {page.next}")


class Client(StreamGroupCalls):
    """A thread-safe connection to one Felix broker.

    Make one with :meth:`connect`; use it as a context manager or call
    :meth:`close`. Every method may be called from many threads at once.
    Requests are pipelined: each connection has a reader thread that pairs
    answers with requests by id, so a long poll never holds up a publish or
    an ack on the same connection.

    The client keeps one connection per broker core. A request about a shard
    goes to the core that owns it (learned from :meth:`describe_stream` and
    cached); a ``wrong_core`` answer refreshes the placement and is retried
    once on the core the broker named. Connections open lazily and reopen
    after a failure, waiting a growing backoff between failed attempts. A
    request in flight on a connection that drops fails with
    :class:`~felix.errors.Disconnected`; nothing is resent behind your back.

    Streams are named ``"tenant/namespace/stream"`` (or a :class:`StreamRef`).
    Durations are seconds (``float``) or :class:`datetime.timedelta`.
    """

    def __init__(self, addrs: List[SockAddr], config: ClientConfig, first: Connection, name: str = "") -> None:
        """Use :meth:`connect`."""
        self._addrs = addrs
        self._name = name
        self._config = config
        self._lock = threading.Lock()
        self._hello = first.hello
        self._home = first.hello.core
        self._slots: Dict[int, _Slot] = {first.hello.core: _Slot(config.reconnect_backoff_initial, first)}
        self._placements: Dict[StreamRef, _Placement] = {}
        self._closed = threading.Event()
        # A client dropped without close() still closes its connections (and
        # so its reader threads end) once it is garbage. The finalizer holds
        # the connection state, never the client itself.
        self._finalizer = weakref.finalize(self, _close_slots, self._lock, self._slots, self._closed, 0.0)
        # Not at interpreter exit: the process's sockets go with it, and a
        # thread mid-reconnect would hold the exit up.
        self._finalizer.atexit = False

    @classmethod
    def connect(
        cls,
        addr: Union[str, Tuple[str, int]],
        *,
        config: Optional[ClientConfig] = None,
        token: Optional[str] = None,
        ack_on_commit: Optional[bool] = None,
        request_timeout: Optional[Seconds] = None,
        connect_timeout: Optional[Seconds] = None,
        client_name: Optional[str] = None,
        max_frame_bytes: Optional[int] = None,
        reconnect_backoff_initial: Optional[Seconds] = None,
        reconnect_backoff_max: Optional[Seconds] = None,
    ) -> "Client":
        """Resolve ``addr`` (``"host:port"`` or a ``(host, port)`` tuple), open a
        first connection and say HELLO.

        Settings come from ``config`` (a :class:`ClientConfig`; its defaults
        if not given), with any keyword argument given (not ``None``)
        overriding the field of that name.

        Raises :class:`~felix.errors.Unauthorized` for a refused token,
        :class:`~felix.errors.ConnectionFailed` or
        :class:`~felix.errors.Timeout` when the broker cannot be reached.
        """
        config = client_config(
            config,
            token=token,
            ack_on_commit=ack_on_commit,
            request_timeout=request_timeout,
            connect_timeout=connect_timeout,
            client_name=client_name,
            max_frame_bytes=max_frame_bytes,
            reconnect_backoff_initial=reconnect_backoff_initial,
            reconnect_backoff_max=reconnect_backoff_max,
        )
        host, port = _parse_addr(addr)
        addrs = _resolve(host, port)
        name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return cls(addrs, config, cls._open(addrs, None, config), name)

    @staticmethod
    def _open(addrs: List[SockAddr], want_core: Optional[int], config: ClientConfig) -> Connection:
        return Connection.open(
            addrs,
            want_core,
            client_name=config.client_name,
            token=config.token,
            connect_timeout=float(config.connect_timeout),
            max_frame_bytes=config.max_frame_bytes,
        )

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"connected to cores {self.connected_cores}"
        return f"<felix.Client {self._name or '?'} broker={self.broker!r} cores={self.cores} {state}>"

    def close(self) -> None:
        """Close every connection. Calls in flight fail with
        :class:`~felix.errors.Disconnected`, and so do later calls. When this
        returns the client's sockets are closed and its reader threads have
        ended (each is given up to a second)."""
        self._finalizer.detach()
        _close_slots(self._lock, self._slots, self._closed, _CLOSE_WAIT)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    @property
    def connected_cores(self) -> List[int]:
        """The cores this client holds a live connection to, in order."""
        with self._lock:
            slots = list(self._slots.items())
        return sorted(core for core, slot in slots if slot.conn is not None and not slot.conn.closed)

    # --- what the broker said ------------------------------------------------

    @property
    def config(self) -> ClientConfig:
        """The settings this client was made with."""
        return self._config

    @property
    def features(self) -> Feature:
        """Feature bits negotiated with the broker, from the most recent HELLO."""
        return self._hello.features

    def has_feature(self, feature: Feature) -> bool:
        """Whether the broker advertised every bit of ``feature``."""
        return self.features & feature == feature

    @property
    def cores(self) -> int:
        """How many cores (shard owners) the broker runs."""
        return self._hello.cores

    @property
    def broker(self) -> str:
        """The broker's name and version, as it gave them in HELLO."""
        return self._hello.broker

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame the broker accepts (from HELLO)."""
        return self._hello.max_frame_bytes

    def _require(self, bits: Feature, what: str) -> None:
        missing = bits & ~self.features
        if missing:
            names = " and ".join(f"FEATURE_{f.name}" for f in Feature if f & missing)
            raise Unsupported(f"{what} needs {names}, which the broker does not advertise")

    # --- connections and routing ---------------------------------------------

    def _slot(self, core: int) -> _Slot:
        with self._lock:
            if self._closed.is_set():
                raise Disconnected("the client is closed")
            slot = self._slots.get(core)
            if slot is None:
                slot = self._slots[core] = _Slot(self._config.reconnect_backoff_initial)
            return slot

    def _conn(self, core: int) -> Connection:
        """The live connection to ``core``, opening one if needed."""
        slot = self._slot(core)
        seen = slot.attempts
        with slot.lock:
            if slot.conn is not None:
                if not slot.conn.closed:
                    return slot.conn
                self._retire(slot)
            if slot.attempts != seen and slot.last_error is not None:
                # Someone tried while we queued for the lock, and failed.
                raise _copy_error(slot.last_error)
            if slot.retry_at is not None:
                # Wait out the backoff, but not past a close().
                self._closed.wait(min(max(slot.retry_at - time.monotonic(), 0), MAX_WAIT))
            # close() may have run while this queued for the lock or waited:
            # open nothing after it (it closes what it finds under this lock).
            if self._closed.is_set():
                raise Disconnected("the client is closed")
            return self._reconnect(slot, core)

    def _retire(self, slot: _Slot) -> None:
        """Drop a closed connection; one that closed before proving itself
        counts as a failed attempt, so the backoff keeps growing."""
        assert slot.conn is not None
        if slot.conn.proved():
            slot.backoff = self._config.reconnect_backoff_initial
        else:
            self._back_off(slot)
        slot.conn = None

    def _back_off(self, slot: _Slot) -> None:
        slot.retry_at = time.monotonic() + slot.backoff
        slot.backoff = min(slot.backoff * 2, self._config.reconnect_backoff_max)

    def _reconnect(self, slot: _Slot, core: int) -> Connection:
        try:
            conn = self._open(self._addrs, core, self._config)
        except InvalidRequest as e:
            slot.attempts += 1
            if core > 0 and self._learn_cores() and core >= self.cores:
                # The broker came back with fewer cores; callers routing by
                # core try again where the shard is now.
                slot.last_error = ConnectionFailed(f"the broker no longer runs core {core} (it runs {self.cores}): {e}")
                raise slot.last_error from e
            self._failed(slot, e)
            raise
        except FelixError as e:
            slot.attempts += 1
            self._failed(slot, e)
            raise
        slot.attempts += 1
        self._learn_hello(conn.hello)
        slot.retry_at = None
        slot.last_error = None
        slot.conn = conn
        return conn

    def _failed(self, slot: _Slot, error: FelixError) -> None:
        self._back_off(slot)
        slot.last_error = error

    def _learn_hello(self, hello: _wire.HelloOk) -> None:
        with self._lock:
            if hello.cores != self._hello.cores:
                # Restarted with another core count: placements moved.
                self._placements.clear()
            self._hello = hello
            if self._home >= hello.cores:
                self._home = hello.core

    def _learn_cores(self) -> bool:
        """After the broker refused a core: HELLO without asking for one and
        take its core count. False if the broker could not be reached."""
        try:
            conn = self._open(self._addrs, None, self._config)
        except FelixError:
            return False
        conn.close("only asked for the core count")
        self._learn_hello(conn.hello)
        return True

    def _conn_or_moved(self, core: int, again: Callable[[], int]) -> Connection:
        """``core``'s connection; if the broker no longer runs that core, the
        connection to the core ``again`` picks now."""
        try:
            return self._conn(core)
        except FelixError:
            if core < self.cores:
                raise
        return self._conn(again())

    def _timeout(self, wait: float) -> float:
        return float(self._config.request_timeout) + wait

    def _call_any(self, request: _wire.WireRequest) -> _wire.Response:
        """A request not about one shard: the home connection serves it."""
        conn = self._conn_or_moved(self._home, lambda: self._home)
        return self._raise_error(conn.call(request, self._timeout(0)))

    @staticmethod
    def _raise_error(response: _wire.Response) -> _wire.Response:
        if response.name == "error":
            raise response.value
        return response

    def _cache_placement(self, info: StreamInfo) -> _Placement:
        placement = _Placement(info.shards, info.placement)
        with self._lock:
            self._placements[info.stream] = placement
        return placement

    def _placement(self, stream: StreamRef, refresh: bool = False) -> _Placement:
        if not refresh:
            with self._lock:
                cached = self._placements.get(stream)
            if cached is not None:
                return cached
        # Built from the answer itself: the cache may be cleared meanwhile.
        info = self._describe_stream(stream)
        return _Placement(info.shards, info.placement)

    def _core_for(self, stream: StreamRef, shard: int) -> int:
        """The core to send a request about ``shard`` to. An error looking
        it up is raised as the request's, which was not sent (so
        ``not_applied``)."""
        cores = self.cores
        if cores <= 1:
            return self._home
        try:
            placement = self._placement(stream)
            if shard < len(placement.cores) and placement.cores[shard] >= cores:
                # Cached before the broker came back with fewer cores.
                placement = self._placement(stream, refresh=True)
        except FelixError as e:
            e.not_applied = True
            raise
        if shard < len(placement.cores) and placement.cores[shard] < cores:
            return placement.cores[shard]
        # A shard the placement does not know: let the broker answer.
        return self._home

    def _call_shard(self, stream: StreamRef, shard: int, request: _wire.WireRequest, wait: float = 0.0) -> _wire.Response:
        """Send a request about ``shard`` to the core that owns it, following
        one ``wrong_core`` redirect."""
        core = self._core_for(stream, shard)
        conn = self._conn_or_moved(core, lambda: self._core_for(stream, shard))
        response = conn.call(request, self._timeout(wait))
        if response.name == "error" and isinstance(response.value, WrongCore):
            return self._redirect(stream, shard, request, response.value, wait)
        return self._raise_error(response)

    def _redirect(self, stream: StreamRef, shard: int, request: _wire.WireRequest, error: WrongCore, wait: float) -> _wire.Response:
        """After ``wrong_core``: refresh the placement and send once more, to the
        core the broker named (or the fresh placement's). A failed refresh
        does not stop the retry on the named core (as in the Rust client)."""
        core = self._redirect_core(stream, shard, error)
        return self._raise_error(self._conn(core).call(request, self._timeout(wait)))

    def _redirect_core(self, stream: StreamRef, shard: int, error: WrongCore) -> int:
        """Where to send a request again after ``error``; raises it if nowhere."""
        try:
            placement: Optional[_Placement] = self._placement(stream, refresh=True)
        except FelixError:
            placement = None
        cores = self.cores
        fresh = placement.cores[shard] if placement is not None and shard < len(placement.cores) else None
        candidates = [c for c in (error.core, fresh) if c is not None and c < cores]
        if not candidates:
            raise error
        return candidates[0]

    # --- streams ---------------------------------------------------------

    def ping(self) -> float:
        """Round trip to the broker's home connection, in seconds."""
        started = time.monotonic()
        _expect(self._call_any(_wire.ping()), "ping", "pong")
        return time.monotonic() - started

    def create_stream(
        self,
        stream: StreamLike,
        shards: int,
        *,
        retention_bytes: Optional[int] = None,
        retention_ms: Optional[int] = None,
        incarnation: Optional[int] = None,
    ) -> StreamInfo:
        """Create a stream of ``shards`` shards. ``retention_bytes`` (per shard)
        and ``retention_ms`` bound what is kept; ``None`` leaves it unlimited.

        ``incarnation`` (1 to 2**63 - 1) names this creation of the stream on
        a broker in a cluster; every broker must hold the same one, which
        :meth:`felix.ClusterClient.create_stream` sees to. Needs
        :attr:`Feature.STREAM_INCARNATION`: without it the create raises
        :class:`~felix.errors.Unsupported` and sends nothing. Created on one
        broker of a cluster without one, the stream is that broker's alone
        (``docs/operations.md``, "A cluster").

        Raises :class:`~felix.errors.AlreadyExists` if the stream exists.
        """
        ref = StreamRef.parse(stream)
        check_int("shards", shards, (1 << 32) - 1, minimum=1)
        for what, value in (("retention_bytes", retention_bytes), ("retention_ms", retention_ms)):
            if value is not None:
                check_int(what, value, _MAX_U63)
        if incarnation is not None:
            check_int("incarnation", incarnation, _MAX_U63, minimum=1)
            self._require(Feature.STREAM_INCARNATION, "a stream incarnation")
        with self._lock:
            self._placements.pop(ref, None)
        response = self._call_any(_wire.create_stream(ref, shards, retention_bytes, retention_ms, incarnation))
        if response.name == "ok":
            return self._describe_stream(ref)
        info: StreamInfo = _expect(response, "create_stream", "stream").value
        self._cache_placement(info)
        return info

    def describe_stream(self, stream: StreamLike) -> StreamInfo:
        """A stream's shard count, retention and placement."""
        return self._describe_stream(StreamRef.parse(stream))

    def _describe_stream(self, ref: StreamRef) -> StreamInfo:
        try:
            response = self._call_any(_wire.describe_stream(ref))
        except NotFound:
            with self._lock:
                self._placements.pop(ref, None)
            raise
        info: StreamInfo = _expect(response, "describe_stream", "stream").value
        self._cache_placement(info)
        return info

    def list_streams(self, tenant: Optional[str] = None) -> List[StreamInfo]:
        """Every stream, or those of one tenant."""
        if tenant is not None:
            check_name("tenant", tenant)
        infos: List[StreamInfo] = _expect(self._call_any(_wire.list_streams(tenant)), "list_streams", "streams").value
        for info in infos:
            self._cache_placement(info)
        return infos

    def delete_stream(self, stream: StreamLike) -> None:
        """Delete a stream and everything in it."""
        ref = StreamRef.parse(stream)
        try:
            _expect(self._call_any(_wire.delete_stream(ref)), "delete_stream", "ok")
        finally:
            with self._lock:
                self._placements.pop(ref, None)

    def describe_shard(self, stream: StreamLike, shard: int) -> ShardInfo:
        """One shard's offsets, size and owning core."""
        ref = StreamRef.parse(stream)
        response = self._call_shard(ref, _check_shard(shard), _wire.describe_shard(ref, shard))
        return _expect(response, "describe_shard", "shard").value

    def describe_replica(self, stream: StreamLike, shard: int) -> ReplicaInfo:
        """This broker's replica of one shard, as it sees it: role, term,
        the leader it knows (with its client address) and replication
        indices; on the leader, every other broker's progress. Only a broker
        in a cluster answers (``Feature.REPLICA_INFO``); any of them does,
        leader or not."""
        self._require(Feature.REPLICA_INFO, "describe_replica")
        ref = StreamRef.parse(stream)
        response = self._call_shard(ref, _check_shard(shard), _wire.describe_replica(ref, shard))
        return _expect(response, "describe_replica", "replica").value

    def describe_cluster(self) -> ClusterInfo:
        """Every broker of the cluster this broker belongs to, with the
        address clients reach it at (its ``server.listen``), in node order,
        and this broker's own node id::

            info = client.describe_cluster()
            for member in info.members:
                print(member.node, member.addr)

        Needs :attr:`Feature.CLUSTER_INFO`, which only a broker in a cluster
        advertises: without it this raises :class:`~felix.errors.Unsupported`
        and sends nothing. From one broker's address a client learns the
        others (:meth:`felix.ClusterClient.connect` does)."""
        self._require(Feature.CLUSTER_INFO, "describe_cluster")
        return _expect(self._call_any(_wire.describe_cluster()), "describe_cluster", "cluster").value

    # --- publishing --------------------------------------------------------

    def _ack_mode(self) -> int:
        if self._config.ack_on_commit:
            self._require(Feature.PUBLISH_ACK_MODE, "ack_on_commit")
            return _wire.ACK_DURABLE
        return _wire.ACK_DEFAULT

    def publish(
        self,
        stream: StreamLike,
        shard: int,
        payload: Payload,
        *,
        key: Optional[Payload] = None,
        headers: Sequence[Tuple[str, Payload]] = (),
        timestamp_ms: Optional[int] = None,
    ) -> int:
        """Publish one record to ``shard``; returns its offset. ``key`` is
        stored with the record (it does not route it: see :meth:`publish_keyed`)."""
        record = RecordIn.of(payload, key=key, headers=headers, timestamp_ms=timestamp_ms)
        return self.publish_batch(stream, shard, [record]).base_offset

    def publish_batch(self, stream: StreamLike, shard: int, records: Iterable[RecordLike]) -> Published:
        """Publish records (:class:`RecordIn` or bare payloads) to ``shard`` in
        one request; they get consecutive offsets."""
        ref = StreamRef.parse(stream)
        batch = self._check_batch_size(check_records(records))
        request = _wire.publish(ref, _check_shard(shard), None, self._ack_mode(), batch)
        return self._published(self._call_shard(ref, shard, request))

    def publish_keyed(
        self,
        stream: StreamLike,
        key: Payload,
        payload: Payload,
        *,
        headers: Sequence[Tuple[str, Payload]] = (),
        timestamp_ms: Optional[int] = None,
    ) -> Published:
        """Publish one record with a routing key: it goes to the shard
        :func:`~felix.shard_for_key` picks over the stream's shard count, so
        records with one key keep their order. The key is stored with it."""
        record = RecordIn.of(payload, key=key, headers=headers, timestamp_ms=timestamp_ms)
        return self.publish_keyed_batch(stream, key, [record])

    def publish_keyed_batch(self, stream: StreamLike, key: Payload, records: Iterable[RecordLike]) -> Published:
        """Publish records in one request to the shard ``key`` routes to. Each
        record without a key of its own is stored with ``key``."""
        ref = StreamRef.parse(stream)
        routing = to_bytes("key", key)
        batch = self._check_batch_size(check_records(records, routing))
        try:
            shards = self._placement(ref).shards
        except FelixError as e:
            # Not sent (as in _core_for).
            e.not_applied = True
            raise
        shard = shard_for_key(routing, shards)
        request = _wire.publish(ref, None, routing, self._ack_mode(), batch)
        return self._published(self._call_shard(ref, shard, request))

    def _check_batch_size(self, batch: List[RecordIn]) -> List[RecordIn]:
        """Refuse records over the broker's frame limit before encoding them
        (:class:`~felix.errors.InvalidArgument`, as the Rust client does)."""
        size = sum(r.data_bytes() for r in batch)
        limit = self.max_frame_bytes
        if size > limit:
            raise InvalidArgument(
                f"publish of {len(batch)} records holds {size} bytes, "
                f"over the broker's frame limit of {limit} bytes; split it"
            )
        return batch

    @staticmethod
    def _published(response: _wire.Response) -> Published:
        shard, base_offset, count = _expect(response, "publish", "published").value
        return Published(shard=shard, base_offset=base_offset, count=count)

    # --- reading -------------------------------------------------------------

    def read(
        self,
        stream: StreamLike,
        shard: int,
        start: Start,
        *,
        max_records: int = 500,
        wait: Seconds = 0,
    ) -> ReadBatch:
        """Read up to ``max_records`` records of ``shard`` from ``start``
        (:attr:`StartPosition.EARLIEST`, :attr:`StartPosition.LATEST`, or an
        offset). With ``wait``, the broker holds the read up to that long for
        records to arrive when there are none; an empty batch is not an error.
        An offset past the shard's tail is refused with
        :class:`~felix.errors.InvalidRequest`."""
        ref = StreamRef.parse(stream)
        position = StartPosition.of(start)
        check_int("max_records", max_records, (1 << 32) - 1, minimum=1)
        wait_ms = _ms_u32("wait", wait)
        max_bytes = min(max(self._config.max_frame_bytes // 2, 64 * 1024), _MAX_U32)
        request = _wire.read(ref, _check_shard(shard), position, max_records, max_bytes, wait_ms)
        response = self._call_shard(ref, shard, request, wait_ms / 1000)
        start_offset, next_offset, end_offset, records = _expect(response, "read", "records").value
        return ReadBatch(tuple(records), next_offset=next_offset, start_offset=start_offset, end_offset=end_offset)

    def subscribe(
        self,
        stream: StreamLike,
        shard: int,
        start: Start = StartPosition.EARLIEST,
        *,
        max_records: int = 500,
        wait: Seconds = 10.0,
    ) -> Subscription:
        """Follow ``shard`` from ``start``: an iterator over every record in
        offset order that long-polls at the tail. See :class:`Subscription`."""
        ref = StreamRef.parse(stream)
        check_int("max_records", max_records, (1 << 32) - 1, minimum=1)
        _seconds("wait", wait)
        return Subscription(self, ref, _check_shard(shard), StartPosition.of(start), max_records, wait)

    # --- consumer groups: consuming -----------------------------------------

    def group_poll(
        self,
        stream: StreamLike,
        shard: int,
        group: str,
        max_records: int = 16,
        *,
        wait: Seconds = 0,
        consumer: Optional[str] = None,
        reclaim: bool = False,
        visibility: Optional[Seconds] = None,
    ) -> List[GroupRecord]:
        """Claim up to ``max_records`` records for ``group`` (owed records
        first, then new ones). An empty list means nothing was available.

        Args:
            wait: how long the broker may wait for a record when none is
                available (capped by the broker's ``FELIX_GROUP_MAX_WAIT_MS``).
            consumer: poll as this named member (1 to 128 bytes) so a
                restarted process can take back what it held.
            reclaim: with ``consumer``, take back the records this member
                still holds from older connections (only the first poll
                with ``reclaim`` on a connection, for each shard, does;
                leaving it set is harmless).
            visibility: how long these claims stand instead of the broker's
                visibility timeout. Needs :attr:`Feature.GROUP_CLAIM_CONTROL`.
        """
        ref = StreamRef.parse(stream)
        check_int("max_records", max_records, (1 << 32) - 1, minimum=1)
        member = self._member(consumer, reclaim)
        visibility_ms = self._visibility_ms(visibility)
        wait_ms = _ms_u32("wait", wait)
        request = self._group_poll_request(ref, _check_shard(shard), _check_group(group), max_records, wait_ms, member, visibility_ms)
        return self._group_records(self._call_shard(ref, shard, request, wait_ms / 1000))

    @staticmethod
    def _visibility_ms(visibility: Optional[Seconds]) -> Optional[int]:
        if visibility is None:
            return None
        visibility_ms = _ms_u64("visibility", visibility)
        if visibility_ms == 0:
            raise InvalidArgument("a poll visibility must be more than zero")
        return visibility_ms

    def _group_poll_request(
        self,
        ref: StreamRef,
        shard: int,
        group: str,
        max_records: int,
        wait_ms: int,
        member: Optional[_wire.GroupMember],
        visibility_ms: Optional[int],
    ) -> _wire.WireRequest:
        """A checked poll request (the features it needs are required now)."""
        self._require(Feature.GROUPS, "a group poll")
        if visibility_ms is not None:
            self._require(Feature.GROUP_CLAIM_CONTROL, "a poll visibility")
        return _wire.group_poll(ref, shard, group, max_records, wait_ms, member, visibility_ms)

    def _group_records(self, response: _wire.Response) -> List[GroupRecord]:
        records: List[GroupRecord] = _expect(response, "group_poll", "group_records").value
        if not self.has_feature(Feature.GROUP_SKIPPED):
            records = [replace(r, skipped_before=None) for r in records]
        return records

    @staticmethod
    def _member(consumer: Optional[str], reclaim: bool) -> Optional[_wire.GroupMember]:
        if consumer is None:
            if reclaim:
                raise InvalidArgument("reclaim needs a consumer name")
            return None
        size = len(check_utf8("consumer", consumer))
        if not 1 <= size <= NAME_MAX_BYTES:
            raise InvalidArgument(f"a consumer name is 1 to {NAME_MAX_BYTES} bytes, not {size}")
        return _wire.GroupMember(consumer, bool(reclaim))

    def _group_ok(self, stream: StreamRef, shard: int, request: _wire.WireRequest) -> None:
        _expect(self._call_shard(stream, shard, request), request.name, "ok")

    def group_ack(
        self,
        stream: StreamLike,
        shard: int,
        group: str,
        offsets: Offsets,
    ) -> None:
        """Finish records: the group will not hand them out again. ``offsets``
        is an offset, a :class:`GroupRecord`, or an iterable of either (one
        request for all of them; an empty one sends nothing)."""
        self._require(Feature.GROUPS, "group_ack")
        ref = StreamRef.parse(stream)
        batch = check_ack_offsets(offsets)
        if batch:
            self._group_ok(ref, shard, self._group_ack_request(ref, _check_shard(shard), _check_group(group), batch))

    def _group_ack_request(self, ref: StreamRef, shard: int, group: str, offsets: List[int]) -> _wire.WireRequest:
        """An ack of checked ``offsets`` (the feature it needs is required now)."""
        self._require(Feature.GROUPS, "group_ack")
        return _wire.group_ack(ref, shard, group, offsets)

    def _group_nack_request(
        self, ref: StreamRef, shard: int, group: str, record: GroupRecord, delay: Seconds, reason: Optional[str]
    ) -> _wire.WireRequest:
        self._require(Feature.GROUPS, "group_nack")
        delay_ms = _ms_u64("delay", delay) or None
        if delay_ms is not None:
            self._require(Feature.GROUP_CLAIM_CONTROL, "a nack delay")
        offset, attempts = self._claim(record)
        return _wire.group_nack(ref, _check_shard(shard), _check_group(group), offset, attempts, delay_ms, reason)

    def group_nack(
        self, stream: StreamLike, shard: int, group: str, record: GroupRecord, *, reason: Optional[str] = None
    ) -> None:
        """Hand a claimed record back now, to be owed to the group again.
        ``reason`` is listed if this used up the record's last attempt.
        Raises :class:`~felix.errors.StaleClaim` if the claim lapsed and the
        record went out again."""
        self.group_nack_after(stream, shard, group, record, 0, reason=reason)

    def group_nack_after(
        self,
        stream: StreamLike,
        shard: int,
        group: str,
        record: GroupRecord,
        delay: Seconds,
        *,
        reason: Optional[str] = None,
    ) -> None:
        """Hand a claimed record back, to be owed again only once ``delay`` has
        passed. Needs :attr:`Feature.GROUP_CLAIM_CONTROL` unless ``delay`` is
        zero (a plain nack)."""
        ref = StreamRef.parse(stream)
        self._group_ok(ref, shard, self._group_nack_request(ref, shard, group, record, delay, reason))

    @staticmethod
    def _claim(record: GroupRecord) -> Tuple[int, int]:
        if not isinstance(record, GroupRecord):
            raise InvalidArgument(f"expected the GroupRecord a poll returned, not {type(record).__name__}")
        return record.offset, record.attempts

    def group_extend(self, stream: StreamLike, shard: int, group: str, record: GroupRecord, by: Seconds) -> float:
        """Let the claim on a record this consumer holds stand for ``by`` from
        now (a ``by`` shorter than what is left shortens it). Returns how
        long the claim now stands from now, in seconds (the broker caps
        it at ``FELIX_GROUP_MAX_VISIBILITY_MS``). Raises
        :class:`~felix.errors.StaleClaim` once the claim lapsed and the record
        went out again. Needs :attr:`Feature.GROUP_CLAIM_CONTROL`."""
        self._require(Feature.GROUPS | Feature.GROUP_CLAIM_CONTROL, "group_extend")
        ref = StreamRef.parse(stream)
        extend_ms = _ms_u64("by", by)
        if extend_ms == 0:
            raise InvalidArgument("an extension must be more than zero")
        offset, attempts = self._claim(record)
        request = _wire.group_extend(ref, _check_shard(shard), _check_group(group), offset, attempts, extend_ms)
        stands_ms: int = _expect(self._call_shard(ref, shard, request), "group_extend", "extended").value
        return stands_ms / 1000

    def group_dead_letter(
        self, stream: StreamLike, shard: int, group: str, record: GroupRecord, *, reason: Optional[str] = None
    ) -> None:
        """Give up on a claimed record: list it as a dead letter of the group
        (with ``reason``, up to 1 KiB kept) and finish it. Refused for a
        record already finished. Needs :attr:`Feature.GROUP_CLAIM_CONTROL`."""
        self._require(Feature.GROUPS | Feature.GROUP_CLAIM_CONTROL, "group_dead_letter")
        ref = StreamRef.parse(stream)
        offset, attempts = self._claim(record)
        request = _wire.group_dead_letter(ref, _check_shard(shard), _check_group(group), offset, attempts, reason)
        self._group_ok(ref, shard, request)

    def group_dead_letters(self, stream: StreamLike, shard: int, group: str) -> List[int]:
        """Offsets of the group's dead letters, in order (the whole list)."""
        return [d.offset for d in self.group_dead_letters_detailed(stream, shard, group)]

    def group_dead_letters_detailed(self, stream: StreamLike, shard: int, group: str) -> List[DeadLetterInfo]:
        """The group's dead letters with attempts, time, reason and who gave up,
        in offset order: the whole list, fetched a page at a time from a broker
        with :attr:`Feature.GROUP_DEAD_LETTER_PAGES`, in one answer otherwise.
        Pages are not one snapshot."""
        self._require(Feature.GROUPS, "group_dead_letters")
        if self.has_feature(Feature.GROUP_DEAD_LETTER_PAGES):
            letters: List[DeadLetterInfo] = []
            next_from: Optional[int] = 0
            while next_from is not None:
                page = self.group_dead_letters_page(stream, shard, group, next_from, (1 << 32) - 1)
                letters.extend(page.letters)
                next_from = page.next
            return letters
        ref = StreamRef.parse(stream)
        request = _wire.group_dead_letters(ref, _check_shard(shard), _check_group(group))
        return _expect(self._call_shard(ref, shard, request), "group_dead_letters", "dead_letters").value

    def group_dead_letters_page(
        self, stream: StreamLike, shard: int, group: str, from_offset: int = 0, max_letters: int = 1000
    ) -> DeadLetterPage:
        """One page of the group's dead letters: those at ``from_offset`` and
        above, in offset order, at most ``max_letters`` (the broker caps a page
        further). :attr:`DeadLetterPage.next` is the ``from_offset`` of the
        following page, ``None`` at the end. Needs
        :attr:`Feature.GROUP_DEAD_LETTER_PAGES`."""
        self._require(Feature.GROUPS | Feature.GROUP_DEAD_LETTER_PAGES, "group_dead_letters_page")
        ref = StreamRef.parse(stream)
        request = _wire.group_dead_letters_page(
            ref, _check_shard(shard), _check_group(group), check_u64("from_offset", from_offset), check_u32("max_letters", max_letters)
        )
        letters, next_from = _expect(
            self._call_shard(ref, shard, request), "group_dead_letters_page", "dead_letter_page"
        ).value
        page = DeadLetterPage(tuple(letters), next_from)
        _check_dead_letter_page(from_offset, page)
        return page

    def group_redrive(self, stream: StreamLike, shard: int, group: str, offset: int) -> None:
        """Put a dead letter back: its attempts reset and it is owed again."""
        self._require(Feature.GROUPS, "group_redrive")
        ref = StreamRef.parse(stream)
        self._group_ok(ref, shard, _wire.group_redrive(ref, _check_shard(shard), _check_group(group), check_u64("offset", offset)))

    def group_discard(self, stream: StreamLike, shard: int, group: str, offset: int) -> None:
        """Stop tracking a dead letter. The record stays in the log."""
        self._require(Feature.GROUPS, "group_discard")
        ref = StreamRef.parse(stream)
        self._group_ok(ref, shard, _wire.group_discard(ref, _check_shard(shard), _check_group(group), check_u64("offset", offset)))

    # --- consumer groups: administration --------------------------------------

    def group_create(self, stream: StreamLike, shard: int, group: str, start: Start = StartPosition.EARLIEST) -> None:
        """Create the group at ``start``. A group that already exists is left
        alone and this succeeds, so it is safe on every start of a consumer.
        Needs :attr:`Feature.GROUP_ADMIN`."""
        self._require(Feature.GROUPS | Feature.GROUP_ADMIN, "group_create")
        ref = StreamRef.parse(stream)
        request = _wire.group_create(ref, _check_shard(shard), _check_group(group), StartPosition.of(start))
        try:
            _expect(self._call_shard(ref, shard, request), "group_create", "ok", "group")
        except AlreadyExists:
            return

    def group_seek(self, stream: StreamLike, shard: int, group: str, start: Start) -> None:
        """Move an existing group to ``start``, backwards to replay or forwards
        to skip. Voids every standing claim. Needs :attr:`Feature.GROUP_ADMIN`."""
        self._require(Feature.GROUPS | Feature.GROUP_ADMIN, "group_seek")
        ref = StreamRef.parse(stream)
        request = _wire.group_seek(ref, _check_shard(shard), _check_group(group), StartPosition.of(start))
        _expect(self._call_shard(ref, shard, request), "group_seek", "ok", "group")

    def group_describe(self, stream: StreamLike, shard: int, group: str) -> GroupInfo:
        """Where the group stands: position, lag, in-flight, owed, delayed and
        dead-letter counts. Needs :attr:`Feature.GROUP_ADMIN`."""
        self._require(Feature.GROUPS | Feature.GROUP_ADMIN, "group_describe")
        ref = StreamRef.parse(stream)
        request = _wire.group_describe(ref, _check_shard(shard), _check_group(group))
        return _expect(self._call_shard(ref, shard, request), "group_describe", "group").value

    def group_delete(self, stream: StreamLike, shard: int, group: str) -> None:
        """Remove the group's position and dead letters. Needs :attr:`Feature.GROUP_ADMIN`."""
        self._require(Feature.GROUPS | Feature.GROUP_ADMIN, "group_delete")
        ref = StreamRef.parse(stream)
        self._group_ok(ref, shard, _wire.group_delete(ref, _check_shard(shard), _check_group(group)))

    def list_groups(self, stream: StreamLike, shard: int) -> List[str]:
        """Names of the groups on one shard."""
        self._require(Feature.GROUPS, "list_groups")
        ref = StreamRef.parse(stream)
        return _expect(self._call_shard(ref, shard, _wire.list_groups(ref, _check_shard(shard))), "list_groups", "groups").value

    # --- consumer groups: a whole stream ----------------------------------------
    # (group_create_stream, group_seek_stream, group_describe_stream and
    # group_delete_stream come from StreamGroupCalls)

    def sharded_group(
        self,
        stream: StreamLike,
        group: str,
        *,
        consumer: Optional[str] = None,
        reclaim: bool = False,
        visibility: Optional[Seconds] = None,
        wait_slice: Seconds = 1.0,
    ) -> ShardedGroup:
        """One consumer of ``group`` on every shard of ``stream``, polled as one
        queue: see :class:`~felix.ShardedGroup`. Asks the broker how many
        shards the stream has (:class:`~felix.errors.NotFound` if none).

        Args:
            consumer: poll every shard as this named member (1 to 128 bytes).
            reclaim: with ``consumer``, the first poll of each shard on a new
                connection takes back what the member held there.
            visibility: how long claims stand instead of the broker's
                visibility timeout (needs :attr:`Feature.GROUP_CLAIM_CONTROL`,
                checked on each poll).
            wait_slice: how long each waiting poll lasts before it is sent
                again (at least 10 ms). Longer sends fewer requests while
                the stream is idle; shorter makes ``close()`` quicker.
        """
        return ShardedGroup(
            BrokerPort(self, StreamRef.parse(stream)),
            group,
            consumer=consumer,
            reclaim=reclaim,
            visibility=visibility,
            wait_slice=wait_slice,
        )
