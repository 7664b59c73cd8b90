"""A scripted stand-in for a broker, for tests of what the client does with
answers a real broker would not give (missing features, garbage, silence)."""

import socket
import struct
import threading
from typing import Callable, List, Optional, Tuple

from felix import _wire

#: Called with each request frame (header, body); returns bytes to send back.
Script = Callable[[_wire.FrameHeader, bytes], bytes]


def response_frame(request_id: int, opcode: int, body: bytes) -> bytes:
    """A response frame."""
    return struct.pack("<IBBHQ", 12 + len(body), _wire.KIND_RESPONSE, opcode, 0, request_id) + body


def hello_ok(request_id: int, features: int = 0, cores: int = 1, core: int = 0, max_frame: int = 1 << 20) -> bytes:
    """A ``HelloOk`` answer."""
    w = _wire.Writer().u16(1).u64(features).u32(cores).u32(core).u32(max_frame).string("fake")
    return response_frame(request_id, 0x01, bytes(w.buf))


class FakeBroker:
    """Accepts connections on 127.0.0.1, answers HELLO with ``features`` and
    every later request with what ``script`` returns. Records the opcodes
    of the requests it received."""

    def __init__(self, script: Script, features: int = 0) -> None:
        self.script = script
        self.features = features
        self.received: List[int] = []
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self._conns: List[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> Tuple[str, int]:
        """Where the fake listens."""
        host, port = self._listener.getsockname()
        return host, port

    def close(self) -> None:
        """Stop listening and drop every connection."""
        for sock in self._conns:
            sock.close()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass  # Not connected on this platform: closing is enough.
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        buf = b""
        while True:
            frame = self._next_frame(sock, buf)
            if frame is None:
                return
            header, body, buf = frame
            answer: Optional[bytes]
            if header.opcode == 0x01:
                answer = hello_ok(header.request_id, self.features)
            else:
                self.received.append(header.opcode)
                answer = self.script(header, body)
            try:
                sock.sendall(answer)
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
