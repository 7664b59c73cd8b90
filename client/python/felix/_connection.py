"""One TCP connection to one core of a broker.

A connection has a reader thread that decodes response frames and hands
each to the caller waiting on its request id, so any number of requests can
be in flight and answered in any order. Callers send their own frames,
one at a time under a lock.
"""

import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from . import _wire
from .errors import (
    ConnectionFailed,
    Disconnected,
    FelixError,
    ProtocolError,
    Timeout,
    TooLarge,
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


class _Waiter:
    """A caller waiting for the answer to one request."""

    __slots__ = ("event", "response", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.response: Optional[_wire.Response] = None
        self.error: Optional[FelixError] = None

    def resolve(self, response: Optional[_wire.Response], error: Optional[FelixError]) -> None:
        self.response, self.error = response, error
        self.event.set()


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalive so a dead path is noticed in about a minute."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", _KEEPALIVE_IDLE),
        ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL),
        ("TCP_KEEPCNT", _KEEPALIVE_PROBES),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _connect_first(addrs: Sequence[SockAddr], deadline: float) -> socket.socket:
    """A socket connected to the first address that answers before ``deadline``."""
    errors: List[str] = []
    for family, sockaddr in addrs:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Timeout("no connection to the broker within the connect timeout")
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(remaining)
            sock.connect(sockaddr)
            _tune(sock)
            return sock
        except socket.timeout:
            sock.close()
            raise Timeout(f"connecting to {sockaddr} timed out") from None
        except OSError as e:
            sock.close()
            errors.append(f"{sockaddr}: {e}")
    raise ConnectionFailed("could not connect to the broker: " + "; ".join(errors or ["no address"]))


def _read_frame(sock: socket.socket, buf: bytearray, max_frame_bytes: int) -> Tuple[_wire.FrameHeader, bytes]:
    """Block until ``buf`` holds one whole frame, and take it off the front."""
    while True:
        taken = _take_frame(buf, max_frame_bytes)
        if taken is not None:
            return taken
        chunk = sock.recv(_RECV_CHUNK)
        if not chunk:
            raise ConnectionFailed("the broker closed the connection during HELLO")
        buf += chunk


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
    header = _wire.FrameHeader.parse(bytes(buf[:_wire.FRAME_HEADER_BYTES]))
    body = bytes(buf[_wire.FRAME_HEADER_BYTES:total])
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
        send_timeout: float,
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
        # Sends time out after this; a recv timing out just loops.
        sock.settimeout(send_timeout)
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
        send_timeout: float,
    ) -> "Connection":
        """Connect, say HELLO (asking for ``want_core`` if given) and start the
        reader thread. The whole exchange is bounded by ``connect_timeout``.

        Raises the broker's error for a refused HELLO (``Unauthorized``, ...),
        :class:`Unsupported` for another protocol version,
        :class:`ConnectionFailed` or :class:`Timeout` otherwise.
        """
        deadline = time.monotonic() + connect_timeout
        sock = _connect_first(addrs, deadline)
        try:
            hello, buffered = cls._say_hello(sock, deadline, want_core, client_name, token, max_frame_bytes)
            return cls(sock, hello, buffered, max_frame_bytes, send_timeout)
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
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(_wire.frame(0, request))
            header, body = _read_frame(sock, buf, max_frame_bytes)
        except socket.timeout:
            raise Timeout("no answer to HELLO within the connect timeout") from None
        except OSError as e:
            raise ConnectionFailed(f"HELLO failed: {e}") from e
        answer = _wire.decode_response(header, body)
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

    def close(self, reason: str) -> None:
        """Mark the connection dead, fail every request in flight on it with
        :class:`Disconnected`, and wake the reader thread (which closes the
        socket)."""
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
        """Send ``request`` and wait up to ``timeout`` seconds for its answer.

        An ``Error`` answer is returned, not raised, so the caller can look at
        it (a ``wrong_core`` error names the right core).
        """
        deadline = time.monotonic() + timeout
        data = self._encode(request)
        request_id, waiter = self._register(data)
        try:
            self._send(data, request_id, deadline)
            if not waiter.event.wait(max(deadline - time.monotonic(), 0)):
                raise Timeout(f"no answer to {request.name} within {timeout:.3g} s")
        finally:
            self._forget(request_id)
        if waiter.error is not None:
            raise waiter.error
        assert waiter.response is not None
        return waiter.response

    def _encode(self, request: _wire.WireRequest) -> bytearray:
        """The frame with a zero request id, refused if the broker would not take it."""
        missing = request.required & ~self.hello.features
        if missing:
            raise Unsupported(
                f"{request.name} needs feature bits {int(missing):#x}, "
                "which the broker on this connection did not advertise"
            )
        limit = self.hello.max_frame_bytes
        if request.data_bytes > limit:
            raise TooLarge(
                f"{request.name} carries {request.data_bytes} bytes of records, "
                f"over the broker's frame limit of {limit} bytes; split it"
            )
        data = bytearray(_wire.frame(0, request))
        if len(data) - 4 > limit:
            raise TooLarge(
                f"{request.name} request is {len(data) - 4} bytes, over the broker's frame limit of {limit} bytes"
            )
        return data

    def _register(self, data: bytearray) -> Tuple[int, _Waiter]:
        waiter = _Waiter()
        with self._lock:
            if self._closed is not None:
                raise Disconnected(f"connection to core {self.hello.core} lost: {self._closed}")
            request_id = self._next_id
            self._next_id += 1
            self._waiters[request_id] = waiter
        data[8:16] = request_id.to_bytes(8, "little")
        return request_id, waiter

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)

    def _send(self, data: bytearray, request_id: int, deadline: float) -> None:
        if not self._send_lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise Timeout("timed out waiting to send (the connection is busy sending)")
        try:
            self._sock.sendall(data)
        except socket.timeout:
            # Part of the frame may have gone out: the stream is unusable.
            self.close("send timed out")
            raise Timeout("timed out sending the request; the connection was dropped") from None
        except OSError as e:
            self.close(f"send failed: {e}")
            raise Disconnected(f"connection to core {self.hello.core} lost: {e}") from e
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
            # The answer is unusable and so is a broker that sends it: fail the
            # request it answers with the protocol error, then drop the rest.
            self._complete(header.request_id, None, e)
            raise
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
