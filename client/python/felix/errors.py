"""The exceptions every Felix call raises.

Every error is a :class:`FelixError` with a snake_case :attr:`~FelixError.code`
and a human :attr:`~FelixError.message`. Errors the broker answered carry the
wire code's name (``not_found``, ``stale_claim``, ...) and its number in
:attr:`~FelixError.number`; each wire code has its own subclass. Errors raised
on the client side (``invalid_argument``, ``timeout``, ``disconnected``,
``connection_failed``, ``protocol``, and a local ``unsupported`` or
``already_exists``) have ``number`` ``None``.
"""

from typing import Dict, Optional, Type

__all__ = [
    "FelixError",
    "InvalidRequest",
    "NotFound",
    "AlreadyExists",
    "WrongCore",
    "Unsupported",
    "TooLarge",
    "Unavailable",
    "Unauthorized",
    "StaleClaim",
    "NotLeader",
    "Internal",
    "Busy",
    "InvalidArgument",
    "Timeout",
    "Disconnected",
    "ConnectionFailed",
    "ProtocolError",
    "error_from_wire",
]


class FelixError(Exception):
    """Base class of every error the Felix client raises.

    Attributes:
        code: snake_case name of the error: the broker's wire code
            (``"not_found"``) or a client-side kind (``"timeout"``).
        message: human-readable detail; not meant to be parsed.
        number: the wire error code's number when the broker answered with
            it, ``None`` for errors raised by the client itself.
        core: for ``wrong_core``, the core the broker says owns the shard.
        leader: for ``not_leader``, the client address of the broker that
            leads the shard, when the answering broker knows it (``None``
            while an election is on, or a new leader is catching up).
        not_applied: True when the request certainly did nothing, so that
            sending it again cannot apply it twice: the broker refused it
            before doing any of it and said so (a publish refused so stored
            none of its records: the disk nearly full, the broker stopping,
            a ``not_leader``), a call the client refused before sending, or
            one whose connection never opened (``ConnectionFailed``).
            False means the outcome is not known from the error alone (a
            lost connection, a timeout, a shard stopped while writing).
    """

    code: str = "felix_error"
    #: Raised by the client before the request was sent.
    _never_sent: bool = False

    def __init__(
        self,
        message: str,
        *,
        number: Optional[int] = None,
        core: Optional[int] = None,
        leader: Optional[str] = None,
        not_applied: bool = False,
    ):
        super().__init__(message)
        self.message = message
        self.number = number
        self.core = core
        self.leader = leader
        self.not_applied = not_applied or self._never_sent

    @property
    def from_broker(self) -> bool:
        """True when the broker answered with this error (it has a wire number)."""
        return self.number is not None

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, number={self.number!r})"


class InvalidRequest(FelixError):
    """Wire code 1: a malformed request or arguments that make no sense
    (a bad name, zero shards, an ack for an offset never handed out, an
    offset past the tail)."""

    code = "invalid_request"


class NotFound(FelixError):
    """Wire code 2: the stream, shard, group or record does not exist."""

    code = "not_found"


class AlreadyExists(FelixError):
    """Wire code 3: the stream or group already exists. Also raised locally
    (``number`` ``None``) by :meth:`felix.ClusterClient.create_stream` when
    the brokers of a cluster hold the stream in a way a create must not
    paper over (another shard count, different incarnations, too few)."""

    code = "already_exists"


class WrongCore(FelixError):
    """Wire code 4: the shard is owned by another core (:attr:`core` names it).

    The client follows one such redirect itself; you see this only if the
    retry was answered the same way.
    """

    code = "wrong_core"


class Unsupported(FelixError):
    """Wire code 5, or raised locally: the broker does not support the
    request, version or feature. Raised before sending anything when the
    broker did not advertise the feature bit a call needs."""

    code = "unsupported"


class TooLarge(FelixError):
    """Wire code 6: a frame, record or batch is over a size limit of the
    broker (a record over the frame size less 1 KiB, a dead-letter list too
    long for one frame). A request over the broker's ``max_frame_bytes`` is
    refused before sending with :class:`InvalidArgument` instead, as in the
    Rust client."""

    code = "too_large"


class Unavailable(FelixError):
    """Wire code 7: the broker cannot serve this now (shutting down, shard stopped)."""

    code = "unavailable"


class Unauthorized(FelixError):
    """Wire code 8: missing or bad credentials (a refused HELLO, after which
    the broker closes the connection), or a call the principal holds no
    permission for."""

    code = "unauthorized"


class StaleClaim(FelixError):
    """Wire code 9: the named group claim is no longer held by this delivery
    (it lapsed and went out again, or a seek voided it)."""

    code = "stale_claim"


class NotLeader(FelixError):
    """Wire code 10: this broker (in a cluster) does not lead the shard;
    :attr:`leader` names the broker that does, when it is known. Nothing was
    written: the request can be sent again (to the leader).
    :class:`felix.ClusterClient` follows it itself."""

    code = "not_leader"


class Internal(FelixError):
    """Wire code 11: a broker bug or I/O failure. Codes this client does not
    know also map here, with their number kept in :attr:`number` and the
    message."""

    code = "internal"


class Busy(FelixError):
    """Wire code 12: the broker is overloaded; back off and retry."""

    code = "busy"


class InvalidArgument(FelixError, ValueError):
    """The call's arguments were refused before anything was sent."""

    code = "invalid_argument"
    _never_sent = True


class Timeout(FelixError, TimeoutError):
    """No answer within the request timeout (plus any wait the request asked
    the broker for), or no connection within the connect timeout. The
    request may or may not have been applied."""

    code = "timeout"


class Disconnected(FelixError, ConnectionError):
    """The connection was lost while the request was in flight (or the
    client was closed). The request may or may not have been applied; it is
    not resent automatically. The next call reconnects."""

    code = "disconnected"


class ConnectionFailed(FelixError, ConnectionError):
    """Opening a connection to the broker failed (refused, unreachable,
    closed during HELLO, or placed on another core than asked for)."""

    code = "connection_failed"
    # The connection a request would have gone out on never opened.
    _never_sent = True


class ProtocolError(FelixError):
    """The broker sent bytes this client cannot make sense of. A whole frame
    with a bad body fails only the call it answers; the connection stays."""

    code = "protocol"


_BY_NUMBER: Dict[int, Type[FelixError]] = {
    1: InvalidRequest,
    2: NotFound,
    3: AlreadyExists,
    4: WrongCore,
    5: Unsupported,
    6: TooLarge,
    7: Unavailable,
    8: Unauthorized,
    9: StaleClaim,
    10: NotLeader,
    11: Internal,
    12: Busy,
}


def error_from_wire(
    number: int,
    message: str,
    core: Optional[int] = None,
    leader: Optional[str] = None,
    not_applied: bool = False,
) -> FelixError:
    """The exception for a broker ``Error`` answer. An unknown code becomes
    :class:`Internal`, keeping its number and naming it in the message."""
    cls = _BY_NUMBER.get(number)
    if cls is None:
        return Internal(
            f"unknown error code {number}: {message}",
            number=number,
            core=core,
            leader=leader,
            not_applied=not_applied,
        )
    return cls(message, number=number, core=core, leader=leader, not_applied=not_applied)
