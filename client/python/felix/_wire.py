"""Byte-level encoding of the Felix wire protocol (version 1).

Everything is little-endian and fixed-width. This module encodes request
frames and decodes response frames; it never trusts a length or count from
the broker before checking it against the bytes actually present.
See ``docs/internals/wire-protocol.md``.
"""

import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

from .errors import FelixError, ProtocolError, error_from_wire
from .types import (
    ClusterInfo,
    ClusterMember,
    DeadLetterInfo,
    Feature,
    GroupInfo,
    GroupRecord,
    Header,
    Record,
    RecordIn,
    REPLICA_ROLES,
    PeerProgress,
    ReplicaInfo,
    ShardInfo,
    StartKind,
    StartPosition,
    StreamInfo,
    StreamRef,
    check_utf8,
)

T = TypeVar("T")

PROTOCOL_VERSION = 1
FRAME_HEADER_BYTES = 16
#: Bytes counted by a frame's ``len`` that belong to the header.
HEADER_AFTER_LEN = FRAME_HEADER_BYTES - 4
KIND_REQUEST = 1
KIND_RESPONSE = 2
MAX_ITEMS_PER_VEC = 100_000
#: Every feature bit this client understands.
FEATURES_ALL = Feature(sum(Feature))

_HEADER = struct.Struct("<IBBHQ")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

ACK_DEFAULT = 0
ACK_DURABLE = 2

# Smallest encodings, to bound element counts before decoding a vector.
_MIN_HEADER = 2 + 4
_MIN_RECORD = 8 + 8 + 1 + 4 + 4
_MIN_GROUP_RECORD = 8 + 4 + 8 + 1 + 4 + 4 + 1
_MIN_STREAM_INFO = 3 * 2 + 4 + 1 + 1 + 4
_MIN_DEAD_LETTER = 8 + 4 + 8 + 1 + 1
_MIN_CLUSTER_MEMBER = 8 + 2
_EMPTY = b""


class Writer:
    """Appends wire-encoded values to a byte buffer, after ``reserve`` zero
    bytes (room for a frame header, so a request frame is built once)."""

    def __init__(self, reserve: int = 0) -> None:
        self.buf = bytearray(reserve)

    def u8(self, v: int) -> "Writer":
        self.buf.append(v)
        return self

    def u16(self, v: int) -> "Writer":
        self.buf += _U16.pack(v)
        return self

    def u32(self, v: int) -> "Writer":
        self.buf += _U32.pack(v)
        return self

    def u64(self, v: int) -> "Writer":
        self.buf += _U64.pack(v)
        return self

    def boolean(self, v: bool) -> "Writer":
        return self.u8(1 if v else 0)

    def string(self, s: str, what: str = "text") -> "Writer":
        """A ``u16``-length string; over-long text is cut at a character
        boundary (as the Rust encoder does). Text that cannot be encoded (a
        lone surrogate) raises :class:`~felix.errors.InvalidArgument`."""
        data = check_utf8(what, s)
        if len(data) > 0xFFFF:
            data = data[:0xFFFF].decode("utf-8", errors="ignore").encode("utf-8")
        self.u16(len(data))
        self.buf += data
        return self

    def blob(self, b: bytes) -> "Writer":
        self.u32(len(b))
        self.buf += b
        return self

    def opt(self, v: Optional[T], put: Callable[[T], Any]) -> "Writer":
        if v is None:
            return self.u8(0)
        self.u8(1)
        put(v)
        return self

    def reason(self, reason: Optional[str]) -> "Writer":
        """An optional reason string (nack, dead letter)."""
        return self.opt(reason, lambda r: self.string(r, "reason"))

    def stream(self, s: StreamRef) -> "Writer":
        return self.string(s.tenant).string(s.namespace).string(s.stream)

    def group_key(self, stream: StreamRef, shard: int, group: str) -> "Writer":
        return self.stream(stream).u32(shard).string(group)

    def start(self, p: StartPosition) -> "Writer":
        if p.kind is StartKind.EARLIEST:
            return self.u8(0)
        if p.kind is StartKind.LATEST:
            return self.u8(1)
        return self.u8(2).u64(p.offset or 0)

    def headers(self, headers: Sequence[Header]) -> "Writer":
        self.u32(len(headers))
        for name, value in headers:
            self.string(name, "header name").blob(value)
        return self

    def record_in(self, r: RecordIn) -> "Writer":
        self.opt(r.timestamp_ms, self.u64)
        self.opt(r.key, self.blob)
        self.headers(r.headers)
        return self.blob(r.payload)


class Reader:
    """Reads a response body, checking every length against what is left."""

    def __init__(self, body: bytes) -> None:
        self.body = memoryview(body)
        self.pos = 0

    def remaining(self) -> int:
        return len(self.body) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n > self.remaining():
            raise ProtocolError(f"truncated {what}")
        chunk = self.body[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u16(self, what: str) -> int:
        return _U16.unpack(self.take(2, what))[0]

    def u32(self, what: str) -> int:
        return _U32.unpack(self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack(self.take(8, what))[0]

    def boolean(self, what: str) -> bool:
        v = self.u8(what)
        if v > 1:
            raise ProtocolError(f"invalid {what}: boolean byte {v}")
        return v == 1

    def string(self, what: str) -> str:
        raw = self.take(self.u16(what), what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"{what} is not valid UTF-8") from e

    def blob(self, what: str) -> bytes:
        n = self.u32(what)
        if n == 0:
            return _EMPTY  # One shared object, however many empty blobs a frame holds.
        return bytes(self.take(n, what))

    def opt(self, what: str, get: Callable[[str], T]) -> Optional[T]:
        flag = self.u8(what)
        if flag == 0:
            return None
        if flag != 1:
            raise ProtocolError(f"invalid {what}: presence byte {flag}")
        return get(what)

    def vec(self, what: str, min_item_bytes: int, item: Callable[[], T]) -> List[T]:
        n = self.u32(what)
        if n * min_item_bytes > self.remaining():
            raise ProtocolError(f"truncated {what}: {n} elements cannot fit in {self.remaining()} bytes")
        if n > MAX_ITEMS_PER_VEC:
            raise ProtocolError(f"{what}: {n} elements, over the limit of {MAX_ITEMS_PER_VEC}")
        return [item() for _ in range(n)]

    def finish(self) -> None:
        if self.remaining():
            raise ProtocolError(f"{self.remaining()} trailing bytes after message body")

    # --- shared structures ---------------------------------------------

    def stream(self) -> StreamRef:
        tenant, namespace, stream = self.string("tenant"), self.string("namespace"), self.string("stream")
        try:
            return StreamRef(tenant, namespace, stream)
        except FelixError as e:
            raise ProtocolError(f"broker named an invalid stream: {e.message}") from e

    def headers(self) -> Tuple[Header, ...]:
        return tuple(self.vec("headers", _MIN_HEADER, lambda: (self.string("header name"), self.blob("header value"))))

    def record(self) -> Record:
        return Record(
            offset=self.u64("record offset"),
            timestamp_ms=self.u64("record timestamp"),
            key=self.opt("record key", self.blob),
            headers=self.headers(),
            payload=self.blob("record payload"),
        )

    def group_record(self) -> GroupRecord:
        return GroupRecord(
            offset=self.u64("record offset"),
            attempts=self.u32("record attempts"),
            timestamp_ms=self.u64("record timestamp"),
            key=self.opt("record key", self.blob),
            headers=self.headers(),
            payload=self.blob("record payload"),
            skipped_before=self.opt("skipped_before", self.u64),
        )

    def stream_info(self, trailing: bool = False) -> StreamInfo:
        """A ``StreamInfo``; with ``trailing`` (a ``Stream`` answer, not a
        list's entry), the trailing ``incarnation`` that may follow it."""
        return StreamInfo(
            stream=self.stream(),
            shards=self.u32("shards"),
            retention_bytes=self.opt("retention_bytes", self.u64),
            retention_ms=self.opt("retention_ms", self.u64),
            placement=tuple(self.vec("placement", 4, lambda: self.u32("placement"))),
            incarnation=self.trailing_u64("incarnation") if trailing else None,
        )

    def trailing_u64(self, what: str) -> Optional[int]:
        """A trailing field: absent when the body ends here, never 0 when present."""
        if not self.remaining():
            return None
        value = self.u64(what)
        if value == 0:
            raise ProtocolError(f"invalid {what}: a trailing field is never 0")
        return value

    def shard_info(self) -> ShardInfo:
        return ShardInfo(
            stream=self.stream(),
            shard=self.u32("shard"),
            core=self.u32("core"),
            start_offset=self.u64("start_offset"),
            end_offset=self.u64("end_offset"),
            bytes=self.u64("bytes"),
            segments=self.u32("segments"),
            stopped=self.opt("stopped", self.string),
        )

    def replica_info(self) -> ReplicaInfo:
        stream, shard, node = self.stream(), self.u32("shard"), self.u64("node")
        role = self.u8("replica role")
        if role >= len(REPLICA_ROLES):
            raise ProtocolError(f"unknown replica role {role}")
        return ReplicaInfo(
            stream=stream,
            shard=shard,
            node=node,
            role=REPLICA_ROLES[role],
            term=self.u64("term"),
            leader=self.opt("leader", self.u64),
            leader_addr=self.opt("leader_addr", self.string),
            commit=self.u64("commit"),
            applied=self.u64("applied"),
            last_index=self.u64("last_index"),
            compacted=self.u64("compacted"),
            stopped=self.opt("stopped", self.string),
            peers=tuple(self.vec("peers", 16, lambda: PeerProgress(self.u64("peer node"), self.u64("peer matched")))),
        )

    def cluster_info(self) -> ClusterInfo:
        return ClusterInfo(
            node=self.u64("node"),
            members=tuple(
                self.vec(
                    "members",
                    _MIN_CLUSTER_MEMBER,
                    lambda: ClusterMember(self.u64("member node"), self.string("member addr")),
                )
            ),
        )

    def dead_letter(self) -> DeadLetterInfo:
        return DeadLetterInfo(
            offset=self.u64("dead letter offset"),
            attempts=self.u32("dead letter attempts"),
            at_ms=self.u64("dead letter at_ms"),
            reason=self.opt("dead letter reason", self.string),
            by_consumer=self.boolean("dead letter by_consumer"),
        )

    def group_info(self) -> GroupInfo:
        return GroupInfo(
            group=self.string("group"),
            position=self.u64("position"),
            end_offset=self.u64("end_offset"),
            start_offset=self.u64("start_offset"),
            in_flight=self.u32("in_flight"),
            owed=self.u32("owed"),
            delayed=self.u32("delayed"),
            dead_letters=self.u32("dead_letters"),
            oldest_in_flight_age_ms=self.opt("oldest_in_flight_age_ms", self.u64),
            oldest_owed_age_ms=self.opt("oldest_owed_age_ms", self.u64),
            last_active_ms=self.opt("last_active_ms", self.u64),
        )


# --- requests ------------------------------------------------------------


@dataclass(frozen=True)
class WireRequest:
    """An encoded request, with what the client needs to send it."""

    #: snake_case request name (``Request::name()`` in the Rust crate).
    name: str
    opcode: int
    #: The whole frame, header included, built once. Its request id (bytes
    #: 8..16) is written by the connection that sends it, in place.
    frame: bytearray
    #: Feature bits the broker must have advertised for this request as encoded.
    required: Feature = Feature(0)
    #: Bytes of record data (payloads, keys, headers) for the frame-cap check.
    data_bytes: int = 0

    @property
    def body(self) -> bytes:
        """The body alone (a copy)."""
        return bytes(self.frame[FRAME_HEADER_BYTES:])

    def set_request_id(self, request_id: int) -> None:
        """Write ``request_id`` into the frame header."""
        self.frame[8:16] = _U64.pack(request_id)


def frame(request_id: int, req: WireRequest) -> bytes:
    """The whole request frame with ``request_id``: header then body (a copy)."""
    data = bytearray(req.frame)
    data[8:16] = _U64.pack(request_id)
    return bytes(data)


def _w() -> Writer:
    """A writer for a request: room for the frame header first."""
    return Writer(FRAME_HEADER_BYTES)


def _req(name: str, opcode: int, w: Writer, required: Feature = Feature(0), data_bytes: int = 0) -> WireRequest:
    buf = w.buf
    _HEADER.pack_into(buf, 0, len(buf) - 4, KIND_REQUEST, opcode, 0, 0)
    return WireRequest(name, opcode, buf, required, data_bytes)


_G = Feature.GROUPS
_CC = Feature.GROUP_CLAIM_CONTROL
_ADMIN = Feature.GROUP_ADMIN


def hello(features: int, want_core: Optional[int], client_name: str, token: Optional[str]) -> WireRequest:
    w = _w().u16(PROTOCOL_VERSION).u64(features)
    w.opt(want_core, w.u32).string(client_name, "client_name").opt(token, lambda t: w.string(t, "token"))
    return _req("hello", 0x01, w)


def ping() -> WireRequest:
    return _req("ping", 0x02, _w())


def create_stream(
    stream: StreamRef,
    shards: int,
    retention_bytes: Optional[int],
    retention_ms: Optional[int],
    incarnation: Optional[int] = None,
) -> WireRequest:
    """A stream create; ``incarnation`` is the trailing field, sent only when
    given (and then needing :attr:`Feature.STREAM_INCARNATION`)."""
    w = _w().stream(stream).u32(shards)
    w.opt(retention_bytes, w.u64).opt(retention_ms, w.u64)
    if incarnation is None:
        return _req("create_stream", 0x10, w)
    w.u64(incarnation)
    return _req("create_stream", 0x10, w, Feature.STREAM_INCARNATION)


def describe_stream(stream: StreamRef) -> WireRequest:
    return _req("describe_stream", 0x11, _w().stream(stream))


def list_streams(tenant: Optional[str]) -> WireRequest:
    w = _w()
    return _req("list_streams", 0x12, w.opt(tenant, lambda t: w.string(t, "tenant")))


def delete_stream(stream: StreamRef) -> WireRequest:
    return _req("delete_stream", 0x13, _w().stream(stream))


def describe_shard(stream: StreamRef, shard: int) -> WireRequest:
    return _req("describe_shard", 0x14, _w().stream(stream).u32(shard))


def describe_replica(stream: StreamRef, shard: int) -> WireRequest:
    return _req("describe_replica", 0x15, _w().stream(stream).u32(shard), Feature.REPLICA_INFO)


def describe_cluster() -> WireRequest:
    """Every broker of the answering broker's cluster (an empty body)."""
    return _req("describe_cluster", 0x16, _w(), Feature.CLUSTER_INFO)


def publish(stream: StreamRef, shard: Optional[int], key: Optional[bytes], ack: int, records: Sequence[RecordIn]) -> WireRequest:
    """A publish to ``shard``, or routed by ``key`` when ``shard`` is None."""
    w = _w().stream(stream)
    if shard is not None:
        w.u8(0).u32(shard)
    else:
        w.u8(1).blob(key or b"")
    w.u8(ack).u32(len(records))
    for r in records:
        w.record_in(r)
    required = Feature.PUBLISH_ACK_MODE if ack != ACK_DEFAULT else Feature(0)
    return _req("publish", 0x20, w, required, sum(r.data_bytes() for r in records))


def read(stream: StreamRef, shard: int, start: StartPosition, max_records: int, max_bytes: int, wait_ms: int) -> WireRequest:
    w = _w().stream(stream).u32(shard).start(start).u32(max_records).u32(max_bytes).u32(wait_ms)
    return _req("read", 0x21, w)


class GroupMember(NamedTuple):
    """A poll's named member: its consumer name and whether it reclaims."""

    name: str
    reclaim: bool


def group_poll(
    stream: StreamRef,
    shard: int,
    group: str,
    max_records: int,
    wait_ms: int,
    member: Optional[GroupMember],
    visibility_ms: Optional[int],
) -> WireRequest:
    w = _w().group_key(stream, shard, group).u32(max_records).u32(wait_ms)
    w.opt(member, lambda m: w.string(m.name, "consumer").boolean(m.reclaim))
    w.opt(visibility_ms, w.u64)
    required = _G | _CC if visibility_ms is not None else _G
    return _req("group_poll", 0x30, w, required)


def group_ack(stream: StreamRef, shard: int, group: str, offsets: Sequence[int]) -> WireRequest:
    w = _w().group_key(stream, shard, group).u32(len(offsets))
    for o in offsets:
        w.u64(o)
    return _req("group_ack", 0x31, w, _G)


def group_nack(
    stream: StreamRef, shard: int, group: str, offset: int, attempts: int, delay_ms: Optional[int], reason: Optional[str]
) -> WireRequest:
    w = _w().group_key(stream, shard, group).u64(offset).u32(attempts)
    w.opt(delay_ms, w.u64).reason(reason)
    required = _G | _CC if delay_ms is not None else _G
    return _req("group_nack", 0x32, w, required)


def group_extend(stream: StreamRef, shard: int, group: str, offset: int, attempts: int, extend_ms: int) -> WireRequest:
    w = _w().group_key(stream, shard, group).u64(offset).u32(attempts).u64(extend_ms)
    return _req("group_extend", 0x33, w, _G | _CC)


def group_dead_letter(stream: StreamRef, shard: int, group: str, offset: int, attempts: int, reason: Optional[str]) -> WireRequest:
    w = _w().group_key(stream, shard, group).u64(offset).u32(attempts)
    w.reason(reason)
    return _req("group_dead_letter", 0x34, w, _G | _CC)


def group_dead_letters(stream: StreamRef, shard: int, group: str) -> WireRequest:
    return _req("group_dead_letters", 0x35, _w().group_key(stream, shard, group), _G)


def group_redrive(stream: StreamRef, shard: int, group: str, offset: int) -> WireRequest:
    return _req("group_redrive", 0x36, _w().group_key(stream, shard, group).u64(offset), _G)


def group_discard(stream: StreamRef, shard: int, group: str, offset: int) -> WireRequest:
    return _req("group_discard", 0x37, _w().group_key(stream, shard, group).u64(offset), _G)


def group_dead_letters_page(stream: StreamRef, shard: int, group: str, from_offset: int, max_letters: int) -> WireRequest:
    w = _w().group_key(stream, shard, group).u64(from_offset).u32(max_letters)
    return _req("group_dead_letters_page", 0x38, w, _G | Feature.GROUP_DEAD_LETTER_PAGES)


def group_create(stream: StreamRef, shard: int, group: str, start: StartPosition) -> WireRequest:
    return _req("group_create", 0x40, _w().group_key(stream, shard, group).start(start), _G | _ADMIN)


def group_seek(stream: StreamRef, shard: int, group: str, start: StartPosition) -> WireRequest:
    return _req("group_seek", 0x41, _w().group_key(stream, shard, group).start(start), _G | _ADMIN)


def group_describe(stream: StreamRef, shard: int, group: str) -> WireRequest:
    return _req("group_describe", 0x42, _w().group_key(stream, shard, group), _G | _ADMIN)


def group_delete(stream: StreamRef, shard: int, group: str) -> WireRequest:
    return _req("group_delete", 0x43, _w().group_key(stream, shard, group), _G | _ADMIN)


def list_groups(stream: StreamRef, shard: int) -> WireRequest:
    return _req("list_groups", 0x44, _w().stream(stream).u32(shard), _G)


# --- responses -----------------------------------------------------------


@dataclass(frozen=True)
class HelloOk:
    """The broker's answer to HELLO."""

    version: int
    features: Feature
    cores: int
    core: int
    max_frame_bytes: int
    broker: str


@dataclass(frozen=True)
class Response:
    """A decoded response: its snake_case name and its value (a
    :class:`FelixError` for ``error``)."""

    name: str
    value: Any


def _hello_ok(r: Reader) -> HelloOk:
    return HelloOk(
        version=r.u16("version"),
        features=Feature(r.u64("features") & FEATURES_ALL),
        cores=r.u32("cores"),
        core=r.u32("core"),
        max_frame_bytes=r.u32("max_frame_bytes"),
        broker=r.string("broker"),
    )


def _records(r: Reader) -> Tuple[int, int, int, List[Record]]:
    return (r.u64("start_offset"), r.u64("next_offset"), r.u64("end_offset"), r.vec("records", _MIN_RECORD, r.record))


def _error(r: Reader) -> FelixError:
    number = r.u16("error code")
    message = r.string("error message")
    core = r.opt("error core", r.u32)
    # A not_leader error (from a broker in a cluster) names the leader's
    # client address after the core.
    leader = r.opt("error leader", r.string) if number == 10 else None
    if leader is not None:
        message = f"{message} (leader {leader})"
    # Trailing, only when set (and negotiated): one byte, 1.
    not_applied = False
    if r.remaining():
        if r.u8("error not_applied") != 1:
            raise ProtocolError("bad value for error not_applied")
        not_applied = True
    return error_from_wire(number, message, core, leader, not_applied)


_DECODERS: Dict[int, Tuple[str, Callable[[Reader], Any]]] = {
    0x01: ("hello_ok", _hello_ok),
    0x02: ("pong", lambda r: None),
    0x03: ("ok", lambda r: None),
    0x10: ("stream", lambda r: r.stream_info(trailing=True)),
    0x11: ("streams", lambda r: r.vec("streams", _MIN_STREAM_INFO, r.stream_info)),
    0x12: ("shard", lambda r: r.shard_info()),
    0x13: ("replica", lambda r: r.replica_info()),
    0x14: ("cluster", lambda r: r.cluster_info()),
    0x20: ("published", lambda r: (r.u32("shard"), r.u64("base_offset"), r.u32("count"))),
    0x21: ("records", _records),
    0x30: ("group_records", lambda r: r.vec("records", _MIN_GROUP_RECORD, r.group_record)),
    0x31: ("extended", lambda r: r.u64("stands_ms")),
    0x32: ("dead_letters", lambda r: r.vec("dead letters", _MIN_DEAD_LETTER, r.dead_letter)),
    0x33: ("dead_letter_page", lambda r: (r.vec("dead letters", _MIN_DEAD_LETTER, r.dead_letter), r.opt("next", r.u64))),
    0x40: ("group", lambda r: r.group_info()),
    0x41: ("groups", lambda r: r.vec("group names", 2, lambda: r.string("group name"))),
    0xFF: ("error", _error),
}


@dataclass(frozen=True)
class FrameHeader:
    """The fixed 16-byte frame header."""

    len: int
    kind: int
    opcode: int
    flags: int
    request_id: int

    @classmethod
    def parse(cls, data: bytes) -> "FrameHeader":
        return cls(*_HEADER.unpack_from(data))


def check_frame_len(length: int, max_frame_bytes: int) -> None:
    """Raise :class:`ProtocolError` for a length prefix that is fatal to the stream."""
    if length > max_frame_bytes:
        raise ProtocolError(f"frame declares {length} bytes, over the limit of {max_frame_bytes}")
    if length < HEADER_AFTER_LEN:
        raise ProtocolError(f"frame length {length} cannot hold a header")


def decode_response(header: FrameHeader, body: bytes) -> Response:
    """Decode a response body. Raises :class:`ProtocolError` for anything
    malformed: wrong kind, non-zero flags, unknown opcode, bad body,
    trailing bytes."""
    if header.kind != KIND_RESPONSE:
        raise ProtocolError(f"unexpected frame kind {header.kind}")
    if header.flags != 0:
        raise ProtocolError(f"non-zero frame flags {header.flags:#x}")
    decoder = _DECODERS.get(header.opcode)
    if decoder is None:
        raise ProtocolError(f"unknown response opcode {header.opcode:#04x}")
    name, decode = decoder
    r = Reader(body)
    value = decode(r)
    r.finish()
    return Response(name, value)
