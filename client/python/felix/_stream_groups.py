"""Consumer-group admin over every shard of a stream, shared by
:class:`~felix.Client` and :class:`~felix.ClusterClient`: each call is the
per-shard call run on shards ``0..n`` in order, the class supplying
``describe_stream`` and the per-shard ``group_*`` calls (on one broker, or on
each shard's leader)."""

from typing import List, Optional

from .errors import InvalidArgument
from .types import GroupInfo, Start, StartKind, StartPosition, StreamLike


class StreamGroupCalls:
    """``group_*_stream``: a per-shard group call on every shard of a stream."""

    def _stream_shards(self, stream: StreamLike, start: Optional[Start] = None) -> int:
        """The shard count; an offset ``start`` is refused for a stream of more
        than one shard, since offsets are per shard."""
        info = self.describe_stream(stream)
        if info.shards > 1 and start is not None and StartPosition.of(start).kind is StartKind.OFFSET:
            raise InvalidArgument(
                f"{info.stream} has {info.shards} shards and offsets are per shard; "
                "use EARLIEST or LATEST, or the per-shard call"
            )
        return info.shards

    def group_create_stream(self, stream: StreamLike, group: str, start: Start = StartPosition.EARLIEST) -> None:
        """:meth:`group_create` on every shard of the stream (``LATEST`` is each
        shard's own tail when its call lands)."""
        for shard in range(self._stream_shards(stream, start)):
            self.group_create(stream, shard, group, start)

    def group_seek_stream(self, stream: StreamLike, group: str, start: Start) -> None:
        """:meth:`group_seek` on every shard of the stream."""
        for shard in range(self._stream_shards(stream, start)):
            self.group_seek(stream, shard, group, start)

    def group_describe_stream(self, stream: StreamLike, group: str) -> List[GroupInfo]:
        """:meth:`group_describe` of every shard, in shard order."""
        return [self.group_describe(stream, shard, group) for shard in range(self._stream_shards(stream))]

    def group_delete_stream(self, stream: StreamLike, group: str) -> None:
        """:meth:`group_delete` on every shard of the stream."""
        for shard in range(self._stream_shards(stream)):
            self.group_delete(stream, shard, group)
