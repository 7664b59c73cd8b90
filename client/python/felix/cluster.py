"""A client for a cluster of Felix brokers: :class:`ClusterClient`, which sends
each shard's requests to the broker that leads it. It mirrors the Rust
client's ``felix_client::ClusterClient`` (``client/src/cluster.rs``); see
"A cluster" in ``docs/operations.md``.

How a call finds the leader (:class:`_Pursuit`): it starts at the broker that
last led the shard (the first broker while none is known). A ``not_leader``
answer naming another broker is followed. A failure worth trying again (which
depends on the call, :class:`_Retry`) moves to the next broker after a pause
that starts at 25 ms and doubles up to 500 ms; a connection that failed is
dropped, so the next attempt connects anew. A call gives up after 40 attempts
(about 18 seconds of elections and dead brokers).
"""

import enum
import math
import secrets
import threading
import time
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar, Union

from . import _wire
from ._connection import Connection
from ._durations import Seconds
from ._shard_calls import ShardCall, ShardPort
from ._stream_groups import StreamGroupCalls
from .client import (
    Client,
    ClientConfig,
    Offsets,
    RecordLike,
    _parse_addr,
    check_ack_offsets,
    check_records,
    client_config,
)
from .errors import (
    AlreadyExists,
    ConnectionFailed,
    Disconnected,
    FelixError,
    InvalidArgument,
    NotFound,
    NotLeader,
    ProtocolError,
    Timeout,
    Unavailable,
    Unsupported,
)
from .routing import shard_for_key
from .sharded import ShardedGroup
from .subscription import Subscription
from .types import (
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
    check_int,
    check_u32,
    to_bytes,
)

__all__ = [
    "ClusterClient",
    "incarnation_to_create",
    "enough_answered",
    "show_incarnation",
    "keeps_incarnations",
    "create_on_broker",
]

T = TypeVar("T")

#: How many times a call tries before giving up (following a leader, or
#: waiting out an election, takes a few).
ATTEMPTS = 40
#: The first pause before trying another broker, in seconds; it doubles up to
#: :data:`BACKOFF_MAX`.
BACKOFF_FIRST = 0.025
BACKOFF_MAX = 0.5
#: The largest incarnation a broker stores (``i64::MAX``).
_MAX_INCARNATION = (1 << 63) - 1


class _Retry(enum.Enum):
    """How a call may be tried again."""

    #: Only where nothing was applied: ``not_leader`` (an election, a new
    #: leader catching up), a broker that could not be reached, an
    #: ``unavailable`` the broker marks as not applied (it was stopping).
    #: For group calls that must not run twice (a nack, a seek, a redrive...).
    REFUSED = "refused"
    #: Also after a lost answer (a timeout, a dropped connection) or an
    #: ``unavailable`` (whose outcome may be unknown): for calls that may run
    #: twice (publishes at least once, polls, acks, creates, describes).
    LOST = "lost"
    #: As :attr:`LOST`, for a read: any replica answers one, so the broker
    #: that did is not remembered as the leader.
    READ = "read"


def _retryable(error: FelixError, retry: _Retry) -> bool:
    """Whether ``error`` is worth trying another broker (or the same one
    again) for."""
    if isinstance(error, (NotLeader, ConnectionFailed)):
        return True
    if isinstance(error, (Disconnected, Timeout)):
        return retry is not _Retry.REFUSED
    # `unavailable` can mean the outcome is unknown (a commit that timed
    # out): tried again only where doing it twice is harmless, or where the
    # broker says it did nothing (it was stopping).
    if isinstance(error, Unavailable):
        return retry is not _Retry.REFUSED or error.not_applied
    return False


def _connection_lost(error: FelixError) -> bool:
    """Whether ``error`` says the connection to the broker failed."""
    return isinstance(error, (ConnectionFailed, Disconnected, Timeout))


# --- creating a stream on every broker ------------------------------------------


def incarnation_to_create(
    name: str, shards: int, brokers: int, held: Sequence[Tuple[str, StreamInfo]]
) -> Optional[int]:
    """The incarnation a stream ``name`` of ``shards`` shards is created with on
    the brokers that lack it, given ``held``: those of the ``brokers`` brokers
    asked (reachable or not) that hold it, with their description of it.
    Theirs, when more than half of the brokers hold it and they agree
    (``None`` for a stream created without one); a new one when no broker
    holds it.

    Every broker must hold the same incarnation: a shard's replicas are found
    by it, and a broker holding an older stream of the same name (down while
    it was deleted and created again) must not vote in the new one's
    elections. Nor may a copy that only a minority holds be spread to the
    others: it may be a stream the others deleted while those brokers were
    down, whose log would win the elections.

    Raises :class:`~felix.errors.AlreadyExists`, naming the brokers, when one
    holds it with another shard count, the holders disagree, or too few hold
    it: delete it on the brokers named, then create it again.
    """
    for broker, info in held:
        if info.shards != shards:
            raise AlreadyExists(f"{name} exists on {broker} with {info.shards} shards, not {shards}")
    if not held:
        return _new_incarnation()
    first, info = held[0]
    for other, theirs in held:
        if theirs.incarnation != info.incarnation:
            raise AlreadyExists(
                f"{name} is not the same stream everywhere: {first} holds incarnation "
                f"{show_incarnation(info.incarnation)} and {other} {show_incarnation(theirs.incarnation)} "
                "(one was deleted and created again while a broker was down); delete it on the "
                "brokers whose copy should go, then create it again"
            )
    if len(held) * 2 <= brokers:
        names = ", ".join(broker for broker, _ in held)
        which = "that broker" if len(held) == 1 else "those brokers"
        raise AlreadyExists(
            f"{name} is held by only {len(held)} of the {brokers} brokers ({names}): a create cut "
            f"short, or a stream the others deleted while these were down; delete it on {which}, "
            "then create it again"
        )
    return info.incarnation


def enough_answered(name: str, total: int, answered: int, held: int, unreached: Sequence[str]) -> None:
    """Whether a create of ``name`` may go ahead with some of the cluster's
    ``total`` brokers not reached (``unreached``, named for the message):
    only when more than half answered (``answered``, of which ``held`` hold
    the stream already), and when whether the holders are a majority does
    not turn on the brokers that did not answer. Raises
    :class:`~felix.errors.Unavailable` saying why, and that nothing was
    created, otherwise."""
    if not unreached:
        return
    gone = ", ".join(unreached)
    # A stream on fewer than a majority could elect no leader.
    if answered * 2 <= total:
        raise Unavailable(
            f"only {answered} of the {total} brokers answered ({gone} did not): nothing created; "
            "run the same create again once more of them are back"
        )
    # Whether the holders are a majority turns on brokers not asked.
    if held * 2 <= total and held > 0:
        raise Unavailable(
            f"{name} is on {held} of the {total} brokers, and {gone} did not answer: nothing "
            "created; run the same create again once they are back"
        )


def show_incarnation(incarnation: Optional[int]) -> str:
    """An incarnation as ``felix stream describe`` shows it: ``0x`` and 16 hex
    digits, or ``none``."""
    return "none" if incarnation is None else f"{incarnation:#018x}"


def _new_incarnation() -> int:
    """A new stream incarnation: nonzero, at most ``2**63 - 1`` (what a broker
    stores), and random, so never in practice the same twice."""
    return secrets.randbelow(_MAX_INCARNATION) + 1


def keeps_incarnations(client: Client, broker: str, incarnation: Optional[int]) -> None:
    """Raise :class:`~felix.errors.Unsupported` unless the broker of ``client``
    (at ``broker``) can create a stream as ``incarnation``: a broker that does
    not keep incarnations (an older build) would put its replicas in a group
    of their own."""
    if incarnation is not None and not client.has_feature(Feature.STREAM_INCARNATION):
        raise Unsupported(
            f"{broker} does not keep stream incarnations (FEATURE_STREAM_INCARNATION): an older "
            "build? Upgrade every broker of the cluster first"
        )


def create_on_broker(
    client: Client,
    broker: str,
    stream: StreamLike,
    shards: int,
    incarnation: Optional[int],
    *,
    retention_bytes: Optional[int] = None,
    retention_ms: Optional[int] = None,
) -> Optional[StreamInfo]:
    """Create a stream on one broker of a cluster as ``incarnation`` (see
    :func:`incarnation_to_create`): its description once created, ``None``
    when it was there already as the same stream (created meanwhile by
    another run). Raises :class:`~felix.errors.Unsupported` when
    ``incarnation`` is set and the broker does not keep incarnations, and
    :class:`~felix.errors.AlreadyExists` when what it holds is another stream.
    """
    keeps_incarnations(client, broker, incarnation)
    try:
        return client.create_stream(
            stream, shards, retention_bytes=retention_bytes, retention_ms=retention_ms, incarnation=incarnation
        )
    except AlreadyExists:
        info = client.describe_stream(stream)
        if info.shards == shards and info.incarnation == incarnation:
            return None
        raise AlreadyExists(
            f"{info.stream} was created on {broker} meanwhile as another stream ({info.shards} shards, "
            f"incarnation {show_incarnation(info.incarnation)}); delete it there, then create it again"
        ) from None


# --- finding a shard's leader ------------------------------------------------------


class _Pursuit:
    """One call's way to the broker that leads its shard: the Rust client's
    ``ClusterClient::on_leader`` loop, taken a step at a time, so that a call
    sent without waiting (:class:`_LeaderCall`) takes the same steps as one
    that blocks (:meth:`ClusterClient._on_leader`).

    Each attempt goes to :attr:`target` (:meth:`connect`); its outcome is
    :meth:`succeeded` or :meth:`failed`, which says how long to pause before
    the next attempt, or raises what the call raises.
    """

    def __init__(self, cluster: "ClusterClient", stream: StreamRef, shard: int, retry: _Retry) -> None:
        self._cluster = cluster
        self._key = (stream, shard)
        self._retry = retry
        #: The broker the next attempt goes to.
        self.target = cluster._cached_leader(self._key) or cluster.brokers[0]
        self._client: Optional[Client] = None
        #: The broker tried last after a failure (an index into the brokers).
        self._next = 0
        self._backoff = BACKOFF_FIRST
        self._attempts = 0
        self._follows = 0
        self._last: Optional[FelixError] = None

    def connect(self) -> Client:
        """The client of :attr:`target` (connected if need be), for an attempt."""
        self._attempts += 1
        self._client = None
        try:
            self._client = self._cluster._client(self.target)
        except Timeout as e:
            # Not connected: nothing was sent, so any call may try another
            # broker. Its message names the broker (_client).
            raise ConnectionFailed(e.message) from e
        except InvalidArgument as e:
            # An address a not_leader answer named that cannot be connected
            # to (a malformed one): nothing was sent, so the call moves on
            # to the next broker, as the Rust and Node clients do.
            raise ConnectionFailed(f"cannot connect to {self.target!r}: {e.message}") from e
        return self._client

    def succeeded(self) -> None:
        """The attempt was answered: its broker leads the shard (unless any
        replica answers such a call: a read)."""
        if self._retry is not _Retry.READ:
            self._cluster._remember(self._key, self.target)

    def failed(self, error: FelixError) -> float:
        """The attempt failed with ``error``: the pause (seconds) before the
        next one, whose :attr:`target` this sets. Raises ``error`` when it is
        not tried again, or the last failure worth trying again once the
        attempts are used up."""
        if self._cluster.closed:
            raise error
        pause = 0.0
        if isinstance(error, NotLeader) and error.leader is not None and error.leader != self.target:
            # Follow the broker that leads it; brokers naming each other (an
            # election under way) are waited out.
            self._follows += 1
            if self._follows > 2:
                pause = self._back_off()
            self.target = error.leader
        elif _retryable(error, self._retry):
            if _connection_lost(error):
                self._cluster._drop(self.target, self._client)
            self._last = error
            # No leader known here: try the next broker after a pause (an
            # election takes a few hundred ms).
            brokers = self._cluster.brokers
            self._next = (self._next + 1) % len(brokers)
            self.target = brokers[self._next]
            pause = self._back_off()
        else:
            if isinstance(error, (Disconnected, Timeout)):
                # Not tried again (it may have been applied); the next call
                # connects anew and finds the leader.
                self._cluster._drop(self.target, self._client)
                self._cluster._forget(self._key)
            raise error
        if self._attempts >= ATTEMPTS:
            if self._last is not None:
                raise self._last
            stream, shard = self._key
            raise Timeout(f"no broker took the call about {stream} shard {shard} in {ATTEMPTS} attempts")
        return pause

    def _back_off(self) -> float:
        pause = self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        return pause


class _LeaderCall(ShardCall):
    """A :class:`~felix._shard_calls.ShardCall` on a cluster: sent to the broker
    that leads its shard, found as :class:`ClusterClient`'s calls find it.
    ``build`` makes the request for the client of the broker it goes to (so
    the features it needs are that broker's). A landing that the cluster
    client would try again makes :meth:`follow` true; the next
    :meth:`connection` pauses as it would, then goes to the next target."""

    def __init__(
        self,
        cluster: "ClusterClient",
        stream: StreamRef,
        shard: int,
        build: Callable[[Client], _wire.WireRequest],
        retry: _Retry,
        wait: float = 0.0,
        notify: Optional[Callable[[ShardCall], None]] = None,
    ) -> None:
        super().__init__(None, stream, shard, None, wait, notify)
        self._cluster = cluster
        self._build = build
        self._pursuit = _Pursuit(cluster, stream, shard, retry)
        #: When the next attempt may go: after the backoff of the last failure.
        self._resume_at = -math.inf
        #: What the call raises once it is not tried again.
        self._final: Optional[FelixError] = None

    def connection(self) -> Connection:
        """The connection to the current target's core for the shard (after a
        ``wrong_core`` answer, the core it names on the same broker). May
        block: the pause before another attempt, a connect, a placement
        refresh."""
        if self._redirect is None:
            self._cluster._pause(max(0.0, self._resume_at - time.monotonic()))
            client = self._pursuit.connect()
            self._client, self._request = client, self._build(client)
            self._redirected = False
        return super().connection()

    def follow(self) -> bool:
        """Whether the call landed with an answer to follow: a ``wrong_core``
        (once per broker), a ``not_leader`` naming another broker, or a
        failure this call is tried again after. An answer makes the broker
        that gave it the shard's leader."""
        if super().follow():
            return True
        if self.landed is None or self._final is not None:
            return False
        error = self.error()
        if error is None:
            self._pursuit.succeeded()
            return False
        try:
            self._resume_at = time.monotonic() + self._pursuit.failed(error)
        except FelixError as final:
            self._final = final
            return False
        return True

    @property
    def resume_at(self) -> float:
        return self._resume_at if self._redirect is None else -math.inf

    def answer(self) -> _wire.Response:
        if self._final is not None:
            raise self._final
        return super().answer()


class _ClusterPort(ShardPort):
    """A :class:`~felix._shard_calls.ShardPort` for a cluster: each shard's calls
    go to the broker that leads it (the Rust ``ShardedGroup::on_cluster``)."""

    def __init__(self, cluster: "ClusterClient", stream: StreamRef) -> None:
        self.client = self._cluster = cluster
        self.stream = stream

    def member(self, consumer: Optional[str], reclaim: bool) -> Optional[_wire.GroupMember]:
        return Client._member(consumer, reclaim)

    def visibility_ms(self, visibility: Optional[Seconds]) -> Optional[int]:
        return Client._visibility_ms(visibility)

    def describe(self) -> StreamInfo:
        return self._cluster.describe_stream(self.stream)

    def cores(self, info: StreamInfo) -> Tuple[int, ...]:
        # Each shard is on its own leader's connection: no placement says
        # which shards share one.
        return ()

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
        def build(c: Client) -> _wire.WireRequest:
            return c._group_poll_request(self.stream, shard, group, max_records, wait_ms, member, visibility_ms)

        return _LeaderCall(self._cluster, self.stream, shard, build, _Retry.LOST, wait_ms / 1000, notify)

    def ack_call(self, shard: int, group: str, offsets: List[int]) -> ShardCall:
        def build(c: Client) -> _wire.WireRequest:
            return c._group_ack_request(self.stream, shard, group, offsets)

        return _LeaderCall(self._cluster, self.stream, shard, build, _Retry.LOST)

    def nack_call(self, shard: int, group: str, record: GroupRecord) -> ShardCall:
        def build(c: Client) -> _wire.WireRequest:
            return c._group_nack_request(self.stream, shard, group, record, 0, None)

        return _LeaderCall(self._cluster, self.stream, shard, build, _Retry.REFUSED)


# --- the client ------------------------------------------------------------------------


#: One broker's view of a shard's replica, or why it has none to give.
ReplicaView = Tuple[str, Union[ReplicaInfo, FelixError]]


def _broker_list(brokers: Union[str, Iterable[str]]) -> Tuple[str, ...]:
    """The brokers' addresses, trimmed, each once, in order; checked."""
    try:
        items = brokers.split(",") if isinstance(brokers, str) else list(brokers)
    except TypeError:
        raise InvalidArgument(f"brokers is a list of 'host:port' addresses, not {type(brokers).__name__}") from None
    out: List[str] = []
    for item in items:
        if not isinstance(item, str):
            raise InvalidArgument(f"a broker address is a 'host:port' str, not {type(item).__name__}")
        addr = item.strip()
        # Each once: a broker listed twice must not count twice (a create
        # counts the brokers holding a stream).
        if addr and addr not in out:
            _parse_addr(addr)
            out.append(addr)
    if not out:
        raise InvalidArgument("a cluster client needs at least one broker address")
    return tuple(out)


def _members_of(client: Client, given: Tuple[str, ...]) -> Tuple[str, ...]:
    """The client addresses of every broker of the cluster ``client``'s broker
    is in, as it names them (:meth:`Client.describe_cluster`); ``given`` when
    that broker cannot say (no :attr:`Feature.CLUSTER_INFO`)."""
    if not client.has_feature(Feature.CLUSTER_INFO):
        return given
    info = client.describe_cluster()
    members = tuple(m.addr for m in info.members)
    if not members:
        # A broker is always a member of its own cluster.
        raise ProtocolError("describe_cluster: the broker named no broker of its cluster")
    return members


class ClusterClient(StreamGroupCalls):
    """A thread-safe client for a cluster of Felix brokers (brokers run with
    ``cluster.nodes``), where every shard is replicated on every broker and
    served by its elected leader.

    It keeps a :class:`Client` per broker it has talked to and, per shard, the
    broker that last led it. A publish goes there; a broker that does not
    lead the shard answers ``not_leader`` naming the one that does, and the
    call follows it. While no leader is known (an election after a leader
    was lost), or a broker cannot be reached, the call tries the others in
    turn, backing off, for about 18 seconds.

    A publish (or a read) that was sent and whose answer was lost (the broker
    died, the connection dropped, the request timed out) is sent again, so a
    record can be written twice: at least once, as the guide says of
    failovers. Polls, acks, group creates and describes are sent again too.
    The other group calls (nacks, extensions, dead letters, redrives,
    discards, seeks, deletes) are tried again only where nothing was applied
    (``not_leader``, a broker not reached); a lost answer or an
    ``unavailable`` is raised as it is, since a seek to ``LATEST`` or a
    redrive made twice is not the same as once. Streams are created,
    deleted and described on every broker of the cluster (:attr:`members`),
    however many of them were given.

    The calls are :class:`Client`'s, with the same names and arguments, so
    code can take either; :meth:`describe_replicas` and :meth:`leader_of`
    are a cluster's own. Make one with :meth:`connect`; use it as a context
    manager or call :meth:`close`. Every method may be called from many
    threads at once. One broker's address is enough: the client learns the
    others from it (:meth:`connect`)::

        with felix.ClusterClient.connect("127.0.0.1:7400") as cluster:
            cluster.create_stream("t1/default/orders", 2)
            offset = cluster.publish("t1/default/orders", 0, b"hello")
    """

    def __init__(
        self, brokers: Tuple[str, ...], config: ClientConfig, members: Optional[Tuple[str, ...]] = None
    ) -> None:
        """Use :meth:`connect`."""
        #: The brokers given, then those of the cluster not among them: where
        #: a call looks for a shard's leader.
        self._brokers = brokers
        #: The cluster's brokers as the first broker reached named them, or
        #: the brokers given: where streams are created, deleted and described.
        self._members = members if members is not None else brokers
        self._config = config
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: The client of each broker, connected when first needed.
        self._clients: Dict[str, Client] = {}
        #: Every client made and not yet garbage: one dropped from `_clients`
        #: may still be in use by a call, and close() closes it too.
        self._made: "weakref.WeakSet[Client]" = weakref.WeakSet()
        #: The broker that last led each shard.
        self._leaders: Dict[Tuple[StreamRef, int], str] = {}
        #: Shard counts, for keyed publishes.
        self._shard_counts: Dict[StreamRef, int] = {}

    @classmethod
    def connect(
        cls,
        brokers: Union[str, Iterable[str]],
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
    ) -> "ClusterClient":
        """Connect to a cluster given one or more of its brokers' client
        addresses (``"host:port"``), as a list or as one string separated by
        commas (one listed twice counts once). One must answer now, tried in
        order; the others are connected to when a call needs them.

        The first broker that answers names every broker of its cluster
        (:meth:`Client.describe_cluster`, on a broker that advertises
        :attr:`Feature.CLUSTER_INFO`), so one address is enough: those are
        :attr:`members`, on which streams are created, deleted and described,
        and :attr:`brokers` is the brokers given, then the members not among
        them. Where that broker answers HELLO but not ``describe_cluster``,
        the next broker given is tried. A broker too old to name its cluster
        (no :attr:`Feature.CLUSTER_INFO`) leaves :attr:`members` the brokers
        given: then give every broker of the cluster.

        Settings are :meth:`Client.connect`'s, for the client of every broker.

        Raises :class:`~felix.errors.InvalidArgument` for an empty list or a
        malformed address, and the last broker's error
        (:class:`~felix.errors.ConnectionFailed`,
        :class:`~felix.errors.Timeout`, :class:`~felix.errors.Unauthorized`,
        ...) when none answers.
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
        given = _broker_list(brokers)
        last: Optional[FelixError] = None
        for broker in given:
            try:
                first = Client.connect(broker, config=config)
            except FelixError as e:
                last = e
                continue
            try:
                members = _members_of(first, given)
            except FelixError as e:
                first.close()
                last = e
                continue
            known = given + tuple(m for m in members if m not in given)
            cluster = cls(known, config, members)
            cluster._clients[broker] = first
            cluster._made.add(first)
            return cluster
        assert last is not None
        raise last

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        with self._lock:
            connected = [b for b, c in self._clients.items() if not c.closed]
        state = "closed" if self.closed else f"connected to {', '.join(connected) or 'none'}"
        return f"<felix.ClusterClient brokers={', '.join(self._brokers)} {state}>"

    def close(self) -> None:
        """Close the client of every broker. Calls in flight fail with
        :class:`~felix.errors.Disconnected`, a call pausing between attempts
        stops, and later calls fail with it too."""
        with self._lock:
            self._closed.set()
            clients = list(self._made)
            self._clients.clear()
        for client in clients:
            client.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    @property
    def brokers(self) -> Tuple[str, ...]:
        """The brokers given at connect, each once, in order, then those of
        the cluster (:attr:`members`) not among them: where a call looks for
        a shard's leader while none is known."""
        return self._brokers

    @property
    def members(self) -> Tuple[str, ...]:
        """The cluster's brokers (their client addresses, in node order), as
        the first broker reached at connect named them; the brokers given,
        on a broker too old to say (no :attr:`Feature.CLUSTER_INFO`).
        Streams are created, deleted and described on these."""
        return self._members

    @property
    def config(self) -> ClientConfig:
        """The settings of every broker's client."""
        return self._config

    def leader_of(self, stream: StreamLike, shard: int) -> Optional[str]:
        """The broker that last led ``shard`` of the stream, as far as this
        client knows (from the last call answered there, or
        :meth:`describe_replicas`); ``None`` if none is known."""
        return self._cached_leader((StreamRef.parse(stream), check_u32("shard", shard)))

    # --- brokers and leaders ---------------------------------------------------

    def _client(self, addr: str) -> Client:
        """The client of the broker at ``addr``, connecting one if need be."""
        with self._lock:
            if self._closed.is_set():
                raise Disconnected("the cluster client is closed")
            client = self._clients.get(addr)
        if client is not None and not client.closed:
            return client
        # Connected without the lock: a broker that does not answer must not
        # hold up calls to the others.
        try:
            fresh = Client.connect(addr, config=self._config)
        except (ConnectionFailed, Timeout) as e:
            # Which broker, since a cluster call may try several.
            raise type(e)(f"cannot connect to {addr}: {e.message}") from e
        with self._lock:
            closed = self._closed.is_set()
            if not closed:
                client = self._clients.get(addr)
                if client is None or client.closed:
                    client = self._clients[addr] = fresh
                    self._made.add(fresh)
        if closed or client is not fresh:
            fresh.close()
        if closed:
            raise Disconnected("the cluster client is closed")
        assert client is not None
        return client

    def _drop(self, addr: str, client: Optional[Client]) -> None:
        """Forget the client of ``addr`` (it failed), if it is still ``client``:
        the next call connects anew. It is not closed here, as other calls
        may still be waiting on it; it closes once they are done with it (or
        at :meth:`close`)."""
        with self._lock:
            if client is not None and self._clients.get(addr) is client:
                del self._clients[addr]

    def _cached_leader(self, key: Tuple[StreamRef, int]) -> Optional[str]:
        with self._lock:
            return self._leaders.get(key)

    def _remember(self, key: Tuple[StreamRef, int], leader: str) -> None:
        with self._lock:
            self._leaders[key] = leader

    def _forget(self, key: Tuple[StreamRef, int]) -> None:
        with self._lock:
            self._leaders.pop(key, None)

    def _forget_stream(self, ref: StreamRef) -> None:
        """Forget what is known of a stream (created or deleted anew)."""
        with self._lock:
            self._shard_counts.pop(ref, None)
            for key in [k for k in self._leaders if k[0] == ref]:
                del self._leaders[key]

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` between attempts; raises
        :class:`~felix.errors.Disconnected` if the client is closed meanwhile."""
        if self._closed.wait(seconds):
            raise Disconnected("the cluster client is closed")

    def _on_leader(self, stream: StreamLike, shard: int, retry: _Retry, call: Callable[[Client], T]) -> T:
        """Run ``call`` with the client of the broker that leads ``shard`` of the
        stream, following ``not_leader`` answers and trying the other brokers
        while none is known, as ``retry`` allows."""
        pursuit = _Pursuit(self, StreamRef.parse(stream), check_u32("shard", shard), retry)
        while True:
            try:
                result = call(pursuit.connect())
            except FelixError as error:
                self._pause(pursuit.failed(error))
                continue
            pursuit.succeeded()
            return result

    def with_leader(self, stream: StreamLike, shard: int, call: Callable[[Client], T]) -> T:
        """Run ``call`` with the :class:`Client` of the broker that leads
        ``shard`` of the stream: any per-shard call of :class:`Client` not
        wrapped here. A ``not_leader`` answer is followed, and while no
        leader is known the other brokers are tried, backing off; a call
        whose answer was lost, or that was answered ``unavailable`` (its
        outcome may be unknown), is not made again but raised."""
        return self._on_leader(stream, shard, _Retry.REFUSED, call)

    def _any_broker(self, call: Callable[[Client], T]) -> T:
        """``call`` on the first of :attr:`members` that answers it, in order:
        a broker that cannot be connected to, or whose answer a read would try
        again for, is passed over; any other error is raised at once. When
        none answers, the last error is raised."""
        last: Optional[FelixError] = None
        for broker in self._members:
            try:
                client = self._client(broker)
            except FelixError as error:
                if self.closed:
                    raise
                last = error
                continue
            try:
                return call(client)
            except FelixError as error:
                if self.closed or not _retryable(error, _Retry.READ):
                    raise
                if _connection_lost(error):
                    self._drop(broker, client)
                last = error
        assert last is not None
        raise last

    # --- streams ---------------------------------------------------------------

    def create_stream(
        self,
        stream: StreamLike,
        shards: int,
        *,
        retention_bytes: Optional[int] = None,
        retention_ms: Optional[int] = None,
    ) -> StreamInfo:
        """Create a stream on every broker of the cluster (:attr:`members`),
        as one incarnation (see :func:`incarnation_to_create`, which chooses
        it). Where more than half of them hold the stream already (a create
        interrupted part way, or a broker that was down for it), the others
        get its incarnation and those that hold it are left as they are, so a
        create that fails part way can be run again; unlike :meth:`Client.create_stream`,
        a stream every broker holds as the same stream is no error. Returns
        the stream as the first broker holds it.

        Raises :class:`~felix.errors.AlreadyExists` where a broker holds it with
        another shard count, brokers hold different incarnations of it, or
        half of them or fewer hold it; :class:`~felix.errors.Unsupported`
        where a broker does not keep incarnations.

        A broker that cannot be reached (:class:`~felix.errors.ConnectionFailed`,
        :class:`~felix.errors.Timeout` or :class:`~felix.errors.Disconnected`
        connecting or asking) is passed over: the stream is made on the
        others, and :class:`~felix.errors.Unavailable` is raised naming it,
        to run the same create again once it is back (until then that broker
        takes no part in the stream). Nothing is made
        (:func:`enough_answered`) when half of the brokers or fewer answer,
        or when whether the brokers holding the stream are a majority turns
        on those that did not. A create that fails part way can be run again.
        """
        ref = StreamRef.parse(stream)
        check_int("shards", shards, (1 << 32) - 1, minimum=1)
        held: List[Tuple[str, StreamInfo]] = []
        missing: List[Tuple[str, Client]] = []
        unreached: List[str] = []
        for broker in self._members:
            client: Optional[Client] = None
            try:
                client = self._client(broker)
                held.append((broker, client.describe_stream(ref)))
            except NotFound:
                assert client is not None
                missing.append((broker, client))
            except FelixError as error:
                if self.closed or not _connection_lost(error):
                    raise
                self._drop(broker, client)
                unreached.append(f"{broker} ({error})")
        text = str(ref)
        total = len(self._members)
        enough_answered(text, total, len(held) + len(missing), len(held), unreached)
        incarnation = incarnation_to_create(text, shards, total, held)
        for broker, client in missing:
            keeps_incarnations(client, broker, incarnation)
        self._forget_stream(ref)
        infos = dict(held)
        for broker, client in missing:
            info = create_on_broker(
                client, broker, ref, shards, incarnation, retention_bytes=retention_bytes, retention_ms=retention_ms
            )
            if info is not None:
                infos[broker] = info
        if unreached:
            back = "it is" if len(unreached) == 1 else "they are"
            raise Unavailable(
                f"{text} was created on the other brokers, not on {', '.join(unreached)}: run the same "
                f"create again once {back} back"
            )
        first = next((infos[b] for b in self._members if b in infos), None)
        return first if first is not None else self.describe_stream(ref)

    def delete_stream(self, stream: StreamLike) -> None:
        """Delete a stream on every broker of the cluster (:attr:`members`;
        one already gone is fine, so is a stream no broker holds). Every
        broker is tried, one that cannot be reached or refuses included; the
        first such error is raised after the others were done, naming its
        broker and the brokers the stream was deleted on, so the call can be
        run again once that broker is back. Its ``not_applied`` is true only
        when no broker deleted anything."""
        ref = StreamRef.parse(stream)
        first: Optional[FelixError] = None
        failed = ""
        deleted: List[str] = []
        for broker in self._members:
            client: Optional[Client] = None
            try:
                client = self._client(broker)
                client.delete_stream(ref)
                deleted.append(broker)
            except NotFound:
                pass
            except FelixError as error:
                if _connection_lost(error):
                    self._drop(broker, client)
                if first is None:
                    first, failed = error, broker
        self._forget_stream(ref)
        if first is not None:
            where = f"deleted on {', '.join(deleted)}" if deleted else "deleted on no broker"
            first.message = f"{first.message} (broker {failed}; {where})"
            first.args = (first.message,)
            if deleted:
                # The call as a whole did something, whatever this part says.
                first.not_applied = False
            raise first

    def describe_stream(self, stream: StreamLike) -> StreamInfo:
        """A stream's shard count, retention, placement and incarnation, as the
        first broker of the cluster (:attr:`members`) that answers has it."""
        ref = StreamRef.parse(stream)
        info = self._any_broker(lambda c: c.describe_stream(ref))
        with self._lock:
            self._shard_counts[ref] = info.shards
        return info

    def list_streams(self, tenant: Optional[str] = None) -> List[StreamInfo]:
        """Every stream, or those of one tenant, as the first broker of the
        cluster (:attr:`members`) that answers has them."""
        return self._any_broker(lambda c: c.list_streams(tenant))

    def describe_shard(self, stream: StreamLike, shard: int) -> ShardInfo:
        """One shard's offsets, size and owning core, as the broker that last
        led it has them (any replica answers, so until a leader is known, the
        first that does; a follower can be a moment behind)."""
        return self._on_leader(stream, shard, _Retry.READ, lambda c: c.describe_shard(stream, shard))

    def describe_replicas(self, stream: StreamLike, shard: int) -> List[ReplicaView]:
        """Every broker's replica of ``shard``, as each sees it
        (:meth:`Client.describe_replica`), in the order of :attr:`members`:
        ``(broker, ReplicaInfo)``, or ``(broker, error)`` for a broker
        that could not be reached or refused. The brokers are asked all at
        once, so one that does not answer holds up only its own place. Of the
        brokers that say they lead, the one in the newest term is remembered
        as the shard's leader, so the next call goes there first."""
        ref = StreamRef.parse(stream)
        check_u32("shard", shard)
        answers: List[Optional[ReplicaView]] = [None] * len(self._members)

        def ask(i: int, broker: str) -> None:
            client: Optional[Client] = None
            try:
                client = self._client(broker)
                answers[i] = (broker, client.describe_replica(ref, shard))
            except FelixError as error:
                if _connection_lost(error):
                    self._drop(broker, client)
                answers[i] = (broker, error)

        asks = [
            threading.Thread(target=ask, args=(i, b), name=f"felix-describe-replica-{b}", daemon=True)
            for i, b in enumerate(self._members)
        ]
        for thread in asks:
            thread.start()
        for thread in asks:
            thread.join()
        views: List[ReplicaView] = [
            answer if answer is not None else (broker, Disconnected(f"{broker} gave no answer"))
            for answer, broker in zip(answers, self._members)
        ]
        # The newest term's leader, as its own broker reports it.
        leading = [(info.term, b) for b, info in views if isinstance(info, ReplicaInfo) and info.role == "leader"]
        if leading:
            self._remember((ref, shard), max(leading)[1])
        return views

    # --- publishing --------------------------------------------------------------

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
        """Publish one record to ``shard`` through its leader; returns its
        offset. Sent again after a lost answer: at least once."""
        record = RecordIn.of(payload, key=key, headers=headers, timestamp_ms=timestamp_ms)
        return self.publish_batch(stream, shard, [record]).base_offset

    def publish_batch(self, stream: StreamLike, shard: int, records: Iterable[RecordLike]) -> Published:
        """Publish records to ``shard`` in one request through its leader; they
        get consecutive offsets. Sent again after a lost answer: at least
        once (a batch can be written twice, whole)."""
        batch = check_records(records)
        return self._on_leader(stream, shard, _Retry.LOST, lambda c: c.publish_batch(stream, shard, batch))

    def publish_keyed(
        self,
        stream: StreamLike,
        key: Payload,
        payload: Payload,
        *,
        headers: Sequence[Tuple[str, Payload]] = (),
        timestamp_ms: Optional[int] = None,
    ) -> Published:
        """Publish one record with a routing key, through the leader of the
        shard :func:`~felix.shard_for_key` picks over the stream's shard count
        (as :meth:`Client.publish_keyed` does). The key is stored with it."""
        record = RecordIn.of(payload, key=key, headers=headers, timestamp_ms=timestamp_ms)
        return self.publish_keyed_batch(stream, key, [record])

    def publish_keyed_batch(self, stream: StreamLike, key: Payload, records: Iterable[RecordLike]) -> Published:
        """Publish records in one request to the shard ``key`` routes to,
        through its leader. Each record without a key of its own is stored
        with ``key``. Sent again after a lost answer: at least once."""
        ref = StreamRef.parse(stream)
        routing = to_bytes("key", key)
        batch = check_records(records, routing)
        with self._lock:
            shards = self._shard_counts.get(ref)
        if shards is None:
            shards = self.describe_stream(ref).shards
        shard = shard_for_key(routing, shards)
        try:
            return self._on_leader(ref, shard, _Retry.LOST, lambda c: c.publish_keyed_batch(ref, routing, batch))
        except NotFound:
            self._forget_stream(ref)
            raise

    # --- reading -------------------------------------------------------------------

    def read(
        self,
        stream: StreamLike,
        shard: int,
        start: Start,
        *,
        max_records: int = 500,
        wait: Seconds = 0,
    ) -> ReadBatch:
        """:meth:`Client.read` from the broker that last led the shard (every
        replica serves reads of what is committed; a follower's copy can be a
        moment behind its leader's). The broker that answers is not
        remembered as the leader."""
        return self._on_leader(
            stream, shard, _Retry.READ, lambda c: c.read(stream, shard, start, max_records=max_records, wait=wait)
        )

    def subscribe(
        self,
        stream: StreamLike,
        shard: int,
        start: Start = StartPosition.EARLIEST,
        *,
        max_records: int = 500,
        wait: Seconds = 10.0,
    ) -> Subscription:
        """Follow ``shard`` from ``start`` (:meth:`Client.subscribe`), each read
        made as :meth:`read` makes it."""
        return Subscription(
            self, StreamRef.parse(stream), check_u32("shard", shard), StartPosition.of(start), max_records, wait
        )

    # --- consumer groups: consuming ---------------------------------------------
    # Each call goes to the shard's leader, as Client's of the same name does
    # to its broker.

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
        """:meth:`Client.group_poll` on the shard's leader; sent again after a
        lost answer (what the lost one claimed goes back to the group when
        its claims lapse). A member that polls with ``reclaim`` after a
        failover finds nothing to reclaim: claims were the old leader's
        memory, and the records are owed to the group again."""
        return self._on_leader(
            stream,
            shard,
            _Retry.LOST,
            lambda c: c.group_poll(
                stream, shard, group, max_records, wait=wait, consumer=consumer, reclaim=reclaim, visibility=visibility
            ),
        )

    def group_ack(self, stream: StreamLike, shard: int, group: str, offsets: Offsets) -> None:
        """:meth:`Client.group_ack` on the shard's leader (an empty ``offsets``
        sends nothing); sent again after a lost answer."""
        batch = check_ack_offsets(offsets)
        if batch:
            self._on_leader(stream, shard, _Retry.LOST, lambda c: c.group_ack(stream, shard, group, batch))

    def group_nack(
        self, stream: StreamLike, shard: int, group: str, record: GroupRecord, *, reason: Optional[str] = None
    ) -> None:
        """:meth:`Client.group_nack` on the shard's leader."""
        self._on_leader(stream, shard, _Retry.REFUSED, lambda c: c.group_nack(stream, shard, group, record, reason=reason))

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
        """:meth:`Client.group_nack_after` on the shard's leader."""
        self._on_leader(
            stream,
            shard,
            _Retry.REFUSED,
            lambda c: c.group_nack_after(stream, shard, group, record, delay, reason=reason),
        )

    def group_extend(self, stream: StreamLike, shard: int, group: str, record: GroupRecord, by: Seconds) -> float:
        """:meth:`Client.group_extend` on the shard's leader."""
        return self._on_leader(stream, shard, _Retry.REFUSED, lambda c: c.group_extend(stream, shard, group, record, by))

    def group_dead_letter(
        self, stream: StreamLike, shard: int, group: str, record: GroupRecord, *, reason: Optional[str] = None
    ) -> None:
        """:meth:`Client.group_dead_letter` on the shard's leader."""
        self._on_leader(
            stream, shard, _Retry.REFUSED, lambda c: c.group_dead_letter(stream, shard, group, record, reason=reason)
        )

    def group_dead_letters(self, stream: StreamLike, shard: int, group: str) -> List[int]:
        """:meth:`Client.group_dead_letters` on the shard's leader (answered
        only once a majority confirms it still leads)."""
        return self._on_leader(stream, shard, _Retry.LOST, lambda c: c.group_dead_letters(stream, shard, group))

    def group_dead_letters_detailed(self, stream: StreamLike, shard: int, group: str) -> List[DeadLetterInfo]:
        """:meth:`Client.group_dead_letters_detailed` on the shard's leader
        (answered only once a majority confirms it still leads; after a
        failover part way, the whole list is fetched again)."""
        return self._on_leader(
            stream, shard, _Retry.LOST, lambda c: c.group_dead_letters_detailed(stream, shard, group)
        )

    def group_dead_letters_page(
        self, stream: StreamLike, shard: int, group: str, from_offset: int = 0, max_letters: int = 1000
    ) -> DeadLetterPage:
        """:meth:`Client.group_dead_letters_page` on the shard's leader."""
        return self._on_leader(
            stream,
            shard,
            _Retry.LOST,
            lambda c: c.group_dead_letters_page(stream, shard, group, from_offset, max_letters),
        )

    def group_redrive(self, stream: StreamLike, shard: int, group: str, offset: int) -> None:
        """:meth:`Client.group_redrive` on the shard's leader."""
        self._on_leader(stream, shard, _Retry.REFUSED, lambda c: c.group_redrive(stream, shard, group, offset))

    def group_discard(self, stream: StreamLike, shard: int, group: str, offset: int) -> None:
        """:meth:`Client.group_discard` on the shard's leader."""
        self._on_leader(stream, shard, _Retry.REFUSED, lambda c: c.group_discard(stream, shard, group, offset))

    # --- consumer groups: administration --------------------------------------

    def group_create(self, stream: StreamLike, shard: int, group: str, start: Start = StartPosition.EARLIEST) -> None:
        """:meth:`Client.group_create` on the shard's leader (a group that
        exists is left alone, so it is sent again after a lost answer)."""
        self._on_leader(stream, shard, _Retry.LOST, lambda c: c.group_create(stream, shard, group, start))

    def group_seek(self, stream: StreamLike, shard: int, group: str, start: Start) -> None:
        """:meth:`Client.group_seek` on the shard's leader."""
        self._on_leader(stream, shard, _Retry.REFUSED, lambda c: c.group_seek(stream, shard, group, start))

    def group_describe(self, stream: StreamLike, shard: int, group: str) -> GroupInfo:
        """:meth:`Client.group_describe` on the shard's leader (answered only
        once a majority confirms it still leads)."""
        return self._on_leader(stream, shard, _Retry.LOST, lambda c: c.group_describe(stream, shard, group))

    def group_delete(self, stream: StreamLike, shard: int, group: str) -> None:
        """:meth:`Client.group_delete` on the shard's leader."""
        self._on_leader(stream, shard, _Retry.REFUSED, lambda c: c.group_delete(stream, shard, group))

    def list_groups(self, stream: StreamLike, shard: int) -> List[str]:
        """:meth:`Client.list_groups` on the shard's leader."""
        return self._on_leader(stream, shard, _Retry.LOST, lambda c: c.list_groups(stream, shard))

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
        queue (:meth:`Client.sharded_group`), each shard's polls, acks, nacks,
        extensions and dead letters on the broker that leads it, following a
        new leader after a failover as this client's calls do (the Rust
        ``ShardedGroup::on_cluster``).

        Claims are the leader's memory: after a failover the records a lost
        leader had handed out are owed again from the group's durable
        position, so an ack of one of them may be refused
        (:class:`~felix.errors.StaleClaim`, once it has gone out again) and a
        record can arrive twice. A member's ``reclaim`` takes back only what
        it held on the leader it polls.
        """
        return ShardedGroup(
            _ClusterPort(self, StreamRef.parse(stream)),
            group,
            consumer=consumer,
            reclaim=reclaim,
            visibility=visibility,
            wait_slice=wait_slice,
        )
