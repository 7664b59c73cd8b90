"""One TCP connection to one core of a broker.

A connection has a reader thread that decodes response frames and hands
each to the caller waiting on its request id, so any number of requests can
be in flight and answered in any order. Callers send their own frames,
one at a time under a lock.
"""

import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import _wire
from .errors import (
    ConnectionFailed,
    Disconnected,
    FelixError,
    InvalidArgument,
    ProtocolError,
    Timeout,
    Unsupported,
)

#: A resolved socket address, as ``getaddrinfo`` gives it.
SockAddr = Tuple[int, Tuple]

#: A connection open this long counts as healthy even if it answered nothing.
_PROVED_AFTER = 5.0
_RECV_CHUNK = 64 * 1024
_RECV_MAX = 4 * 1024 * 1024
_KEEPALIVE_IDLE = 30
_KEEPALIVE_INTERVAL = 10
_KEEPALIVE_PROBES = 3
#: How long sent bytes may go unacknowledged before the kernel drops the
#: connection (``TCP_USER_TIMEOUT``, milliseconds), as in the Rust client.
_UNACKED_TIMEOUT_MS = 60_000
#: The longest any single wait is allowed to be (``threading`` and sockets
#: refuse larger timeouts); longer durations are cut to this, as Rust does.
MAX_WAIT = 365 * 86400.0
#: The reader's socket timeout: a recv timing out just loops. Sends set their
#: own timeout (what is left of their request's deadline) under the send lock.
_IDLE_RECV_TIMEOUT = 60.0


class _Waiter:
    """A caller waiting for the answer to one request."""

    __slots__ = ("event", "response", "error", "notify")

    def __init__(self, notify: Optional[Callable[[], None]] = None) -> None:
        self.event = threading.Event()
        self.response: Optional[_wire.Response] = None
        self.error: Optional[FelixError] = None
        #: Called (from the thread that resolves it) once the answer is in.
        self.notify = notify

    def resolve(self, response: Optional[_wire.Response], error: Optional[FelixError]) -> None:
        self.response, self.error = response, error
        self.event.set()
        if self.notify is not None:
            try:
                self.notify()
            except Exception:  # noqa: BLE001 - must not kill the reader thread.
                pass


class Pending:
    """A request sent on a :class:`Connection` whose answer has not been taken
    yet (:meth:`Connection.start`). Its answer, an ``Error`` included, is
    :meth:`wait`'s; a request given up with :meth:`cancel` is forgotten."""

    __slots__ = ("_conn", "_name", "_id", "_waiter", "_timeout", "deadline")

    def __init__(self, conn: "Connection", name: str, request_id: int, waiter: _Waiter, timeout: float, deadline: float) -> None:
        self._conn = conn
        self._name = name
        self._id = request_id
        self._waiter = waiter
        self._timeout = timeout
        #: ``time.monotonic()`` after which the answer is no longer awaited.
        self.deadline = deadline

    def done(self) -> bool:
        """Whether the answer (or the connection's failure) is in."""
        return self._waiter.event.is_set()

    def cancel(self) -> bool:
        """Stop waiting for the answer. True if it had not come (and now never
        will be delivered); False if it is already in."""
        return self._conn._forget(self._id)

    def wait(self) -> _wire.Response:
        """Block until the answer is in, or the deadline: :class:`Timeout`."""
        if not self._waiter.event.wait(max(self.deadline - time.monotonic(), 0)):
            if self.cancel():
                raise Timeout(f"no answer to {self._name} within {self._timeout:.3g} s")
            # The answer is being handed over right now.
            self._waiter.event.wait()
        return self.outcome()

    def outcome(self) -> _wire.Response:
        """The answer of a request that is :meth:`done`: the response, or the
        connection's failure raised."""
        if self._waiter.error is not None:
            raise self._waiter.error
        assert self._waiter.response is not None
        return self._waiter.response


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalive and a user timeout so a path that goes dead
    without a reset is noticed in about a minute. Tuning, not correctness:
    an option the platform lacks or refuses is skipped."""
    for level, name, value in (
        (socket.IPPROTO_TCP, "TCP_NODELAY", 1),
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", _KEEPALIVE_IDLE),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", _KEEPALIVE_INTERVAL),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", _KEEPALIVE_PROBES),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", _UNACKED_TIMEOUT_MS),
    ):
        option = getattr(socket, name, None)
        if option is None:
            continue
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass  # Refused on this platform or socket: use it as it is.


def _time_left(deadline: float, what: str) -> float:
    """Seconds until ``deadline``; :class:`Timeout` once it has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise Timeout(what)
    return remaining


def _show_addr(sockaddr: object) -> str:
    """``host:port`` (``[host]:port`` for IPv6) for a socket address tuple."""
    if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
        host, port = sockaddr[0], sockaddr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(sockaddr)


def _connect_first(addrs: Sequence[SockAddr], deadline: float) -> socket.socket:
    """A socket connected to the first address that answers before ``deadline``."""
    errors: List[str] = []
    for family, sockaddr in addrs:
        remaining = _time_left(deadline, "no connection to the broker within the connect timeout")
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(remaining)
            sock.connect(sockaddr)
            _tune(sock)
            return sock
        except socket.timeout:
            sock.close()
            raise Timeout(f"connecting to {_show_addr(sockaddr)} timed out") from None
        except OSError as e:
            sock.close()
            errors.append(f"{_show_addr(sockaddr)}: {e}")
        except BaseException:
            sock.close()
            raise
    raise ConnectionFailed("could not connect to the broker: " + "; ".join(errors or ["no address"]))


def _read_frame(
    sock: socket.socket, buf: bytearray, max_frame_bytes: int, deadline: float
) -> Tuple[_wire.FrameHeader, bytes]:
    """Block until ``buf`` holds one whole frame, and take it off the front.
    The whole wait is bounded by ``deadline`` (however slowly bytes trickle
    in): :class:`Timeout` once it passes."""
    while True:
        _check_hello_start(sock, buf, max_frame_bytes)
        taken = _take_frame(buf, max_frame_bytes)
        if taken is not None:
            return taken
        sock.settimeout(_time_left(deadline, "no answer to HELLO within the connect timeout"))
        chunk = sock.recv(_RECV_CHUNK)
        if not chunk:
            raise ConnectionFailed("the broker closed the connection during HELLO")
        buf += chunk


def _check_hello_start(sock: socket.socket, buf: bytearray, max_frame_bytes: int) -> None:
    """Raise :class:`ProtocolError` naming the likely mistake when the first
    bytes answering HELLO cannot be a Felix frame: an HTTP answer (the
    metrics port?) or a length prefix no HELLO answer could have."""
    if len(buf) < 4:
        return
    try:
        where = _show_addr(sock.getpeername())
    except OSError:
        where = "that address"
    if bytes(buf[:4]) == b"HTTP":
        raise ProtocolError(f"not a Felix broker at {where} (it answered HTTP: the metrics port?)")
    length = int.from_bytes(buf[:4], "little")
    if length > max_frame_bytes or length < _wire.HEADER_AFTER_LEN:
        raise ProtocolError(
            f"not a Felix broker at {where}: its first answer declares a {length}-byte frame"
        )


def _take_frame(buf: bytearray, max_frame_bytes: int) -> Optional[Tuple[_wire.FrameHeader, bytes]]:
    """One frame off the front of ``buf``, or None if it has not all arrived.
    Raises :class:`ProtocolError` for a length prefix the stream cannot
    recover from."""
    if len(buf) < 4:
        return None
    length = int.from_bytes(buf[:4], "little")
    _wire.check_frame_len(length, max_frame_bytes)
    total = 4 + length
    if len(buf) < total:
        return None
    with memoryview(buf) as view:
        header = _wire.FrameHeader.parse(view[: _wire.FRAME_HEADER_BYTES])
        body = bytes(view[_wire.FRAME_HEADER_BYTES : total])  # The one copy of the body.
    del buf[:total]
    return header, body


class Connection:
    """A connection to one broker core, past its HELLO.

    Thread-safe: :meth:`call` may be used from many threads at once.
    """

    def __init__(
        self,
        sock: socket.socket,
        hello: _wire.HelloOk,
        buffered: bytearray,
        max_frame_bytes: int,
    ) -> None:
        self.hello = hello
        self._sock = sock
        self._max_frame_bytes = max_frame_bytes
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._waiters: Dict[int, _Waiter] = {}
        self._next_id = 1
        self._closed: Optional[str] = None
        self._answered = False
        self._opened = time.monotonic()
        sock.settimeout(_IDLE_RECV_TIMEOUT)
        self._reader = threading.Thread(
            target=self._read_loop,
            args=(buffered,),
            name=f"felix-reader-core{hello.core}",
            daemon=True,
        )
        self._reader.start()

    @classmethod
    def open(
        cls,
        addrs: Sequence[SockAddr],
        want_core: Optional[int],
        *,
        client_name: str,
        token: Optional[str],
        connect_timeout: float,
        max_frame_bytes: int,
    ) -> "Connection":
        """Connect, say HELLO (asking for ``want_core`` if given) and start the
        reader thread. The whole exchange is bounded by ``connect_timeout``.

        Raises the broker's error for a refused HELLO (``Unauthorized``, ...),
        :class:`Unsupported` for another protocol version,
        :class:`ConnectionFailed` or :class:`Timeout` otherwise.
        """
        deadline = time.monotonic() + min(connect_timeout, MAX_WAIT)
        sock = _connect_first(addrs, deadline)
        try:
            hello, buffered = cls._say_hello(sock, deadline, want_core, client_name, token, max_frame_bytes)
            return cls(sock, hello, buffered, max_frame_bytes)
        except BaseException:
            sock.close()
            raise

    @staticmethod
    def _say_hello(
        sock: socket.socket,
        deadline: float,
        want_core: Optional[int],
        client_name: str,
        token: Optional[str],
        max_frame_bytes: int,
    ) -> Tuple[_wire.HelloOk, bytearray]:
        request = _wire.hello(_wire.FEATURES_ALL, want_core, client_name, token)
        buf = bytearray()
        try:
            sock.settimeout(_time_left(deadline, "no connection to the broker within the connect timeout"))
            sock.sendall(request.frame)
            header, body = _read_frame(sock, buf, max_frame_bytes, deadline)
        except FelixError:
            raise  # Already typed (Timeout, ConnectionFailed, ProtocolError): do not wrap it again.
        except socket.timeout:
            raise Timeout("no answer to HELLO within the connect timeout") from None
        except OSError as e:
            raise ConnectionFailed(f"HELLO failed: {e}") from e
        try:
            answer = _wire.decode_response(header, body)
        except ProtocolError as e:
            raise ProtocolError(f"bad answer to HELLO: {e.message}") from None
        if answer.name == "error":
            raise answer.value
        if answer.name != "hello_ok":
            raise ProtocolError(f"broker answered HELLO with {answer.name}")
        hello: _wire.HelloOk = answer.value
        if hello.version != _wire.PROTOCOL_VERSION:
            raise Unsupported(
                f"broker speaks protocol version {hello.version}, this client version {_wire.PROTOCOL_VERSION}"
            )
        if want_core is not None and hello.core != want_core:
            raise ConnectionFailed(f"broker put the connection on core {hello.core} instead of core {want_core}")
        return hello, buf

    # --- state -------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the connection is gone (its calls fail with :class:`Disconnected`)."""
        with self._lock:
            return self._closed is not None

    def proved(self) -> bool:
        """Whether the connection proved healthy: the broker answered a request
        on it, or it stayed open a while."""
        return self._answered or time.monotonic() - self._opened >= _PROVED_AFTER

    def close(self, reason: str, wait: float = 0.0) -> None:
        """Mark the connection dead, fail every request in flight on it with
        :class:`Disconnected`, and wake the reader thread (which closes the
        socket). With ``wait``, wait up to that long for the reader thread to
        finish, so the socket is closed when this returns."""
        self._close(reason)
        if wait > 0 and threading.current_thread() is not self._reader:
            self._reader.join(wait)

    def _close(self, reason: str) -> None:
        with self._lock:
            if self._closed is not None:
                return
            self._closed = reason
            waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            waiter.resolve(None, Disconnected(f"connection to core {self.hello.core} lost: {reason}"))
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # Already disconnected: the reader thread has seen it or will.

    # --- requests ----------------------------------------------------------

    def call(self, request: _wire.WireRequest, timeout: float) -> _wire.Response:
        """Send ``request`` and wait up to ``timeout`` seconds (sending
        included) for its answer.

        An ``Error`` answer is returned, not raised, so the caller can look at
        it (a ``wrong_core`` error names the right core).
        """
        pending = self.start(request, timeout)
        try:
            return pending.wait()
        finally:
            pending.cancel()

    def start(self, request: _wire.WireRequest, timeout: float, notify: Optional[Callable[[], None]] = None) -> Pending:
        """Send ``request`` and return without waiting for its answer; it is
        awaited until ``timeout`` seconds from now (sending included).
        ``notify`` is called once the answer (or the connection's failure) is
        in, from the connection's reader thread or the thread closing it: it
        must be quick and must not call into this connection. Several
        requests started one after another are in flight at once."""
        deadline = time.monotonic() + min(timeout, MAX_WAIT)
        self._check(request)
        request_id, waiter = self._register(notify)
        try:
            self._send(request, request_id, deadline)
        except BaseException:
            self._forget(request_id)
            raise
        return Pending(self, request.name, request_id, waiter, timeout, deadline)

    def _check(self, request: _wire.WireRequest) -> None:
        """Refuse a request the broker on this connection would not take."""
        missing = request.required & ~self.hello.features
        if missing:
            raise Unsupported(
                f"{request.name} needs feature bits {int(missing):#x}, "
                "which the broker on this connection did not advertise"
            )
        limit = self.hello.max_frame_bytes
        if request.data_bytes > limit:
            raise InvalidArgument(
                f"{request.name} carries {request.data_bytes} bytes of records, "
                f"over the broker's frame limit of {limit} bytes; split it"
            )
        if len(request.frame) - 4 > limit:
            raise InvalidArgument(
                f"{request.name} request is {len(request.frame) - 4} bytes, "
                f"over the broker's frame limit of {limit} bytes"
            )

    def _register(self, notify: Optional[Callable[[], None]] = None) -> Tuple[int, _Waiter]:
        waiter = _Waiter(notify)
        with self._lock:
            if self._closed is not None:
                raise Disconnected(f"connection to core {self.hello.core} lost: {self._closed}")
            request_id = self._next_id
            self._next_id += 1
            self._waiters[request_id] = waiter
        return request_id, waiter

    def _forget(self, request_id: int) -> bool:
        """Stop waiting for ``request_id``; True if its answer had not come."""
        with self._lock:
            return self._waiters.pop(request_id, None) is not None

    def _send(self, request: _wire.WireRequest, request_id: int, deadline: float) -> None:
        """Write the frame, bounded by what is left of the request's deadline."""
        if not self._send_lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise Timeout("timed out waiting to send (the connection is busy sending)")
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout(f"no time left to send {request.name}")
            # The request's own frame, its id written in place: no copy.
            request.set_request_id(request_id)
            self._sock.settimeout(remaining)
            self._sock.sendall(request.frame)
            self._sock.settimeout(_IDLE_RECV_TIMEOUT)
        except socket.timeout:
            # Part of the frame may have gone out: the stream is unusable.
            self.close("send timed out")
            raise Timeout("timed out sending the request; the connection was dropped") from None
        except FelixError:
            raise
        except OSError as e:
            self.close(f"send failed: {e}")
            raise Disconnected(f"connection to core {self.hello.core} lost: {e}") from e
        except BaseException:
            # KeyboardInterrupt or the like mid-frame: what went out cannot
            # be taken back, so the stream is unusable.
            self.close("a send was interrupted")
            raise
        finally:
            self._send_lock.release()

    # --- the reader thread ---------------------------------------------------

    def _read_loop(self, buf: bytearray) -> None:
        reason = "the broker closed the connection"
        try:
            while self._drain(buf):
                want = _RECV_CHUNK
                if len(buf) >= 4:
                    want = min(max(4 + int.from_bytes(buf[:4], "little") - len(buf), _RECV_CHUNK), _RECV_MAX)
                try:
                    chunk = self._sock.recv(want)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                buf += chunk
        except ProtocolError as e:
            reason = f"protocol error: {e.message}"
        except OSError as e:
            reason = f"read failed: {e}"
        finally:
            self.close(reason)
            with self._send_lock:
                self._sock.close()

    def _drain(self, buf: bytearray) -> bool:
        """Hand out every whole frame in ``buf``; False once the connection is closed."""
        while True:
            if self._closed is not None:
                return False
            taken = _take_frame(buf, self._max_frame_bytes)
            if taken is None:
                return True
            self._dispatch(*taken)

    def _dispatch(self, header: _wire.FrameHeader, body: bytes) -> None:
        try:
            response = _wire.decode_response(header, body)
        except ProtocolError as e:
            # The frame was whole and is consumed, so the stream is still in
            # sync: fail only the request it answers (wire-protocol.md,
            # "Receiving a frame", step 5) and keep reading.
            self._complete(header.request_id, None, ProtocolError(f"undecodable answer: {e.message}"))
            return
        self._answered = True
        if header.request_id == 0 and response.name == "error":
            # Request id 0 is never in flight past HELLO: the broker's last
            # word before it drops the connection.
            self.close(f"the broker closed the connection: {response.value}")
            return
        self._complete(header.request_id, response, None)

    def _complete(self, request_id: int, response: Optional[_wire.Response], error: Optional[FelixError]) -> None:
        with self._lock:
            waiter = self._waiters.pop(request_id, None)
        # No waiter: the call timed out and nobody wants the answer any more.
        if waiter is not None:
            waiter.resolve(response, error)
