"""Consumer-group admin over every shard of a stream, shared by
:class:`~felix.Client` and :class:`~felix.ClusterClient`: each call is the
per-shard call run on shards ``0..n`` in order, the class supplying
``describe_stream``, ``describe_shard`` and the per-shard ``group_*`` calls
(on one broker, or on each shard's leader).

A group comes into being shard by shard, on its first poll there, and a call
can fail on one shard and not the others. So every shard is tried whatever
the others answered; a delete counts a shard without the group as done, a
seek creates the group there at the position (when another shard's seek
found it), a describe gives such a shard
as a first poll will make it (at the shard's start, owing everything it
holds); a group on no shard is :class:`~felix.NotFound` (the seek creates
nothing); and a failure on any shard raises the first, in shard order, its
message naming its shard and where the call was done."""

from typing import Callable, List, Optional

from .errors import FelixError, InvalidArgument, NotFound
from .types import GroupInfo, Start, StartKind, StartPosition, StreamLike, StreamRef


def _nowhere(stream: StreamLike, group: str) -> NotFound:
    """A delete, seek or describe that found the group on no shard."""
    return NotFound(f"group {group} does not exist on any shard of {StreamRef.parse(stream)}", not_applied=True)


def _outcome(call: Callable[[], None]) -> Optional[FelixError]:
    """The error of ``call()``, or None."""
    try:
        call()
    except FelixError as e:
        return e
    return None


def _settle(errors: List[Optional[FelixError]]) -> None:
    """Raise the first error (shard order), naming its shard and the shards
    the call was done on; nothing when every shard's call succeeded."""
    failed = [shard for shard, e in enumerate(errors) if e is not None]
    if not failed:
        return
    done = [str(shard) for shard, e in enumerate(errors) if e is None]
    where = f"done on shard(s) {', '.join(done)}" if done else "done on no shard"
    first = errors[failed[0]]
    assert first is not None
    first.message = f"{first.message} (shard {failed[0]}; {where})"
    first.args = (first.message,)
    if done:
        # The call as a whole did something, whatever this part says.
        first.not_applied = False
    raise first


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
        shard's own tail when its call lands). Every shard is tried; a failure
        on any raises, naming its shard and those the group was created on."""
        errors = [
            _outcome(lambda shard=shard: self.group_create(stream, shard, group, start))
            for shard in range(self._stream_shards(stream, start))
        ]
        _settle(errors)

    def group_seek_stream(self, stream: StreamLike, group: str, start: Start) -> None:
        """:meth:`group_seek` on every shard of the stream. On a shard the group
        has not polled yet (it does not exist there) it is created at
        ``start``, when another shard's seek found it; a group on no shard is
        :class:`~felix.NotFound`. Every shard is tried; a failure on any
        raises, naming its shard and those the group was moved on."""
        shards = self._stream_shards(stream, start)
        errors = [_outcome(lambda shard=shard: self.group_seek(stream, shard, group, start)) for shard in range(shards)]
        missing = [shard for shard, e in enumerate(errors) if isinstance(e, NotFound)]
        if len(missing) == shards:
            raise _nowhere(stream, group)
        if all(e is not None for e in errors):
            # No shard proved the group exists: with the rest failing it may
            # exist nowhere (a mistyped name), so nothing is created.
            missing = []

        def create_and_seek(shard: int) -> None:
            # Created where the seek puts it; the seek after it moves it there
            # even if a first poll created it meanwhile.
            self.group_create(stream, shard, group, start)
            self.group_seek(stream, shard, group, start)

        for shard in missing:
            errors[shard] = _outcome(lambda shard=shard: create_and_seek(shard))
        _settle(errors)

    def group_describe_stream(self, stream: StreamLike, group: str) -> List[GroupInfo]:
        """:meth:`group_describe` of every shard, in shard order. A shard the
        group has not polled yet (it does not exist there) is described as its
        first poll will make it: at the shard's start, owing every record the
        shard holds. A group on no shard is :class:`~felix.NotFound`."""
        shards = self._stream_shards(stream)
        described: List[Optional[GroupInfo]] = []
        for shard in range(shards):
            try:
                described.append(self.group_describe(stream, shard, group))
            except NotFound:
                described.append(None)
            except FelixError as e:
                e.message = f"{e.message} (shard {shard})"
                e.args = (e.message,)
                raise
        if all(info is None for info in described):
            raise _nowhere(stream, group)
        return [
            info if info is not None else self._not_yet_polled(stream, shard, group)
            for shard, info in enumerate(described)
        ]

    def _not_yet_polled(self, stream: StreamLike, shard: int, group: str) -> GroupInfo:
        """The group on a shard it has not polled yet, as its first poll there
        will make it: at the shard's start, nothing in play."""
        try:
            held = self.describe_shard(stream, shard)
        except FelixError as e:
            e.message = f"{e.message} (shard {shard})"
            e.args = (e.message,)
            raise
        return GroupInfo(
            group=group,
            position=held.start_offset,
            end_offset=held.end_offset,
            start_offset=held.start_offset,
            in_flight=0,
            owed=0,
            delayed=0,
            dead_letters=0,
            oldest_in_flight_age_ms=None,
            oldest_owed_age_ms=None,
            last_active_ms=None,
        )

    def group_delete_stream(self, stream: StreamLike, group: str) -> None:
        """:meth:`group_delete` on every shard of the stream. A shard without
        the group counts as done; a group on no shard is
        :class:`~felix.NotFound`. Every shard is tried; a failure on any
        raises, naming its shard and those the group was deleted on."""
        shards = self._stream_shards(stream)
        errors = [_outcome(lambda shard=shard: self.group_delete(stream, shard, group)) for shard in range(shards)]
        missing = [shard for shard, e in enumerate(errors) if isinstance(e, NotFound)]
        if len(missing) == shards:
            raise _nowhere(stream, group)
        for shard in missing:
            errors[shard] = None
        _settle(errors)
