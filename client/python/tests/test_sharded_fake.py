"""ShardedGroup against a scripted fake broker: answers a real broker gives
only now and then (an error beside records, waits ended at once, no answer,
a wrong core). No real broker needed."""

import struct
import time
from dataclasses import replace
from typing import Callable, Iterable, List, Optional, Tuple
from unittest import mock

import felix
from felix import ShardedRecord, _wire, sharded

from .fake_broker import FakeBroker, FakeBrokerCase, error_frame, response_frame

STREAM = "t/n/s"
#: Where a group key's shard sits in a request body for STREAM.
_SHARD_AT = len(_wire.Writer().stream(felix.StreamRef("t", "n", "s")).buf)
_GROUPS = int(felix.Feature.GROUPS)


def shard_of(body: bytes) -> int:
    """The shard a group request for STREAM names."""
    return int.from_bytes(body[_SHARD_AT : _SHARD_AT + 4], "little")


def poll_args(body: bytes) -> Tuple[int, int, int]:
    """(shard, max_records, wait_ms) of a group poll to group ``g``."""
    max_records, wait_ms = struct.unpack_from("<II", body, _SHARD_AT + 4 + 2 + 1)
    return shard_of(body), max_records, wait_ms


def stream_answer(request_id: int, placement: List[int]) -> bytes:
    w = _wire.Writer().stream(felix.StreamRef("t", "n", "s")).u32(len(placement)).u8(0).u8(0).u32(len(placement))
    for core in placement:
        w.u32(core)
    return response_frame(request_id, 0x10, bytes(w.buf))


def records_answer(request_id: int, offsets: List[int]) -> bytes:
    w = _wire.Writer().u32(len(offsets))
    for offset in offsets:
        w.u64(offset).u32(1).u64(0).u8(0).u32(0).blob(b"r%d" % offset).u8(0)
    return response_frame(request_id, 0x30, bytes(w.buf))


def unanswered_waits(header, body, core):  # type: ignore[no-untyped-def]
    """Two shards; sweeps answered empty, waiting polls never answered."""
    if header.opcode == 0x11:
        return stream_answer(header.request_id, [0, 0])
    if poll_args(body)[2] > 0:
        return b""  # Never answered.
    return records_answer(header.request_id, [])


def handing_back(nacked: List[int], polls):  # type: ignore[no-untyped-def]
    """Two shards; nacks are answered and their shards noted in ``nacked``;
    ``polls(header, body, shard)`` answers the polls."""

    def script(header, body, core):  # type: ignore[no-untyped-def]
        if header.opcode == 0x11:
            return stream_answer(header.request_id, [0, 0])
        shard = shard_of(body)
        if header.opcode == 0x32:
            nacked.append(shard)
            return nack_answer(header.request_id)
        return polls(header, body, shard)

    return script


class FakeCase(FakeBrokerCase):
    def serve(self, script, features: int = _GROUPS, **options: object) -> FakeBroker:  # type: ignore[no-untyped-def]
        return super().serve(script, features, **options)


class ShardedFakeTest(FakeCase):
    def test_an_error_beside_records_comes_with_the_next_poll_that_has_none(self) -> None:
        polls: List[Tuple[int, int, int]] = []

        def script(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                return stream_answer(header.request_id, [0, 0])
            shard, max_records, wait_ms = poll_args(body)
            polls.append((shard, max_records, wait_ms))
            if shard == 0 and len(polls) == 1:
                return records_answer(header.request_id, [0, 1])
            if shard == 1 and len(polls) == 2:
                return error_frame(header.request_id, 7, "shard stopped")
            return records_answer(header.request_id, [])

        g = self.connect(self.serve(script)).sharded_group(STREAM, "g")
        got = g.poll(5)
        self.assertEqual([(r.shard, r.offset, r.payload) for r in got], [(0, 0, b"r0"), (0, 1, b"r1")])
        # The sweep asked shard 1 for what shard 0 left of max_records.
        self.assertEqual(polls, [(0, 5, 0), (1, 3, 0)])
        with self.assertRaises(felix.Unavailable):
            g.poll(5)
        self.assertEqual(len(polls), 2, "the deferred error is raised before anything is sent")
        self.assertEqual(g.poll(5), [])
        g.close()

    def test_waits_the_broker_ends_at_once_are_not_resent_before_their_slice(self) -> None:
        polls: List[Tuple[float, int, int, int]] = []

        def script(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                return stream_answer(header.request_id, [0, 0])
            polls.append((time.monotonic(), *poll_args(body)))
            return records_answer(header.request_id, [])

        g = self.connect(self.serve(script)).sharded_group(STREAM, "g", wait_slice=0.25)
        started = time.monotonic()
        self.assertEqual(g.poll(10, wait=1.0), [])
        self.assertGreaterEqual(time.monotonic() - started, 0.99)
        # A sweep of both shards, then a wait on each every 250 ms: about ten
        # polls, not one per round trip.
        self.assertTrue(4 <= len(polls) <= 14, f"{len(polls)} polls in 1 s")
        self.assertEqual([(s, m, w) for _, s, m, w in polls[:2]], [(0, 10, 0), (1, 10, 0)])
        waits = [p for p in polls[2:]]
        self.assertTrue(all(m == 5 and 0 < w <= 250 for _, _, m, w in waits), waits)
        for shard in (0, 1):
            times = [t for t, s, _, _ in waits if s == shard]
            gaps = [b - a for a, b in zip(times, times[1:])]
            self.assertTrue(all(gap >= 0.2 for gap in gaps), gaps)
        g.close()

    def test_a_wait_that_never_answers_times_out(self) -> None:
        client = self.connect(self.serve(unanswered_waits), request_timeout=0.3)
        g = client.sharded_group(STREAM, "g", wait_slice=0.2)
        started = time.monotonic()
        with self.assertRaises(felix.Timeout):
            g.poll(10, wait=5)
        self.assertLess(time.monotonic() - started, 2)
        # The other shard's wait timed out too; close says so, and returns.
        with self.assertRaises(felix.Timeout):
            g.close()
        self.assertEqual(g._out, {})

    def test_a_sharded_poll_follows_a_wrong_core_answer(self) -> None:
        describes: List[int] = []
        calls: List[Tuple[int, int, Optional[int]]] = []

        def script(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                describes.append(core)
                return stream_answer(header.request_id, [0, 0] if len(describes) == 1 else [0, 1])
            shard = shard_of(body)
            calls.append((core, header.opcode, shard))
            if shard == 1 and core == 0:
                return error_frame(header.request_id, 4, "shard 1 is on core 1", core=1)
            if header.opcode == 0x31:
                return response_frame(header.request_id, 0x03, b"")
            return records_answer(header.request_id, [7] if shard == 1 else [])

        g = self.connect(self.serve(script, cores=2)).sharded_group(STREAM, "g")
        got = g.poll(4)
        self.assertEqual([(r.shard, r.offset) for r in got], [(1, 7)])
        g.ack_many(got)
        self.assertEqual(calls, [(0, 0x30, 0), (0, 0x30, 1), (1, 0x30, 1), (1, 0x31, 1)])
        g.close()


def nack_answer(request_id: int) -> bytes:
    return response_frame(request_id, 0x03, b"")


class ShardedInterruptTest(FakeCase):
    """What a ``KeyboardInterrupt`` at each step of taking answers in leaves."""

    def group_with_answers(self, **options: object) -> Tuple[felix.ShardedGroup, List[int]]:
        """Two shards; their first waiting polls claim offsets 0 and 1 of
        shard 0 and 5 of shard 1. Returns the group and the shards nacked."""
        given = {0: [0, 1], 1: [5]}
        nacked: List[int] = []

        def polls(header, body, shard):  # type: ignore[no-untyped-def]
            _, _, wait_ms = poll_args(body)
            return records_answer(header.request_id, given.pop(shard, []) if wait_ms else [])

        script = handing_back(nacked, polls)
        g = self.connect(self.serve(script)).sharded_group(STREAM, "g", wait_slice=0.2, **options)
        self.addCleanup(g.close)
        return g, nacked

    def interrupt_once(
        self, g: felix.ShardedGroup, name: str, when: Callable[..., bool] = lambda *_: True
    ) -> None:
        """Make ``g.<name>`` raise ``KeyboardInterrupt`` instead of running, the
        first time it is called ``when``."""
        original = getattr(g, name)
        calls: List[int] = []

        def hook(*args, **kwargs):  # type: ignore[no-untyped-def]
            if calls or not when(*args):
                return original(*args, **kwargs)
            calls.append(1)
            raise KeyboardInterrupt

        setattr(g, name, hook)

    def assert_all_once(self, g: felix.ShardedGroup) -> None:
        got: List[Tuple[int, int]] = []
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            got += [(r.shard, r.offset) for r in g.poll(10, wait=0.5)]
        self.assertEqual(sorted(got), [(0, 0), (0, 1), (1, 5)])
        self.assertEqual(g.held, 0)
        self.assertEqual(g.poll(10, wait=0.3), [])

    def test_interrupted_while_answers_land(self) -> None:
        # The answers land while the poll sleeps; it is interrupted before
        # looking: the next poll finds them in the calls still out.
        g, _ = self.group_with_answers()
        self.interrupt_once(g, "_sleep", lambda *_: len(g._out) == 2)
        with self.assertRaises(KeyboardInterrupt):
            g.poll(10, wait=5)
        self.assertEqual(len(g._out), 2)
        self.assert_all_once(g)

    def test_interrupted_after_records_were_held(self) -> None:
        # Held, and the call still out: taken in again, held once.
        g, _ = self.group_with_answers()
        interrupted: List[int] = []

        def hook(records: Iterable[ShardedRecord]) -> None:
            held = list(records)
            original(held)
            if held and not interrupted:
                interrupted.append(1)
                raise KeyboardInterrupt

        original = g._hold
        g._hold = hook  # type: ignore[assignment]
        with self.assertRaises(KeyboardInterrupt):
            g.poll(10, wait=5)
        self.assertGreaterEqual(g.held, 1)
        self.assert_all_once(g)

    def test_interrupted_before_handing_out(self) -> None:
        g, _ = self.group_with_answers()
        self.interrupt_once(g, "_hand_out", lambda *_: bool(g._ready))
        with self.assertRaises(KeyboardInterrupt):
            g.poll(10, wait=5)
        self.assertGreaterEqual(g.held, 1)
        self.assert_all_once(g)

    def test_a_record_held_twice_is_held_once_with_its_latest_attempt(self) -> None:
        g, _ = self.group_with_answers()
        (first, *_) = g.poll(1, wait=5)
        g._ready.clear()
        again = felix.ShardedRecord(first.shard, replace(first.record, attempts=2))
        g._hold([first, again, first])
        self.assertEqual([(r.shard, r.offset, r.attempts) for r in g._ready.values()], [(first.shard, first.offset, 2)])

    def test_an_interrupted_close_hands_back_on_the_next(self) -> None:
        g, nacked = self.group_with_answers()
        got = g.poll(2, wait=5)
        self.interrupt_once(g, "_run_all", lambda requests, *_: bool(requests))
        with self.assertRaises(KeyboardInterrupt):
            g.close()
        # Every answer was taken in; nothing was handed back yet.
        self.assertEqual(nacked, [])
        self.assertEqual(g.held, 3 - len(got))
        expected = sorted(shard for shard, _ in g._ready)
        g.close()
        self.assertEqual(sorted(nacked), expected)
        self.assertEqual(g.held, 0)
        g.close()  # Done: nothing more.
        self.assertEqual(sorted(nacked), expected)


class ShardedWaitsTest(FakeCase):
    def test_fewer_records_than_shards_rotate_short_waits(self) -> None:
        waits: List[Tuple[int, int, int]] = []

        def script(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                return stream_answer(header.request_id, [0, 0, 0, 0])
            shard, max_records, wait_ms = poll_args(body)
            if wait_ms:
                waits.append((shard, max_records, wait_ms))
                time.sleep(wait_ms / 1000)  # A broker holds the wait.
            return records_answer(header.request_id, [])

        g = self.connect(self.serve(script)).sharded_group(STREAM, "g")
        self.assertEqual(g.poll(1, wait=0.55), [])
        g.close()
        # One wait at a time, one record, 100 ms each, taking turns from
        # the shard after the sweep's first.
        self.assertGreaterEqual(len(waits), 4, waits)
        self.assertEqual([s for s, _, _ in waits], [(1 + i) % 4 for i in range(len(waits))])
        self.assertTrue(all(m == 1 and 0 < w <= 100 for _, m, w in waits), waits)

    def test_close_gives_up_at_its_deadline(self) -> None:
        g = self.connect(self.serve(unanswered_waits)).sharded_group(STREAM, "g", wait_slice=0.1)
        self.assertEqual(g.poll(2, wait=0.15), [])
        self.assertEqual(len(g._out), 2)
        started = time.monotonic()
        with mock.patch.object(sharded, "CLOSE_GRACE", 0.2), self.assertLogs("felix", "WARNING") as logs:
            g.close()
        self.assertTrue(0.25 <= time.monotonic() - started < 1.5)
        self.assertIn("2 polls", logs.output[0])
        self.assertEqual(g._out, {})

    def test_an_answer_that_beats_the_give_up_is_handed_back(self) -> None:
        nacked: List[int] = []

        def polls(header, body, shard):  # type: ignore[no-untyped-def]
            if poll_args(body)[2] == 0:
                return records_answer(header.request_id, [])
            if shard == 1:
                time.sleep(0.3)  # Lands after close's deadline.
            return records_answer(header.request_id, [0] if shard == 0 else [5])

        g = self.connect(self.serve(handing_back(nacked, polls))).sharded_group(STREAM, "g", wait_slice=0.05)
        self.assertEqual([(r.shard, r.offset) for r in g.poll(2, wait=5)], [(0, 0)])
        late = g._out[1]
        cancel = late.cancel

        def cancel_after_landing() -> bool:
            # The answer comes in just as close() gives up on it.
            late.wait_landed(5)
            return cancel()

        late.cancel = cancel_after_landing  # type: ignore[assignment]
        with mock.patch.object(sharded, "CLOSE_GRACE", 0.0):
            g.close()
        self.assertEqual(nacked, [1])
        self.assertEqual(g.held, 0)
