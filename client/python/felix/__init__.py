"""Python client for the Felix durable sharded log broker.

Quick start::

    import felix

    with felix.Client.connect("127.0.0.1:7400") as client:
        client.create_stream("t1/default/events", 4)
        offset = client.publish("t1/default/events", 0, b"hello")
        batch = client.read("t1/default/events", 0, offset)
        assert batch.records[0].payload == b"hello"

For a cluster of brokers, :class:`ClusterClient` takes one broker's address
or more (it learns the others from the first that answers) and sends each
shard's calls to the broker that leads it.

See the README for consumer groups, clusters, errors and the threading model.
"""

from ._version import __version__
from .client import Client, ClientConfig, RecordLike, Seconds
from .cluster import ClusterClient
from .errors import (
    AlreadyExists,
    Busy,
    ConnectionFailed,
    Disconnected,
    FelixError,
    Internal,
    InvalidArgument,
    InvalidRequest,
    NotFound,
    NotLeader,
    ProtocolError,
    StaleClaim,
    Timeout,
    TooLarge,
    Unauthorized,
    Unavailable,
    Unsupported,
    WrongCore,
)
from .routing import crc32c, shard_for_key
from .sharded import ShardedGroup, ShardedRecord
from .subscription import Subscription
from .types import (
    ClusterInfo,
    ClusterMember,
    DeadLetterInfo,
    DeadLetterPage,
    Feature,
    GroupInfo,
    GroupRecord,
    Published,
    ReadBatch,
    Record,
    RecordIn,
    PeerProgress,
    ReplicaInfo,
    ShardInfo,
    StartKind,
    StartPosition,
    StreamInfo,
    StreamRef,
)

__all__ = [
    "__version__",
    "Client",
    "ClientConfig",
    "ClusterClient",
    "RecordLike",
    "Seconds",
    "Subscription",
    "ShardedGroup",
    "ShardedRecord",
    "crc32c",
    "shard_for_key",
    "ClusterInfo",
    "ClusterMember",
    "DeadLetterInfo",
    "DeadLetterPage",
    "Feature",
    "GroupInfo",
    "GroupRecord",
    "Published",
    "ReadBatch",
    "Record",
    "RecordIn",
    "ShardInfo",
    "PeerProgress",
    "ReplicaInfo",
    "StartKind",
    "StartPosition",
    "StreamInfo",
    "StreamRef",
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
]
