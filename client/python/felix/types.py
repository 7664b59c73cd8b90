"""Values passed to and returned by :class:`felix.Client` calls."""

import enum
import re
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence, Tuple, Union

from .errors import InvalidArgument

__all__ = [
    "Feature",
    "StreamRef",
    "StartKind",
    "StartPosition",
    "RecordIn",
    "Record",
    "GroupRecord",
    "StreamInfo",
    "ShardInfo",
    "PeerProgress",
    "ReplicaInfo",
    "ClusterMember",
    "ClusterInfo",
    "Published",
    "ReadBatch",
    "DeadLetterInfo",
    "DeadLetterPage",
    "GroupInfo",
    "Header",
    "Payload",
    "StreamLike",
    "Start",
]

#: A header: a name and a byte value. Order is kept; names may repeat.
Header = Tuple[str, bytes]
#: What a payload or key may be given as; ``str`` is encoded as UTF-8.
Payload = Union[bytes, bytearray, memoryview, str]

NAME_MAX_BYTES = 128
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")


class Feature(enum.IntFlag):
    """Feature bits negotiated in HELLO (``Hello.features``)."""

    #: Consumer groups at all (durable brokers only).
    GROUPS = 1 << 0
    #: The broker fills :attr:`GroupRecord.skipped_before`.
    GROUP_SKIPPED = 1 << 1
    #: Poll visibility, nack delays, ``group_extend`` and ``group_dead_letter``.
    GROUP_CLAIM_CONTROL = 1 << 2
    #: ``group_create``, ``group_seek``, ``group_describe``, ``group_delete``.
    GROUP_ADMIN = 1 << 3
    #: The broker honours the publish acknowledgement mode (``ack_on_commit``).
    PUBLISH_ACK_MODE = 1 << 4
    #: ``group_dead_letters_page``.
    GROUP_DEAD_LETTER_PAGES = 1 << 5
    #: ``describe_replica`` (a broker in a cluster).
    REPLICA_INFO = 1 << 6
    #: Stream incarnations (a broker in a cluster that keeps them): a
    #: ``create_stream`` with ``incarnation=``, and
    #: :attr:`StreamInfo.incarnation` in its answers.
    STREAM_INCARNATION = 1 << 7
    #: ``describe_cluster`` (a broker in a cluster): every broker of the
    #: cluster with its client address.
    CLUSTER_INFO = 1 << 8
    #: Errors say when the broker did nothing of the request
    #: (:attr:`FelixError.not_applied`).
    ERROR_NOT_APPLIED = 1 << 9


def check_utf8(what: str, text: str) -> bytes:
    """``text`` encoded as UTF-8; :class:`~felix.errors.InvalidArgument` if it
    is not a ``str`` or cannot be encoded (a lone surrogate)."""
    if not isinstance(text, str):
        raise InvalidArgument(f"{what} must be a str, not {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"{what} is not valid Unicode text: {e.reason} at index {e.start}") from None


def check_name(what: str, name: str) -> str:
    """Check a tenant, namespace, stream or group name the way the broker
    does: 1 to 128 bytes of ``[A-Za-z0-9._-]``, not ``.`` or ``..``.

    Returns the name; raises :class:`~felix.errors.InvalidArgument`.
    """
    if not isinstance(name, str):
        raise InvalidArgument(f"{what} name must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidArgument(f"{what} name is empty; names are 1-{NAME_MAX_BYTES} bytes of [A-Za-z0-9._-]")
    size = len(check_utf8(f"{what} name", name))
    if size > NAME_MAX_BYTES:
        raise InvalidArgument(f"{what} name is {size} bytes; the limit is {NAME_MAX_BYTES}")
    if not _NAME_RE.fullmatch(name):
        raise InvalidArgument(f"{what} name {name!r} has characters outside [A-Za-z0-9._-]")
    if name in (".", ".."):
        raise InvalidArgument(f"{what} name may not be {name!r}")
    return name


@dataclass(frozen=True)
class StreamRef:
    """A stream's ``tenant/namespace/stream`` path. Each part is validated
    on construction."""

    tenant: str
    namespace: str
    stream: str

    def __post_init__(self) -> None:
        check_name("tenant", self.tenant)
        check_name("namespace", self.namespace)
        check_name("stream", self.stream)

    @classmethod
    def parse(cls, path: "StreamLike") -> "StreamRef":
        """A :class:`StreamRef` from ``"tenant/namespace/stream"`` (a
        :class:`StreamRef` is returned as is)."""
        if isinstance(path, StreamRef):
            return path
        if not isinstance(path, str):
            raise InvalidArgument(f"a stream is a 'tenant/namespace/stream' str, not {type(path).__name__}")
        parts = path.split("/")
        if len(parts) != 3:
            raise InvalidArgument(f"stream path {path!r} must be tenant/namespace/stream")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.tenant}/{self.namespace}/{self.stream}"


#: A stream given as a path string or a :class:`StreamRef`.
StreamLike = Union[str, StreamRef]


class StartKind(str, enum.Enum):
    """The kind of a :class:`StartPosition`. A ``str`` enum, so it also
    compares equal to ``"earliest"``, ``"latest"`` and ``"offset"``."""

    EARLIEST = "earliest"
    LATEST = "latest"
    OFFSET = "offset"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StartPosition:
    """Where a read or a consumer group starts: :attr:`EARLIEST` (the oldest
    retained record), :attr:`LATEST` (the tail: only records published from
    now on) or :meth:`at` an exact offset. Calls also accept a plain ``int``
    for an offset."""

    #: A :class:`StartKind` (given as one or as its ``str`` value).
    kind: StartKind
    offset: Optional[int] = None

    EARLIEST: ClassVar["StartPosition"]
    LATEST: ClassVar["StartPosition"]

    def __post_init__(self) -> None:
        try:
            kind = StartKind(self.kind)
        except ValueError:
            raise InvalidArgument(f"unknown start position kind {self.kind!r}") from None
        object.__setattr__(self, "kind", kind)
        if (kind is StartKind.OFFSET) != (self.offset is not None):
            raise InvalidArgument("a start position has an offset exactly when its kind is 'offset'")
        if self.offset is not None:
            check_u64("offset", self.offset)

    @classmethod
    def at(cls, offset: int) -> "StartPosition":
        """The position of this exact offset."""
        return cls(StartKind.OFFSET, offset)

    @classmethod
    def of(cls, start: "Start") -> "StartPosition":
        """``start`` as a :class:`StartPosition` (an ``int`` is an offset)."""
        if isinstance(start, StartPosition):
            return start
        if isinstance(start, int) and not isinstance(start, bool):
            return cls.at(start)
        raise InvalidArgument(f"a start position is a StartPosition or an int offset, not {start!r}")

    def __str__(self) -> str:
        return self.kind.value if self.offset is None else str(self.offset)


StartPosition.EARLIEST = StartPosition(StartKind.EARLIEST)
StartPosition.LATEST = StartPosition(StartKind.LATEST)

#: A start position, or an ``int`` offset.
Start = Union[StartPosition, int]


def check_u64(what: str, value: int) -> int:
    """``value`` if it is an int in ``0 .. 2**64-1``; else :class:`InvalidArgument`."""
    return check_int(what, value, (1 << 64) - 1)


def check_u32(what: str, value: int) -> int:
    """``value`` if it is an int in ``0 .. 2**32-1``; else :class:`InvalidArgument`."""
    return check_int(what, value, (1 << 32) - 1)


def check_int(what: str, value: int, maximum: int, minimum: int = 0) -> int:
    """``value`` if it is an int in ``minimum .. maximum``; else :class:`InvalidArgument`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an int, not {type(value).__name__}")
    if value < minimum or value > maximum:
        raise InvalidArgument(f"{what} must be between {minimum} and {maximum}, not {value}")
    return value


def to_bytes(what: str, value: Payload) -> bytes:
    """A payload or key as ``bytes`` (``str`` encoded as UTF-8)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return check_utf8(what, value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgument(f"{what} must be bytes or str, not {type(value).__name__}")


@dataclass(frozen=True)
class RecordIn:
    """A record to publish. The broker assigns its offset, and its timestamp
    when ``timestamp_ms`` is ``None``.

    Fields are checked on construction: ``payload``, ``key`` and header
    values may be given as ``bytes``, ``bytearray``, ``memoryview`` or
    ``str`` (UTF-8) and are stored as ``bytes``; headers are stored as a
    tuple of ``(str, bytes)`` pairs; a bad field raises
    :class:`~felix.errors.InvalidArgument`.
    """

    payload: bytes
    key: Optional[bytes] = None
    headers: Tuple[Header, ...] = ()
    timestamp_ms: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload", to_bytes("payload", self.payload))
        if self.key is not None:
            object.__setattr__(self, "key", to_bytes("key", self.key))
        if isinstance(self.headers, (str, bytes, bytearray, memoryview)):
            raise InvalidArgument("headers must be a sequence of (name, value) pairs")
        try:
            items = tuple(self.headers)
        except TypeError:
            raise InvalidArgument(f"headers must be a sequence of (name, value) pairs, not {self.headers!r}") from None
        headers = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise InvalidArgument(f"a header is a (str name, bytes value) pair, not {item!r}")
            check_utf8("header name", item[0])
            headers.append((item[0], to_bytes("header value", item[1])))
        object.__setattr__(self, "headers", tuple(headers))
        if self.timestamp_ms is not None:
            check_u64("timestamp_ms", self.timestamp_ms)

    @classmethod
    def of(
        cls,
        payload: Payload,
        *,
        key: Optional[Payload] = None,
        headers: Sequence[Tuple[str, Payload]] = (),
        timestamp_ms: Optional[int] = None,
    ) -> "RecordIn":
        """A record with its fields converted and checked (``str`` payloads,
        keys and header values are encoded as UTF-8). The same as the
        constructor, with keyword-only options."""
        return cls(payload, key, headers, timestamp_ms)  # type: ignore[arg-type]

    def data_bytes(self) -> int:
        """Bytes of payload, key and headers (names and values)."""
        key = len(self.key) if self.key is not None else 0
        return len(self.payload) + key + sum(len(n.encode("utf-8")) + len(v) for n, v in self.headers)


@dataclass(frozen=True)
class Record:
    """A stored record, as read."""

    offset: int
    timestamp_ms: int
    key: Optional[bytes]
    headers: Tuple[Header, ...]
    payload: bytes


@dataclass(frozen=True)
class GroupRecord:
    """A record claimed through a consumer group.

    Attributes:
        offset: the record's offset in its shard.
        attempts: deliveries so far, this one included (1 the first time).
            Nack, extend and dead-letter name the delivery by it.
        timestamp_ms: the record's timestamp (unix ms).
        key: the record's key, if it has one.
        headers: the record's headers.
        payload: the record's payload.
        skipped_before: how many offsets directly below ``offset`` were
            settled and never delivered (control records, retention); ``None``
            unless the broker negotiated :attr:`Feature.GROUP_SKIPPED`.
    """

    offset: int
    attempts: int
    timestamp_ms: int
    key: Optional[bytes]
    headers: Tuple[Header, ...]
    payload: bytes
    skipped_before: Optional[int]


@dataclass(frozen=True)
class StreamInfo:
    """A stream's shard count, retention and placement."""

    stream: StreamRef
    shards: int
    #: Retention per shard in bytes; ``None`` for unlimited.
    retention_bytes: Optional[int]
    #: Retention in milliseconds; ``None`` for unlimited.
    retention_ms: Optional[int]
    #: The core that owns each shard, indexed by shard.
    placement: Tuple[int, ...]
    #: In a cluster: this creation of the stream, the same on every broker
    #: (see :meth:`felix.ClusterClient.create_stream`). ``None`` for a stream
    #: created without one, from a broker without
    #: :attr:`Feature.STREAM_INCARNATION`, and in :meth:`~felix.Client.list_streams`.
    incarnation: Optional[int] = None


@dataclass(frozen=True)
class ShardInfo:
    """One shard's offsets, size and owning core."""

    stream: StreamRef
    shard: int
    core: int
    #: Oldest retained offset.
    start_offset: int
    #: Offset the next published record will get.
    end_offset: int
    bytes: int
    segments: int
    #: Why the shard stopped taking writes, if it did.
    stopped: Optional[str]


@dataclass(frozen=True)
class PeerProgress:
    """How far another broker's replica has got, as the leader knows it."""

    node: int
    #: Highest replication index that broker is known to hold.
    matched: int


#: A replica's part in its shard's group, by its wire number.
REPLICA_ROLES = ("leader", "elected", "follower", "electing", "stopped")


@dataclass(frozen=True)
class ReplicaInfo:
    """One broker's replica of a shard, as that broker sees it (a broker in
    a cluster). Indices count replication entries, not offsets."""

    stream: StreamRef
    shard: int
    #: The answering broker's node id.
    node: int
    #: ``leader``, ``elected`` (writing its generation start), ``follower``,
    #: ``electing`` (knows no leader) or ``stopped``.
    role: str
    term: int
    #: The leader's node id and client address, as this broker knows them.
    leader: Optional[int]
    leader_addr: Optional[str]
    commit: int
    applied: int
    last_index: int
    compacted: int
    #: Why the replica stopped, if it did.
    stopped: Optional[str]
    #: On the leader, every other broker's progress; empty elsewhere.
    peers: Tuple[PeerProgress, ...]


@dataclass(frozen=True)
class ClusterMember:
    """One broker of a cluster, as :meth:`felix.Client.describe_cluster` names it."""

    #: Its node id.
    node: int
    #: Where clients reach it (its ``server.listen``, ``"host:port"``).
    addr: str


@dataclass(frozen=True)
class ClusterInfo:
    """The answer to :meth:`felix.Client.describe_cluster`: the answering
    broker's node id and every broker of its cluster, itself included, in
    node order."""

    #: The answering broker's node id.
    node: int
    members: Tuple[ClusterMember, ...]


@dataclass(frozen=True)
class Published:
    """Where a publish was written: offsets ``base_offset .. base_offset + count - 1`` of ``shard``."""

    shard: int
    base_offset: int
    count: int

    @property
    def last_offset(self) -> int:
        """Offset of the last record written (``base_offset`` for an empty answer)."""
        return self.base_offset + max(self.count - 1, 0)


@dataclass(frozen=True)
class ReadBatch:
    """The answer to :meth:`felix.Client.read`."""

    records: Tuple[Record, ...]
    #: Where the following read should start.
    next_offset: int
    #: Oldest offset the shard still retains.
    start_offset: int
    #: Offset the next published record will get (the tail).
    end_offset: int


@dataclass(frozen=True)
class DeadLetterInfo:
    """One dead letter of a group."""

    offset: int
    attempts: int
    #: When it was dead-lettered (unix ms).
    at_ms: int
    reason: Optional[str]
    #: True when a consumer dead-lettered it, False when the broker gave up
    #: after too many attempts.
    by_consumer: bool


@dataclass(frozen=True)
class DeadLetterPage:
    """One page of a group's dead letters, in offset order."""

    letters: Tuple[DeadLetterInfo, ...]
    #: The ``from_offset`` of the following page; ``None`` at the end of the list.
    next: Optional[int]


@dataclass(frozen=True)
class GroupInfo:
    """Where a consumer group stands on one shard."""

    group: str
    #: The lowest offset not yet finished; everything below it is finished.
    position: int
    end_offset: int
    start_offset: int
    #: Standing claims plus delayed nacks.
    in_flight: int
    #: Nacked or expired, waiting to be handed out again.
    owed: int
    #: Nacked with a delay that has not yet passed.
    delayed: int
    dead_letters: int
    oldest_in_flight_age_ms: Optional[int]
    oldest_owed_age_ms: Optional[int]
    #: Unix ms of the last poll or ack.
    last_active_ms: Optional[int]

    @property
    def lag(self) -> int:
        """Records the group has yet to finish: ``end_offset - max(position,
        start_offset)`` (retention settles what it removed, unread)."""
        return max(self.end_offset - max(self.position, self.start_offset), 0)
