"""ClusterClient against a cluster of three brokers this module starts
(``FELIX_TEST_BROKER``): creating and deleting on every broker, a client
given one broker's address finding the others, replication, following the
leader, and a leader killed with ``kill -9`` under publishes, a group and a
sharded group."""

import threading
import time
import unittest
from typing import Callable, Dict, List, Set, Tuple, Union

import felix
from felix import StartPosition

from .support import Cluster, broker_binary, fresh_stream, in_thread

#: How long a replica, a failover or a restarted broker is given.
DEADLINE = 20.0

Reader = Union[felix.Client, felix.ClusterClient]


def setUpModule() -> None:
    broker_binary()  # Fail loudly, once, when no broker binary was given.


def wait_until(what: str, check: Callable[[], bool], deadline: float = DEADLINE) -> None:
    """Poll ``check`` every 50 ms until it holds; fail saying ``what`` after ``deadline`` s."""
    until = time.monotonic() + deadline
    while not check():
        if time.monotonic() >= until:
            raise AssertionError(f"{what}: not within {deadline:.0f} s")
        time.sleep(0.05)


def read_all(reader: Reader, stream: str, shard: int) -> Dict[int, bytes]:
    """Every record of ``shard`` as ``reader`` has it: offset → payload, in the
    order read (which must be the offsets' order)."""
    out: Dict[int, bytes] = {}
    start: Union[StartPosition, int] = StartPosition.EARLIEST
    while True:
        batch = reader.read(stream, shard, start, max_records=1000)
        for record in batch.records:
            if out and record.offset <= next(reversed(out)):
                raise AssertionError(f"shard {shard}: offset {record.offset} read after {next(reversed(out))}")
            out[record.offset] = record.payload
        if not batch.records or batch.next_offset >= batch.end_offset:
            return out
        start = batch.next_offset


class ClusterTestCase(unittest.TestCase):
    """Tests sharing one cluster of three brokers, started once for the class."""

    cluster: Cluster

    @classmethod
    def setUpClass(cls) -> None:
        cls.cluster = Cluster()
        cls.addClassCleanup(cls.cluster.stop)

    def setUp(self) -> None:
        self.cc = self.connect()

    def connect(self, addrs: Union[None, List[str]] = None) -> felix.ClusterClient:
        """A cluster client (every broker, in order, unless ``addrs``), closed after the test."""
        cc = felix.ClusterClient.connect(addrs or self.cluster.addrs, request_timeout=10.0)
        self.addCleanup(cc.close)
        return cc

    def broker(self, addr: str) -> felix.Client:
        """A plain client of the broker at ``addr``, closed after the test."""
        client = felix.Client.connect(addr, request_timeout=10.0)
        self.addCleanup(client.close)
        return client

    def new_stream(self, shards: int) -> str:
        """A fresh stream, created on every broker."""
        path = fresh_stream(self._testMethodName[5:35])
        self.cc.create_stream(path, shards)
        return path

    def leader(self, stream: str, shard: int) -> str:
        """The broker that leads ``shard``, once one says it does and every
        running broker names it (so a follower's ``not_leader`` names it
        too); remembered by ``self.cc``."""
        found: List[str] = []

        def elected() -> bool:
            views = self.cc.describe_replicas(stream, shard)
            running = [(b, v) for b, v in views if self.cluster.running(self.cluster.node_of(b))]
            if not all(isinstance(v, felix.ReplicaInfo) for _, v in running):
                return False
            found[:] = [b for b, v in running if isinstance(v, felix.ReplicaInfo) and v.role == "leader"]
            return len(found) == 1 and all(
                isinstance(v, felix.ReplicaInfo) and v.leader_addr == found[0] for _, v in running
            )

        wait_until(f"{stream} shard {shard} elects a leader every running broker names", elected)
        self.assertEqual(self.cc.leader_of(stream, shard), found[0])
        return found[0]

    def kill_leader(self, stream: str, shard: int) -> Tuple[str, int]:
        """``kill -9`` the leader of ``shard``; it is restarted after the test
        if the test did not. Returns its address and node."""
        addr = self.leader(stream, shard)
        node = self.cluster.node_of(addr)
        self.cluster.kill9(node)
        self.addCleanup(self.revive, node)
        return addr, node

    def revive(self, node: int) -> None:
        """Restart ``node`` if it is down, so the class's cluster stays whole."""
        if not self.cluster.running(node):
            self.cluster.restart(node)

    def assert_catches_up(self, back: str, leader: str, stream: str, shards: int) -> None:
        """The broker at ``back`` comes to hold every record ``leader`` holds."""
        b, lead = self.broker(back), self.broker(leader)
        for shard in range(shards):
            want = read_all(lead, stream, shard)

            def caught_up() -> bool:
                try:
                    return read_all(b, stream, shard) == want
                except (felix.Unavailable, felix.NotFound, felix.Disconnected, felix.ConnectionFailed):
                    return False  # Still starting its replicas.

            wait_until(f"{back} catches up on shard {shard} ({len(want)} records)", caught_up)


class StreamsTest(ClusterTestCase):
    def test_a_create_gives_every_broker_one_incarnation(self) -> None:
        path = fresh_stream("create")
        info = self.cc.create_stream(path, 2, retention_ms=3_600_000)
        self.assertEqual((str(info.stream), info.shards, info.retention_ms), (path, 2, 3_600_000))
        self.assertIsNotNone(info.incarnation)
        views = [self.broker(a).describe_stream(path) for a in self.cluster.addrs]
        self.assertEqual({(v.shards, v.incarnation) for v in views}, {(2, info.incarnation)})
        # Run again (a create cut short, run once more): every broker holds it
        # as the same stream, so nothing happens and nothing is refused.
        self.assertEqual(self.cc.create_stream(path, 2).incarnation, info.incarnation)
        # Another shard count is another stream: refused, nothing changed.
        with self.assertRaises(felix.AlreadyExists) as caught:
            self.cc.create_stream(path, 3)
        self.assertIn("with 2 shards, not 3", caught.exception.message)
        self.assertEqual({self.broker(a).describe_stream(path).shards for a in self.cluster.addrs}, {2})

    def test_a_stream_only_one_broker_holds_is_not_spread(self) -> None:
        # Created on one broker alone, without an incarnation: a copy held by
        # a minority may be one the others deleted, so a create refuses.
        path = fresh_stream("minority")
        lone = self.broker(self.cluster.addrs[2])
        self.assertIsNone(lone.create_stream(path, 1).incarnation)
        with self.assertRaises(felix.AlreadyExists) as caught:
            self.cc.create_stream(path, 1)
        self.assertIn(f"held by only 1 of the 3 brokers ({self.cluster.addrs[2]})", caught.exception.message)
        for addr in self.cluster.addrs[:2]:
            with self.assertRaises(felix.NotFound):
                self.broker(addr).describe_stream(path)
        # Deleted there, it is created everywhere as one stream.
        lone.delete_stream(path)
        info = self.cc.create_stream(path, 1)
        self.assertEqual({self.broker(a).describe_stream(path).incarnation for a in self.cluster.addrs}, {info.incarnation})
        # A plain client given an incarnation creates with it (the broker keeps them).
        other = fresh_stream("given")
        self.assertTrue(lone.has_feature(felix.Feature.STREAM_INCARNATION))
        self.assertEqual(lone.create_stream(other, 1, incarnation=12345).incarnation, 12345)

    def test_a_create_passes_over_a_broker_that_is_down(self) -> None:
        # Node 3 is down: the stream is made on the other two as one
        # incarnation, and the create says it was not made on node 3.
        path = fresh_stream("one-down")
        down = self.cluster.addrs[2]
        node = self.cluster.node_of(down)
        self.cluster.kill9(node)
        self.addCleanup(self.revive, node)
        with self.assertRaises(felix.Unavailable) as caught:
            self.cc.create_stream(path, 2)
        message = caught.exception.message
        self.assertIn(f"{path} was created on the other brokers, not on {down} (", message)
        self.assertIn(f"cannot connect to {down}: ", message)
        self.assertTrue(message.endswith("run the same create again once it is back"), message)
        held = {self.broker(a).describe_stream(path).incarnation for a in self.cluster.addrs[:2]}
        self.assertEqual(len(held), 1, "one incarnation on the two brokers up")
        incarnation = held.pop()
        self.assertIsNotNone(incarnation)
        # Back, the same create gives it the others' incarnation.
        self.cluster.restart(node)
        info = self.cc.create_stream(path, 2)
        self.assertEqual(info.incarnation, incarnation)
        self.assertEqual(self.broker(down).describe_stream(path).incarnation, incarnation)
        self.assertEqual({self.broker(a).describe_stream(path).shards for a in self.cluster.addrs}, {2})

    def test_delete_deletes_everywhere(self) -> None:
        path = self.new_stream(2)
        first = self.cc.describe_stream(path).incarnation
        self.cc.publish(path, 1, b"x")
        self.cc.delete_stream(path)
        for addr in self.cluster.addrs:
            with self.subTest(broker=addr), self.assertRaises(felix.NotFound):
                self.broker(addr).describe_stream(path)
        with self.assertRaises(felix.NotFound):
            self.cc.describe_stream(path)
        self.cc.delete_stream(path)  # Gone everywhere already: fine.
        self.assertIsNone(self.cc.leader_of(path, 1), "what was known of its leaders is forgotten")
        # Created again, it is a new incarnation, empty.
        again = self.cc.create_stream(path, 2)
        self.assertNotEqual(again.incarnation, first)
        self.assertEqual(read_all(self.cc, path, 1), {})


class OneAddressTest(ClusterTestCase):
    def test_a_cluster_client_given_one_broker_finds_the_others(self) -> None:
        # A broker names every broker of its cluster, with its client address.
        seed = self.cluster.addrs[1]
        info = self.broker(seed).describe_cluster()
        self.assertEqual(info.node, 2, "the answering broker's own id")
        self.assertEqual(
            [(m.node, m.addr) for m in info.members], [(n + 1, a) for n, a in enumerate(self.cluster.addrs)]
        )
        # So one address is enough: the client learns the others, and creates
        # the stream on all three as one incarnation.
        cc = self.connect([seed])
        self.assertEqual(cc.members, tuple(self.cluster.addrs))
        self.assertEqual(cc.brokers[0], seed, "the broker given comes first")
        self.assertEqual(sorted(cc.brokers), sorted(self.cluster.addrs))
        path = fresh_stream("one-address")
        made = cc.create_stream(path, 2)
        self.assertIsNotNone(made.incarnation)
        self.assertEqual(
            [self.broker(a).describe_stream(path).incarnation for a in self.cluster.addrs], [made.incarnation] * 3
        )
        acked: Dict[Tuple[int, int], bytes] = {}

        def publish(rounds: range) -> None:
            for n in rounds:
                for shard in range(2):
                    payload = f"s{shard}-{n}".encode()
                    acked[(shard, cc.publish(path, shard, payload))] = payload

        publish(range(4))
        # The broker it was given dies: the others carry on, and every
        # acknowledged record is on each shard's leader.
        node = self.cluster.node_of(seed)
        self.cluster.kill9(node)
        self.addCleanup(self.revive, node)
        publish(range(4, 8))
        for shard in range(2):
            leader = cc.leader_of(path, shard)
            self.assertIsNotNone(leader, f"shard {shard}")
            self.assertNotEqual(leader, seed, f"shard {shard}")
            assert leader is not None
            got = read_all(self.broker(leader), path, shard)
            for (s, offset), payload in acked.items():
                if s == shard:
                    self.assertEqual(got.get(offset), payload, f"shard {shard} offset {offset}")
        self.cluster.restart(node)


class PublishTest(ClusterTestCase):
    def test_published_batches_reach_every_replica_in_order(self) -> None:
        path = self.new_stream(3)
        acked: Dict[int, Dict[int, bytes]] = {shard: {} for shard in range(3)}
        for n in range(6):
            for shard in range(3):
                payloads = [f"s{shard}-b{n}-r{k}".encode() for k in range(4)]
                published = self.cc.publish_batch(path, shard, payloads)
                self.assertEqual((published.shard, published.count), (shard, 4))
                for k, payload in enumerate(payloads):
                    acked[shard][published.base_offset + k] = payload
        keyed = self.cc.publish_keyed(path, "user-42", b"keyed")
        self.assertEqual(keyed.shard, felix.shard_for_key(b"user-42", 3))
        acked[keyed.shard][keyed.base_offset] = b"keyed"
        for shard in range(3):
            offsets = list(acked[shard])
            self.assertEqual(offsets, sorted(offsets), "a shard's batches take ascending offsets")
        for addr in self.cluster.addrs:
            client = self.broker(addr)
            for shard in range(3):
                wait_until(
                    f"{addr} holds shard {shard} as acknowledged",
                    lambda: read_all(client, path, shard) == acked[shard],
                )

    def test_a_not_leader_answer_is_followed(self) -> None:
        path = self.new_stream(1)
        self.cc.publish(path, 0, b"first")
        leader = self.leader(path, 0)
        follower = next(a for a in self.cluster.addrs if a != leader)
        # A follower refuses, naming the leader.
        with self.assertRaises(felix.NotLeader) as caught:
            self.broker(follower).publish(path, 0, b"to a follower")
        self.assertEqual(caught.exception.leader, leader)
        # A cluster client that starts at the follower follows it there.
        first = [follower] + [a for a in self.cluster.addrs if a != follower]
        cc = self.connect(first)
        self.assertIsNone(cc.leader_of(path, 0))
        at = cc.publish(path, 0, b"followed")
        self.assertEqual(cc.leader_of(path, 0), leader)
        self.assertEqual(read_all(self.broker(leader), path, 0)[at], b"followed")
        # A group call that must not run twice follows it too (nothing was applied).
        self.cc.group_create(path, 0, "g")
        seeker = self.connect(first)
        seeker.group_seek(path, 0, "g", StartPosition.LATEST)
        self.assertEqual(seeker.leader_of(path, 0), leader)
        self.assertEqual(self.cc.group_describe(path, 0, "g").position, at + 1)
        # A read is served by any replica: the one that answers is not taken for the leader.
        reader = self.connect(first)
        self.assertIn(b"followed", [r.payload for r in reader.read(path, 0, 0).records])
        self.assertIsNone(reader.leader_of(path, 0))

    def test_publishing_goes_on_through_the_loss_of_the_leader(self) -> None:
        path = self.new_stream(2)
        self.cc.publish(path, 0, b"warm-up")
        acked: Dict[Tuple[int, int], bytes] = {}
        sent: Set[bytes] = {b"warm-up"}
        lock = threading.Lock()
        stop = threading.Event()

        def publish() -> int:
            n = 0
            while not stop.is_set():
                shard = n % 2
                payloads = [f"s{shard}-b{n}-r{k}".encode() for k in range(3)]
                with lock:
                    sent.update(payloads)
                published = self.cc.publish_batch(path, shard, payloads)
                with lock:
                    for k, payload in enumerate(payloads):
                        acked[(shard, published.base_offset + k)] = payload
                n += 1
            return n

        def count() -> int:
            with lock:
                return len(acked)

        thread, outcome = in_thread(self, publish)
        self.addCleanup(stop.set)  # Runs before in_thread's join.

        def published(at_least: int) -> Callable[[], bool]:
            def check() -> bool:
                if "error" in outcome:  # The publisher failed: say why, now.
                    raise AssertionError(f"a publish failed: {outcome['error']!r}")
                return count() >= at_least

            return check

        wait_until("publishing starts", published(60))
        dead, node = self.kill_leader(path, 0)
        at_kill = count()
        wait_until("publishing goes on after the leader was killed", published(at_kill + 150))
        stop.set()
        thread.join(30)
        self.assertFalse(thread.is_alive(), "the publisher did not stop")
        # The publisher is done: `acked` and `sent` are only read from here on.
        self.assertNotIn("error", outcome, f"a publish failed: {outcome.get('error')!r}")
        new = self.cc.leader_of(path, 0)
        self.assertIsNotNone(new)
        self.assertNotEqual(new, dead, "another broker leads now")
        assert new is not None
        # Every acknowledged record at its offset on the new leader; anything
        # else there is a record sent again after a lost answer.
        survivor = self.broker(new)
        for shard in range(2):
            got = read_all(survivor, path, shard)
            for (s, offset), payload in acked.items():
                if s == shard:
                    self.assertEqual(got.get(offset), payload, f"shard {shard} offset {offset} was acknowledged")
            self.assertTrue(set(got.values()) <= sent, "nothing but what was sent")
        # The killed broker comes back and catches up.
        self.cluster.restart(node)
        self.assert_catches_up(dead, new, path, 2)


class GroupsTest(ClusterTestCase):
    def test_a_group_delivers_everything_across_a_failover(self) -> None:
        path = self.new_stream(1)
        group = "workers"
        self.cc.group_create(path, 0, group, StartPosition.EARLIEST)
        payloads = [f"job-{n:02}".encode() for n in range(40)]
        published = self.cc.publish_batch(path, 0, payloads)
        delivered: Dict[bytes, int] = {}
        acked: Set[bytes] = set()

        def poll_and_ack(max_records: int, ack: bool = True) -> List[felix.GroupRecord]:
            # A 2 s visibility: a claim whose answer was lost (the leader
            # died) or that the new leader handed out is owed again soon.
            got = self.cc.group_poll(path, 0, group, max_records, wait=0.5, visibility=2)
            for record in got:
                delivered[record.payload] = delivered.get(record.payload, 0) + 1
            if ack and got:
                self.cc.group_ack(path, 0, group, got)
                acked.update(r.payload for r in got)
            return got

        deadline = time.monotonic() + DEADLINE
        while len(acked) < 10:
            self.assertLess(time.monotonic(), deadline, f"{len(acked)} of the first 10 finished")
            poll_and_ack(10 - len(acked))
        # Five more claimed and left so: the new leader owes them again.
        held: List[felix.GroupRecord] = []
        while len(held) < 5:
            self.assertLess(time.monotonic(), deadline, f"{len(held)} of 5 claimed")
            held += poll_and_ack(5 - len(held), ack=False)
        dead, node = self.kill_leader(path, 0)
        deadline = time.monotonic() + DEADLINE
        while acked != set(payloads):
            self.assertLess(time.monotonic(), deadline, f"{len(acked)} of {len(payloads)} finished")
            poll_and_ack(10)
        self.assertNotEqual(self.cc.leader_of(path, 0), dead)
        self.assertTrue(set(delivered) == set(payloads), "every record delivered, nothing else")
        self.assertTrue(all(delivered[r.payload] >= 2 for r in held), "the claims left were owed again")
        # Drained: a last poll settles the new leader's generation start.
        self.assertEqual(self.cc.group_poll(path, 0, group, 10), [])
        info = self.cc.group_describe(path, 0, group)
        self.assertGreater(info.position, published.last_offset)
        self.assertEqual((info.lag, info.in_flight, info.owed, info.end_offset), (0, 0, 0, info.position))
        self.assertEqual(self.cc.group_describe_stream(path, group), [info])
        self.cluster.restart(node)

    def test_a_sharded_group_consumes_every_shard_across_a_failover(self) -> None:
        path = self.new_stream(3)
        acked: Dict[Tuple[int, int], bytes] = {}

        def publish(rounds: range) -> None:
            for n in rounds:
                for shard in range(3):
                    payloads = [f"s{shard}-b{n}-r{k}".encode() for k in range(5)]
                    p = self.cc.publish_batch(path, shard, payloads)
                    acked.update(((shard, p.base_offset + k), v) for k, v in enumerate(payloads))

        publish(range(4))
        self.cc.group_create_stream(path, "sharded")
        seen: Dict[Tuple[int, int], bytes] = {}
        # A 2 s visibility, as in the test above.
        group = self.cc.sharded_group(path, "sharded", wait_slice=0.2, visibility=2)
        self.addCleanup(group.close)
        self.assertEqual(group.shards, 3)

        def consume(upto: int) -> None:
            deadline = time.monotonic() + DEADLINE * 2
            while len(seen) < upto:
                self.assertLess(time.monotonic(), deadline, f"stuck at {len(seen)} of {upto}")
                batch = group.poll(7, wait=0.5)
                seen.update(((r.shard, r.offset), r.payload) for r in batch)
                try:
                    group.ack_many(batch)
                except felix.StaleClaim:
                    pass  # Handed out by a leader lost since: owed again.

        consume(len(acked) // 2)
        self.assertEqual({r for r, _ in seen}, {0, 1, 2}, "every shard served")
        dead, node = self.kill_leader(path, 0)
        publish(range(4, 6))  # More work lands on the new leaders meanwhile.
        consume(len(acked))
        for at, payload in acked.items():
            self.assertEqual(seen.get(at), payload, f"{at} was never delivered")
        self.assertTrue(set(seen) <= set(acked), "nothing but what was published")

        def drained() -> bool:
            try:
                group.ack_many(group.poll(100, wait=0.2))
            except felix.StaleClaim:
                pass
            return group.lag() == 0

        wait_until("the group drains", drained)
        group.close()
        self.assertTrue(all(info.in_flight == 0 for info in self.cc.group_describe_stream(path, "sharded")))
        self.cluster.restart(node)


if __name__ == "__main__":
    unittest.main()
