"""A scripted stand-in for a broker, for tests of what the client does with
answers a real broker would not give (missing features, garbage, silence,
redirects, a refused or trickling HELLO)."""

import socket
import struct
import threading
import unittest
from typing import Callable, List, Optional, Tuple

import felix
from felix import _wire

#: Called with each request frame (header, body) and the core of the
#: connection it came on; returns bytes to send back, or None to drop the
#: connection.
Script = Callable[[_wire.FrameHeader, bytes, int], Optional[bytes]]


def response_frame(request_id: int, opcode: int, body: bytes) -> bytes:
    """A response frame."""
    return struct.pack("<IBBHQ", 12 + len(body), _wire.KIND_RESPONSE, opcode, 0, request_id) + body


def hello_ok(request_id: int, features: int = 0, cores: int = 1, core: int = 0, max_frame: int = 1 << 20) -> bytes:
    """A ``HelloOk`` answer."""
    w = _wire.Writer().u16(1).u64(features).u32(cores).u32(core).u32(max_frame).string("fake")
    return response_frame(request_id, 0x01, bytes(w.buf))


def error_frame(request_id: int, number: int, message: str, core: Optional[int] = None) -> bytes:
    """An ``Error`` answer."""
    w = _wire.Writer().u16(number).string(message)
    w.opt(core, w.u32)
    return response_frame(request_id, 0xFF, bytes(w.buf))


def want_core(hello_body: bytes) -> Optional[int]:
    """The core a HELLO body asks for."""
    if hello_body[10] == 0:
        return None
    return int.from_bytes(hello_body[11:15], "little")


class FakeBroker:
    """Accepts connections on 127.0.0.1, answers HELLO with ``features`` and
    ``cores`` (putting the connection on the core it asks for), or with what
    ``hello`` returns when given, and every later request with what
    ``script`` returns (None drops the connection). With ``trickle``, the
    HELLO answer goes out one byte every ``trickle`` seconds; with ``stall``,
    nothing is read after HELLO. HELLO offers ``max_frame`` as the frame
    limit. Records the opcodes of the requests it received."""

    def __init__(
        self,
        script: Script,
        features: int = 0,
        cores: int = 1,
        hello: Optional[Callable[[_wire.FrameHeader, bytes], Optional[bytes]]] = None,
        trickle: Optional[float] = None,
        stall: bool = False,
        max_frame: int = 1 << 20,
    ) -> None:
        self.script = script
        self.features = features
        self.cores = cores
        self.hello = hello
        self.trickle = trickle
        self.stall = stall
        self.max_frame = max_frame
        self.received: List[int] = []
        #: (core, opcode) of every request after HELLO.
        self.calls: List[Tuple[int, int]] = []
        self.accepted = 0
        self._changed = threading.Condition()
        self._closing = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self._conns: List[socket.socket] = []
        self._threads: List[threading.Thread] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> Tuple[str, int]:
        """Where the fake listens."""
        host, port = self._listener.getsockname()
        return host, port

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> bool:
        """Block until ``count`` requests (after HELLO) have arrived."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self.received) >= count, timeout)

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._closing.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass  # Not connected on this platform: closing is enough.
        self._listener.close()
        self._thread.join(5)
        with self._changed:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in list(self._threads):
            thread.join(5)
        for sock in conns:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if self._closing.is_set():
                sock.close()
                return
            with self._changed:
                self._conns.append(sock)
                self.accepted += 1
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        buf = b""
        core = 0
        while True:
            frame = self._next_frame(sock, buf)
            if frame is None:
                return
            header, body, buf = frame
            answer: Optional[bytes]
            if header.opcode == 0x01:
                if self.hello is not None:
                    answer = self.hello(header, body)
                else:
                    asked = want_core(body)
                    core = asked if asked is not None and asked < self.cores else 0
                    answer = hello_ok(header.request_id, self.features, self.cores, core, self.max_frame)
                if self.trickle is not None and answer is not None:
                    self._send_slowly(sock, answer)
                    continue
            else:
                with self._changed:
                    self.received.append(header.opcode)
                    self.calls.append((core, header.opcode))
                    self._changed.notify_all()
                answer = self.script(header, body, core)
            if answer is None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            try:
                sock.sendall(answer)
            except OSError:
                return
            if self.stall and header.opcode == 0x01:
                self._closing.wait()  # Read nothing more: the client's sends back up.
                return

    def _send_slowly(self, sock: socket.socket, data: bytes) -> None:
        assert self.trickle is not None
        for i in range(len(data)):
            if self._closing.wait(self.trickle):
                return
            try:
                sock.sendall(data[i : i + 1])
            except OSError:
                return

    @staticmethod
    def _next_frame(sock: socket.socket, buf: bytes) -> Optional[Tuple[_wire.FrameHeader, bytes, bytes]]:
        while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "little"):
            try:
                chunk = sock.recv(65536)
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        total = 4 + int.from_bytes(buf[:4], "little")
        return _wire.FrameHeader.parse(buf[:16]), buf[16:total], buf[total:]


class FakeBrokerCase(unittest.TestCase):
    """Fake brokers and clients that are closed when the test ends."""

    def serve(self, script: Script, features: int = 0, **options: object) -> FakeBroker:
        fake = FakeBroker(script, features, **options)  # type: ignore[arg-type]
        self.addCleanup(fake.close)
        return fake

    def connect(self, fake: FakeBroker, **options: object) -> felix.Client:
        client = felix.Client.connect(fake.addr, **options)  # type: ignore[arg-type]
        self.addCleanup(client.close)
        return client
