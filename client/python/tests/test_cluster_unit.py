"""ClusterClient without a cluster: which incarnation a create uses, the wire
fields a cluster adds, and, against scripted fake brokers, which failures
each kind of call is sent again after. No real broker needed."""

import struct
import threading
import time
import unittest
from typing import List, Optional
from unittest import mock

import felix
from felix import _wire, cluster, sharded
from felix.cluster import enough_answered, incarnation_to_create, show_incarnation

from .fake_broker import FakeBroker, FakeBrokerCase, error_frame, response_frame

STREAM = "t/n/s"
REF = felix.StreamRef("t", "n", "s")
#: Where a group request's shard sits in its body, for STREAM.
SHARD_AT = len(_wire.Writer().stream(REF).buf)
F = felix.Feature


def info(shards: int, incarnation: Optional[int]) -> felix.StreamInfo:
    return felix.StreamInfo(REF, shards, None, None, (0,) * shards, incarnation)


def stream_answer(request_id: int, shards: int = 1, incarnation: Optional[int] = None) -> bytes:
    """A ``Stream`` answer for STREAM, with the trailing incarnation if given."""
    w = _wire.Writer().stream(REF).u32(shards).u8(0).u8(0).u32(shards)
    for _ in range(shards):
        w.u32(0)
    if incarnation is not None:
        w.u64(incarnation)
    return response_frame(request_id, 0x10, bytes(w.buf))


def not_leader(request_id: int, leader: Optional[str]) -> bytes:
    """A ``not_leader`` answer naming ``leader`` (the client address)."""
    w = _wire.Writer().u16(10).string("this broker does not lead the shard").u8(0)
    w.opt(leader, lambda a: w.string(a))
    return response_frame(request_id, 0xFF, bytes(w.buf))


def cluster_answer(request_id: int, node: int, members: List[str]) -> bytes:
    """A ``Cluster`` answer: ``node`` answering, ``members`` numbered from 1."""
    w = _wire.Writer().u64(node).u32(len(members))
    for n, member in enumerate(members, 1):
        w.u64(n).string(member)
    return response_frame(request_id, 0x14, bytes(w.buf))


def published(request_id: int, base: int, count: int = 1) -> bytes:
    return response_frame(request_id, 0x20, struct.pack("<IQI", 0, base, count))


def ok(request_id: int) -> bytes:
    return response_frame(request_id, 0x03, b"")


def group_records(request_id: int, offsets: List[int]) -> bytes:
    w = _wire.Writer().u32(len(offsets))
    for offset in offsets:
        w.u64(offset).u32(1).u64(0).u8(0).u32(0).blob(b"r%d" % offset).u8(0)
    return response_frame(request_id, 0x30, bytes(w.buf))


def stream_or(answer):  # type: ignore[no-untyped-def]
    """A script answering a describe with STREAM (one shard) and anything
    else with ``answer(header, body)``."""

    def script(header, body, core):  # type: ignore[no-untyped-def]
        if header.opcode == 0x11:
            return stream_answer(header.request_id, 1)
        return answer(header, body)

    return script


def addr(fake: FakeBroker) -> str:
    host, port = fake.addr
    return f"{host}:{port}"


def record(offset: int) -> felix.GroupRecord:
    return felix.GroupRecord(offset, 1, 0, None, (), b"", None)


class RetryTest(unittest.TestCase):
    def test_only_what_did_nothing_is_tried_again_for_calls_that_must_not_run_twice(self) -> None:
        R = cluster._Retry
        refused = felix.Unavailable("stopping", number=7, not_applied=True)
        unknown = felix.Unavailable("not committed in time", number=7)
        nothing_there = felix.NotFound("no such shard", number=2, not_applied=True)
        for error, must_not_run_twice, may_run_twice in [
            (refused, True, True),
            (unknown, False, True),
            (nothing_there, False, False),
        ]:
            with self.subTest(error=error):
                self.assertEqual(cluster._retryable(error, R.REFUSED), must_not_run_twice)
                self.assertEqual(cluster._retryable(error, R.LOST), may_run_twice)

    def test_a_connection_that_never_opened_sent_nothing(self) -> None:
        self.assertTrue(felix.ConnectionFailed("cannot connect").not_applied)
        self.assertFalse(felix.Disconnected("lost").not_applied)


class IncarnationTest(unittest.TestCase):
    def refused(self, held: List, brokers: int, says: str) -> None:  # type: ignore[type-arg]
        with self.assertRaises(felix.AlreadyExists) as caught:
            incarnation_to_create("t/n/s", 2, brokers, held)
        self.assertIn(says, caught.exception.message)
        self.assertFalse(caught.exception.from_broker)

    def test_a_create_takes_the_majoritys_incarnation_or_refuses(self) -> None:
        # Nobody holds it: a new one, within the range a broker stores.
        fresh = incarnation_to_create("t/n/s", 2, 3, [])
        assert fresh is not None
        self.assertTrue(1 <= fresh <= (1 << 63) - 1)
        self.assertNotEqual(incarnation_to_create("t/n/s", 2, 3, []), fresh, "a new one each time")
        # A majority agree: theirs, a stream without one included.
        self.assertEqual(incarnation_to_create("t/n/s", 2, 3, [("a", info(2, 7)), ("b", info(2, 7))]), 7)
        self.assertIsNone(incarnation_to_create("t/n/s", 2, 3, [("a", info(2, None)), ("b", info(2, None))]))
        # Disagreeing holders, a None among them included.
        self.refused([("a", info(2, 7)), ("b", info(2, 8))], 3, "not the same stream everywhere")
        self.refused([("a", info(2, 7)), ("b", info(2, None))], 3, "holds incarnation 0x0000000000000007 and b none")
        # Too few hold it: perhaps a stream the others deleted.
        self.refused([("c", info(2, 7))], 3, "held by only 1 of the 3 brokers (c)")
        self.refused([("a", info(2, 7)), ("b", info(2, 7))], 4, "only 2 of the 4")
        # Another shard count is said first.
        self.refused([("a", info(3, 7)), ("b", info(2, 8))], 3, "exists on a with 3 shards, not 2")

    def test_a_create_passes_over_unreached_brokers_only_with_a_sure_majority(self) -> None:
        # The Rust client's test of the same name, case for case.
        def ok(total: int, answered: int, holding: int, gone: int) -> None:
            enough_answered("s", total, answered, holding, [f"b{i}" for i in range(gone)])

        ok(3, 3, 0, 0)  # Everyone answered.
        ok(3, 2, 0, 1)  # A new stream, two of three.
        ok(3, 2, 2, 1)  # Held by a majority already.

        def unavailable(total: int, answered: int, holding: int, gone: int, says: str) -> None:
            with self.assertRaises(felix.Unavailable) as caught:
                ok(total, answered, holding, gone)
            self.assertIn(says, caught.exception.message)
            self.assertIn("nothing created", caught.exception.message)
            self.assertFalse(caught.exception.from_broker)

        unavailable(3, 1, 0, 2, "only 1 of the 3 brokers answered")
        unavailable(4, 2, 0, 2, "only 2 of the 4 brokers answered")
        # One of three holds it, one did not answer: that one may hold it
        # too (a majority: spread it) or not (a copy to keep out).
        unavailable(3, 2, 1, 1, "is on 1 of the 3 brokers, and b0 did not answer")
        # The exact messages, as the Rust client words them.
        with self.assertRaises(felix.Unavailable) as caught:
            enough_answered("t/n/s", 3, 1, 0, ["x:1 (timeout: t)", "y:2 (disconnected: d)"])
        self.assertEqual(
            caught.exception.message,
            "only 1 of the 3 brokers answered (x:1 (timeout: t), y:2 (disconnected: d) did not): nothing created; "
            "run the same create again once more of them are back",
        )
        with self.assertRaises(felix.Unavailable) as caught:
            enough_answered("t/n/s", 3, 2, 1, ["x:1 (timeout: t)"])
        self.assertEqual(
            caught.exception.message,
            "t/n/s is on 1 of the 3 brokers, and x:1 (timeout: t) did not answer: nothing created; "
            "run the same create again once they are back",
        )

    def test_an_incarnation_shows_as_felix_stream_describe_shows_it(self) -> None:
        self.assertEqual(show_incarnation(None), "none")
        self.assertEqual(show_incarnation(0xABC), "0x0000000000000abc")


class ClusterWireTest(unittest.TestCase):
    def decode(self, opcode: int, frame: bytes) -> _wire.Response:
        body = frame[16:]
        return _wire.decode_response(_wire.FrameHeader(12 + len(body), 2, opcode, 0, 1), body)

    def test_a_stream_answer_may_carry_a_trailing_incarnation(self) -> None:
        self.assertIsNone(self.decode(0x10, stream_answer(1)).value.incarnation)
        self.assertEqual(self.decode(0x10, stream_answer(1, incarnation=99)).value.incarnation, 99)
        with self.assertRaises(felix.ProtocolError):
            self.decode(0x10, stream_answer(1, incarnation=0))  # Never 0.
        with self.assertRaises(felix.ProtocolError):
            self.decode(0x10, stream_answer(1) + b"\x01")  # Cut short.
        # A list's entries never carry it.
        entry = stream_answer(1)[16:]
        self.assertEqual(self.decode(0x11, b"\x00" * 16 + struct.pack("<I", 1) + entry).value[0].incarnation, None)
        with self.assertRaises(felix.ProtocolError):
            self.decode(0x11, b"\x00" * 16 + struct.pack("<I", 1) + entry + struct.pack("<Q", 5))

    def test_a_create_carries_the_incarnation_only_when_given(self) -> None:
        plain = _wire.create_stream(REF, 2, None, None)
        given = _wire.create_stream(REF, 2, None, None, 0x0102030405060708)
        self.assertEqual(plain.required, F(0))
        self.assertEqual(given.required, F.STREAM_INCARNATION)
        self.assertEqual(given.body, plain.body + struct.pack("<Q", 0x0102030405060708))

    def test_a_not_leader_answer_names_the_leader(self) -> None:
        error = self.decode(0xFF, not_leader(1, "10.0.0.2:7400")).value
        self.assertIsInstance(error, felix.NotLeader)
        self.assertEqual((error.code, error.leader, error.core), ("not_leader", "10.0.0.2:7400", None))
        self.assertIsNone(self.decode(0xFF, not_leader(1, None)).value.leader)


class FakeClusterTest(FakeBrokerCase):
    def cluster(self, *fakes: FakeBroker) -> felix.ClusterClient:
        return self.cluster_of([addr(f) for f in fakes])

    def cluster_of(self, addrs: List[str]) -> felix.ClusterClient:
        cc = felix.ClusterClient.connect(addrs, request_timeout=5.0)
        self.addCleanup(cc.close)
        return cc

    def test_connect_counts_each_broker_once_and_needs_one(self) -> None:
        fake = self.serve(lambda h, b, c: ok(h.request_id))
        a = addr(fake)
        with self.assertRaises(felix.InvalidArgument):
            felix.ClusterClient.connect([])
        with self.assertRaises(felix.InvalidArgument):
            felix.ClusterClient.connect(" , ")
        with self.assertRaises(felix.InvalidArgument):
            felix.ClusterClient.connect([a, "no-port"])
        cc = self.cluster(fake)
        self.assertEqual(cc.brokers, (a,))
        with felix.ClusterClient.connect(f" {a} ,{a}") as same:
            self.assertEqual(same.brokers, (a,))
        # One down is passed over; all down is the last one's error.
        gone = self.serve(lambda h, b, c: None)
        down = addr(gone)
        gone.close()
        with felix.ClusterClient.connect([down, a]) as one:
            self.assertEqual(one.brokers, (down, a))
            self.assertEqual(one.members, (down, a), "a broker that cannot name its cluster: those given")
        with self.assertRaises(felix.ConnectionFailed):
            felix.ClusterClient.connect([down])
        self.assertEqual(fake.received, [], "describe_cluster never sent to a broker without CLUSTER_INFO")

    def test_connect_learns_the_members_and_creates_deletes_and_describes_on_them(self) -> None:
        full = int(F.STREAM_INCARNATION | F.REPLICA_INFO)
        addrs: List[str] = []
        created: List[str] = []

        def member(name: str):  # type: ignore[no-untyped-def]
            held: List[int] = []

            def script(header, body, core):  # type: ignore[no-untyped-def]
                if header.opcode == 0x16:
                    return cluster_answer(header.request_id, 2, addrs)
                if header.opcode == 0x11:
                    if not held:
                        return error_frame(header.request_id, 2, "no such stream")
                    return stream_answer(header.request_id, 2, incarnation=held[0])
                if header.opcode == 0x10:
                    created.append(name)
                    held.append(struct.unpack("<Q", body[-8:])[0])
                    return stream_answer(header.request_id, 2, incarnation=held[0])
                if header.opcode == 0x13:
                    held.clear()
                    return ok(header.request_id)
                return error_frame(header.request_id, 1, "not in this test")

            return script

        # Node 2 is the seed: given alone, it names the cluster as c, a, b.
        a = self.serve(member("a"), full | int(F.CLUSTER_INFO))
        b, c = self.serve(member("b"), full), self.serve(member("c"), full)
        addrs[:] = [addr(c), addr(a), addr(b)]
        # A broker given that is not a member: never created on.
        outsider = self.serve(member("outsider"), full)
        cc = self.cluster_of([addr(a), addr(outsider)])
        self.assertEqual(a.received, [0x16])
        self.assertEqual(outsider.accepted, 0, "the first broker answered")
        self.assertEqual(cc.members, (addr(c), addr(a), addr(b)))
        self.assertEqual(cc.brokers, (addr(a), addr(outsider), addr(c), addr(b)), "given first, then the others")
        made = cc.create_stream(STREAM, 2)
        self.assertEqual(sorted(created), ["a", "b", "c"])
        self.assertEqual(outsider.received, [])
        self.assertIsNotNone(made.incarnation)
        for fake in (a, b, c):
            self.assertEqual(fake.received[-2:], [0x11, 0x10])
        self.assertEqual(cc.describe_stream(STREAM).incarnation, made.incarnation)
        self.assertEqual(c.received[-1], 0x11, "described by the first member")
        views = cc.describe_replicas(STREAM, 0)
        self.assertEqual([broker for broker, _ in views], list(cc.members))
        cc.delete_stream(STREAM)
        for fake in (a, b, c):
            self.assertEqual(fake.received[-1], 0x13)
        self.assertEqual(outsider.received, [], "nothing at all went to the broker outside the cluster")
        self.assertEqual(a.accepted, 1, "the connection connect made is the one used after")

    def test_a_delete_done_on_some_brokers_names_them_and_is_not_nothing_done(self) -> None:
        features = int(F.CLUSTER_INFO | F.ERROR_NOT_APPLIED)
        addrs: List[str] = []

        def member(refuses: bool):  # type: ignore[no-untyped-def]
            def script(header, body, core):  # type: ignore[no-untyped-def]
                if header.opcode == 0x16:
                    return cluster_answer(header.request_id, 1, addrs)
                if header.opcode == 0x13 and not refuses:
                    return ok(header.request_id)
                # Unavailable, marked as having done nothing.
                w = _wire.Writer().u16(7).string("stopping").u8(0).u8(1)
                return response_frame(header.request_id, 0xFF, bytes(w.buf))

            return script

        a, b, c = (self.serve(member(refuses), features) for refuses in (False, True, False))
        addrs[:] = [addr(a), addr(b), addr(c)]
        cc = self.cluster(a)
        with self.assertRaises(felix.Unavailable) as part:
            cc.delete_stream(STREAM)
        self.assertFalse(part.exception.not_applied, "deleted on a and c")
        self.assertIn(f"(broker {addr(b)}; deleted on {addr(a)}, {addr(c)})", part.exception.message)
        # Refused everywhere: nothing done, and it says so.
        addrs[:] = [addr(b)]
        with self.assertRaises(felix.Unavailable) as none:
            self.cluster(b).delete_stream(STREAM)
        self.assertTrue(none.exception.not_applied)
        self.assertIn("deleted on no broker", none.exception.message)

    def test_a_failed_describe_cluster_moves_on_to_the_next_broker_given(self) -> None:
        features = int(F.CLUSTER_INFO)
        others: List[str] = []
        bad = self.serve(lambda h, body, c: error_frame(h.request_id, 11, "internal trouble"), features)
        empty = self.serve(lambda h, body, c: cluster_answer(h.request_id, 1, []), features)
        good = self.serve(lambda h, body, c: cluster_answer(h.request_id, 3, others), features)
        others[:] = [addr(bad), "10.9.9.9:7400", addr(good)]
        cc = self.cluster(bad, empty, good)
        self.assertEqual((bad.received, empty.received, good.received), ([0x16], [0x16], [0x16]))
        self.assertEqual(cc.members, (addr(bad), "10.9.9.9:7400", addr(good)))
        self.assertEqual(cc.brokers, (addr(bad), addr(empty), addr(good), "10.9.9.9:7400"))
        # Every broker failing it: the last one's error.
        with self.assertRaises(felix.ProtocolError) as caught:
            felix.ClusterClient.connect([addr(bad), addr(empty)])
        self.assertIn("named no broker", caught.exception.message)

    def test_an_incarnation_is_never_sent_to_a_broker_that_does_not_keep_them(self) -> None:
        fake = self.serve(lambda h, b, c: stream_answer(h.request_id))
        client = self.connect(fake)
        with self.assertRaises(felix.Unsupported):
            client.create_stream(STREAM, 1, incarnation=5)
        with self.assertRaises(felix.InvalidArgument):
            client.create_stream(STREAM, 1, incarnation=0)
        self.assertEqual(fake.received, [])

    def test_a_create_gives_the_others_the_majoritys_incarnation(self) -> None:
        created: List[bytes] = []

        def holder(header, body, core):  # type: ignore[no-untyped-def]
            return stream_answer(header.request_id, 2, incarnation=77)

        def lacking(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                return error_frame(header.request_id, 2, "no such stream")
            created.append(body)
            return stream_answer(header.request_id, 2, incarnation=77)

        full = int(F.STREAM_INCARNATION)
        a, b, c = self.serve(holder, full), self.serve(holder, full), self.serve(lacking, full)
        made = self.cluster(a, b, c).create_stream(STREAM, 2)
        self.assertEqual(made.incarnation, 77)
        self.assertEqual(len(created), 1)
        self.assertEqual(created[0][-8:], struct.pack("<Q", 77), "created as the holders' incarnation")
        # A broker that does not keep incarnations: refused before any create.
        old = self.serve(lacking, 0)
        with self.assertRaises(felix.Unsupported):
            self.cluster(a, b, old).create_stream(STREAM, 2)
        self.assertEqual(old.received, [0x11])

    def test_a_create_passes_over_a_broker_it_cannot_reach(self) -> None:
        full = int(F.STREAM_INCARNATION)
        created: List[bytes] = []

        def lacking(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                return error_frame(header.request_id, 2, "no such stream")
            created.append(body)
            return stream_answer(header.request_id, 2, incarnation=struct.unpack("<Q", body[-8:])[0])

        def down() -> str:
            gone = self.serve(lambda h, body, c: None)
            where = addr(gone)
            gone.close()
            return where

        # One of three not reached: made on the other two as one
        # incarnation, and Unavailable naming the third.
        a, b = self.serve(lacking, full), self.serve(lacking, full)
        third = down()
        cc = self.cluster_of([addr(a), third, addr(b)])
        self.assertEqual(cc.members, (addr(a), third, addr(b)))
        with self.assertRaises(felix.Unavailable) as caught:
            cc.create_stream(STREAM, 2)
        message = caught.exception.message
        self.assertTrue(
            message.startswith(f"{STREAM} was created on the other brokers, not on {third} (connection_failed: "),
            message,
        )
        self.assertIn(f"cannot connect to {third}: ", message, "the connect error names the broker")
        self.assertTrue(message.endswith(": run the same create again once it is back"), message)
        self.assertFalse(caught.exception.from_broker)
        self.assertEqual((a.received, b.received), ([0x11, 0x10], [0x11, 0x10]))
        self.assertEqual(len(created), 2)
        self.assertEqual(created[0][-8:], created[1][-8:], "one incarnation on both")
        self.assertNotEqual(created[0][-8:], bytes(8))

        # A broker that drops the connection when asked counts as not
        # reached too (Disconnected), and two of them are named, together.
        created.clear()
        dropping = self.serve(lambda h, body, c: None, full)
        c, e = self.serve(lacking, full), self.serve(lacking, full)
        cc = self.cluster_of([addr(c), addr(dropping), addr(a), addr(e), third])
        with self.assertRaises(felix.Unavailable) as caught:
            cc.create_stream(STREAM, 2)
        message = caught.exception.message
        self.assertIn(f"not on {addr(dropping)} (disconnected: ", message)
        self.assertIn(f"{third} (connection_failed: cannot connect to {third}: ", message)
        self.assertTrue(message.endswith(": run the same create again once they are back"), message)
        self.assertEqual(len(created), 3, "made on the three of five that answered")
        self.assertEqual(len({body[-8:] for body in created}), 1)

        # Two of three not reached: nothing is made anywhere.
        created.clear()
        d = self.serve(lacking, full)
        cc = self.cluster_of([addr(d), down(), third])
        with self.assertRaises(felix.Unavailable) as caught:
            cc.create_stream(STREAM, 2)
        self.assertIn("only 1 of the 3 brokers answered", caught.exception.message)
        self.assertIn("nothing created", caught.exception.message)
        self.assertEqual(d.received, [0x11], "asked, and nothing created")
        self.assertEqual(created, [])

        # A closed cluster client is not a broker not reached.
        cc.close()
        with self.assertRaises(felix.Disconnected):
            cc.create_stream(STREAM, 2)

    def test_a_not_leader_answer_naming_another_broker_is_followed(self) -> None:
        b = self.serve(lambda h, body, c: published(h.request_id, 41))
        a = self.serve(lambda h, body, c: not_leader(h.request_id, addr(b)))
        cc = self.cluster(a, b)
        self.assertIsNone(cc.leader_of(STREAM, 0))
        self.assertEqual(cc.publish(STREAM, 0, b"x"), 41)
        self.assertEqual(cc.leader_of(STREAM, 0), addr(b))
        self.assertEqual(cc.publish(STREAM, 0, b"y"), 41)
        self.assertEqual((a.received, b.received), ([0x20], [0x20, 0x20]), "the second went to the leader")

    def test_a_lost_answer_is_sent_again_for_a_publish_and_not_for_a_nack(self) -> None:
        # `a` takes acks and drops the connection on anything else; `b` leads
        # once `a` is gone.
        a = self.serve(lambda h, body, c: ok(h.request_id) if h.opcode == 0x31 else None, int(F.GROUPS))
        b = self.serve(lambda h, body, c: published(h.request_id, 7) if h.opcode == 0x20 else ok(h.request_id), int(F.GROUPS))
        cc = self.cluster(a, b)
        cc.group_ack(STREAM, 0, "g", [1, 2])
        self.assertEqual(cc.leader_of(STREAM, 0), addr(a))
        # A nack may have been applied: not sent again, and the leader is forgotten.
        with self.assertRaises(felix.Disconnected):
            cc.group_nack(STREAM, 0, "g", record(1))
        self.assertIsNone(cc.leader_of(STREAM, 0))
        self.assertEqual((a.received, b.received), ([0x31, 0x32], []))
        # A publish is sent again (at least once): on the next broker.
        self.assertEqual(cc.publish(STREAM, 0, b"x"), 7)
        self.assertEqual((a.received, b.received), ([0x31, 0x32, 0x20], [0x20]))
        self.assertEqual(cc.leader_of(STREAM, 0), addr(b))

    def test_unavailable_is_tried_again_only_where_twice_is_harmless(self) -> None:
        features = int(F.GROUPS | F.GROUP_ADMIN)
        a = self.serve(lambda h, body, c: error_frame(h.request_id, 7, "commit timed out"), features)
        b = self.serve(lambda h, body, c: published(h.request_id, 3) if h.opcode == 0x20 else ok(h.request_id), features)
        cc = self.cluster(a, b)
        with self.assertRaises(felix.Unavailable):
            cc.group_seek(STREAM, 0, "g", felix.StartPosition.LATEST)
        self.assertEqual(cc.publish(STREAM, 0, b"x"), 3)
        self.assertEqual((a.received, b.received), ([0x41, 0x20], [0x20]))

    def test_a_sharded_group_follows_each_shards_leader(self) -> None:
        given = {0: [3, 4]}

        def leader(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x30:
                return group_records(header.request_id, given.pop(0, []))
            return ok(header.request_id)

        b = self.serve(leader, int(F.GROUPS))

        def follower(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                return stream_answer(header.request_id, 1)
            return not_leader(header.request_id, addr(b))

        a = self.serve(follower, int(F.GROUPS))
        cc = self.cluster(a, b)
        with cc.sharded_group(STREAM, "g") as group:
            got = group.poll(4)
            self.assertEqual([(r.shard, r.offset) for r in got], [(0, 3), (0, 4)])
            self.assertEqual(cc.leader_of(STREAM, 0), addr(b))
            group.ack_many(got)
        self.assertEqual(a.received, [0x11, 0x30], "only the first poll went to the follower")
        self.assertEqual(b.received, [0x30, 0x31])

    def test_a_sharded_group_takes_other_shards_in_while_one_backs_off(self) -> None:
        # Shard 0's broker knows no leader the first time it is asked, so
        # that call backs off (2 s here) before it goes again; shard 1 has
        # a record at once and another for a waiting poll. Neither of shard
        # 1's waits for shard 0's backoff.
        answers = {0: ["no leader", [9]], 1: [[5], [], [6]]}

        def script(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                return stream_answer(header.request_id, 2)
            shard = int.from_bytes(body[SHARD_AT : SHARD_AT + 4], "little")
            queue = answers[shard]
            answer = queue.pop(0) if queue else []
            if answer == "no leader":
                return not_leader(header.request_id, None)
            if shard == 1 and answer == [6]:
                time.sleep(0.2)  # Arrives while the poll waits.
            return group_records(header.request_id, answer)

        fake = self.serve(script, int(F.GROUPS))
        with mock.patch.object(cluster, "BACKOFF_FIRST", 2.0):
            group = self.cluster(fake).sharded_group(STREAM, "g")
            started = time.monotonic()
            got = [(r.shard, r.offset) for r in group.poll(2, wait=5)]
            self.assertEqual(got, [(1, 5)])
            got = [(r.shard, r.offset) for r in group.poll(2, wait=5)]
            self.assertEqual(got, [(1, 6)])
            self.assertLess(time.monotonic() - started, 1.5, "shard 1 waited out shard 0's backoff")
            # Shard 0's poll goes again once its backoff is over.
            got = [(r.shard, r.offset) for r in group.poll(2, wait=5)]
            self.assertEqual(got, [(0, 9)])
            self.assertGreaterEqual(time.monotonic() - started, 2.0)
            group.close()

    def test_a_sharded_group_on_a_closed_cluster_client_raises_disconnected(self) -> None:
        fake = self.serve(lambda h, body, c: stream_answer(h.request_id, 2), int(F.GROUPS))
        cc = self.cluster(fake)
        group = cc.sharded_group(STREAM, "g")
        cc.close()
        with self.assertRaises(felix.Disconnected):
            group.poll(4, wait=1)
        group.close()
        self.assertEqual(fake.received, [0x11], "nothing sent once closed")


    # --- what is tried again, and how long it takes --------------------------

    def test_a_call_that_must_not_run_twice_is_retried_where_nothing_was_applied(self) -> None:
        features = int(F.GROUPS | F.GROUP_ADMIN)
        # Not reached (connection refused): the seek goes to the next broker.
        gone = self.serve(lambda h, body, c: None)
        down = addr(gone)
        gone.close()
        b = self.serve(lambda h, body, c: ok(h.request_id), features)
        cc = self.cluster_of([down, addr(b)])
        cc.group_seek(STREAM, 0, "g", felix.StartPosition.LATEST)
        self.assertEqual(b.received, [0x41])
        self.assertEqual(cc.leader_of(STREAM, 0), addr(b))
        # not_leader naming no leader (an election): the next broker.
        a = self.serve(lambda h, body, c: not_leader(h.request_id, None), features)
        c = self.serve(lambda h, body, c: ok(h.request_id), features)
        cc = self.cluster(a, c)
        cc.group_seek(STREAM, 0, "g", felix.StartPosition.LATEST)
        self.assertEqual((a.received, c.received), ([0x41], [0x41]))
        self.assertEqual(cc.leader_of(STREAM, 0), addr(c))

    def test_a_malformed_leader_address_moves_on_to_the_next_broker(self) -> None:
        features = int(F.GROUPS | F.GROUP_ADMIN)
        a = self.serve(lambda h, body, c: not_leader(h.request_id, "no-port"), features)
        b = self.serve(lambda h, body, c: published(h.request_id, 9) if h.opcode == 0x20 else ok(h.request_id), features)
        cc = self.cluster(a, b)
        self.assertEqual(cc.publish(STREAM, 0, b"x"), 9)
        cc.group_seek(STREAM, 0, "g", felix.StartPosition.LATEST)
        self.assertEqual((a.received, b.received), ([0x20], [0x20, 0x41]))
        # Named by every broker, it is the error the call ends with, saying which address.
        only = self.cluster(a)
        with mock.patch.object(cluster, "ATTEMPTS", 4), self.assertRaises(felix.ConnectionFailed) as caught:
            only.publish(STREAM, 0, b"x")
        self.assertIn("'no-port'", caught.exception.message)

    def test_the_nack_of_a_close_is_not_sent_again_after_a_lost_answer(self) -> None:
        def answer(header, body):  # type: ignore[no-untyped-def]
            if header.opcode == 0x30:
                return group_records(header.request_id, [3, 4])
            return None  # A nack: the connection drops, the answer is lost.

        a = self.serve(stream_or(answer), int(F.GROUPS))
        b = self.serve(stream_or(lambda h, body: ok(h.request_id)), int(F.GROUPS))
        group = self.cluster(a, b).sharded_group(STREAM, "g")
        self.assertEqual([r.offset for r in group.poll(1)], [3])
        self.assertEqual(group.held, 1)
        with self.assertRaises(felix.Disconnected):
            group.close()
        self.assertEqual(a.received, [0x11, 0x30, 0x32], "one nack")
        self.assertEqual(b.received, [], "not tried on another broker")

    def test_closing_the_cluster_client_cuts_a_retry_pause_short(self) -> None:
        fake = self.serve(stream_or(lambda h, body: not_leader(h.request_id, None)), int(F.GROUPS))
        with mock.patch.object(cluster, "BACKOFF_FIRST", 30.0):
            cc = self.cluster(fake)
            group = cc.sharded_group(STREAM, "g")
            records = [felix.ShardedRecord(0, record(1)), felix.ShardedRecord(0, record(2))]
            calls = {
                "publish": lambda: cc.publish(STREAM, 0, b"x"),
                "ack_many": lambda: group.ack_many(records),
                "nack": lambda: group.nack(records[0]),
            }
            outcomes = {}
            threads = []
            for name, call in calls.items():

                def run(name=name, call=call):  # type: ignore[no-untyped-def]
                    try:
                        call()
                    except felix.FelixError as error:
                        outcomes[name] = error

                threads.append(threading.Thread(target=run))
                threads[-1].start()
            # Every call was answered once and is pausing for 30 s.
            self.assertTrue(fake.wait_for_requests(4))
            time.sleep(0.1)
            started = time.monotonic()
            cc.close()
            for thread in threads:
                thread.join(5)
            self.assertLess(time.monotonic() - started, 2.0)
        self.assertFalse(any(t.is_alive() for t in threads))
        self.assertEqual(sorted(fake.received), [0x11, 0x20, 0x31, 0x32], "no second attempt")
        self.assertEqual({n: type(e) for n, e in outcomes.items()}, dict.fromkeys(calls, felix.Disconnected))

    def test_a_close_retries_its_nacks_together(self) -> None:
        # A shard whose brokers answer every nack not_leader naming no
        # leader: each nack is tried its whole budget (shrunk here to 6
        # attempts, 775 ms of pauses), all at once, not one after another.
        def answer(header, body):  # type: ignore[no-untyped-def]
            if header.opcode == 0x30:
                return group_records(header.request_id, [1, 2, 3, 4, 5, 6])
            return not_leader(header.request_id, None)

        fake = self.serve(stream_or(answer), int(F.GROUPS))
        group = self.cluster(fake).sharded_group(STREAM, "g")
        self.assertEqual(len(group.poll(1)), 1)
        self.assertEqual(group.held, 5)
        budget = sum(0.025 * 2**i for i in range(5))
        with mock.patch.object(cluster, "ATTEMPTS", 6):
            started = time.monotonic()
            with self.assertRaises(felix.NotLeader):
                group.close()
            took = time.monotonic() - started
        self.assertEqual(fake.received.count(0x32), 5 * 6, "every nack tried its 6 attempts")
        self.assertGreaterEqual(took, budget)
        self.assertLess(took, 2 * budget + 0.5, f"{took:.2f} s: one after another takes {5 * budget:.2f} s")
        self.assertEqual(group.held, 0)

    def test_ack_many_retries_each_shards_ack_together(self) -> None:
        def script(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                return stream_answer(header.request_id, 4)
            return not_leader(header.request_id, None)

        fake = self.serve(script, int(F.GROUPS))
        group = self.cluster(fake).sharded_group(STREAM, "g")
        records = [felix.ShardedRecord(shard, record(7)) for shard in range(4)]
        budget = sum(0.025 * 2**i for i in range(5))
        with mock.patch.object(cluster, "ATTEMPTS", 6):
            started = time.monotonic()
            with self.assertRaises(felix.NotLeader):
                group.ack_many(records)
            took = time.monotonic() - started
        self.assertEqual(fake.received.count(0x31), 4 * 6)
        self.assertLess(took, 2 * budget + 0.5, f"{took:.2f} s: one after another takes {4 * budget:.2f} s")
        # Capped at 2 threads, they take turns: two calls at a time.
        with mock.patch.object(cluster, "ATTEMPTS", 6), mock.patch.object(sharded, "_MAX_CALL_THREADS", 2):
            started = time.monotonic()
            with self.assertRaises(felix.NotLeader):
                group.ack_many(records)
            took = time.monotonic() - started
        self.assertEqual(fake.received.count(0x31), 2 * 4 * 6)
        self.assertGreaterEqual(took, 2 * budget)


if __name__ == "__main__":
    unittest.main()


class StreamWideSettleTest(unittest.TestCase):
    def test_a_call_done_on_some_shards_is_never_nothing_done(self) -> None:
        from felix import _stream_groups

        def nothing() -> felix.FelixError:
            return felix.Unavailable("stopping", number=7, not_applied=True)

        with self.assertRaises(felix.Unavailable) as only:
            _stream_groups._settle([nothing(), nothing()])
        self.assertTrue(only.exception.not_applied)
        self.assertIn("done on no shard", only.exception.message)
        with self.assertRaises(felix.Unavailable) as part:
            _stream_groups._settle([None, nothing()])
        self.assertFalse(part.exception.not_applied)
        self.assertIn("(shard 1; done on shard(s) 0)", part.exception.message)
