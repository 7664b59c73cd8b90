"""Streams, publishing, reading and typed errors against a real broker."""

import gc
import os
import threading
import time
import unittest
from datetime import timedelta

import felix

from .support import BrokerTestCase, broker_addr, fresh_stream


def setUpModule() -> None:
    broker_addr()  # Fail loudly, once, when no broker was given.


class StreamAdminTest(BrokerTestCase):
    def test_create_describe_list_and_delete(self) -> None:
        path = fresh_stream("admin")
        info = self.client.create_stream(path, 3, retention_bytes=1 << 30, retention_ms=3_600_000)
        self.assertEqual((str(info.stream), info.shards), (path, 3))
        self.assertEqual((info.retention_bytes, info.retention_ms), (1 << 30, 3_600_000))
        self.assertEqual(len(info.placement), 3)
        self.assertEqual(self.client.describe_stream(path), info)
        self.assertIn(path, [str(s.stream) for s in self.client.list_streams("pytest")])
        shard = self.client.describe_shard(path, 2)
        self.assertEqual((shard.shard, shard.core, shard.start_offset, shard.end_offset), (2, info.placement[2], 0, 0))
        # A single broker is in no cluster: it has no replica to describe,
        # and the client does not ask.
        self.assertFalse(self.client.features & felix.Feature.REPLICA_INFO)
        with self.assertRaises(felix.Unsupported):
            self.client.describe_replica(path, 0)
        self.client.delete_stream(path)
        with self.assertRaises(felix.NotFound):
            self.client.describe_stream(path)

    def test_a_single_broker_names_no_cluster_and_is_not_asked(self) -> None:
        # Not in a cluster: the broker does not advertise CLUSTER_INFO, and
        # describe_cluster is refused here (no wire number) without sending.
        self.assertFalse(self.client.has_feature(felix.Feature.CLUSTER_INFO))
        with self.assertRaises(felix.Unsupported) as caught:
            self.client.describe_cluster()
        self.assertIn("FEATURE_CLUSTER_INFO", caught.exception.message)
        self.assertFalse(caught.exception.from_broker)
        self.client.ping()  # The connection is as it was.
        # A cluster client given it keeps to the broker given.
        with felix.ClusterClient.connect(broker_addr(), request_timeout=10.0) as cc:
            self.assertEqual((cc.brokers, cc.members), ((broker_addr(),), (broker_addr(),)))

    def test_typed_errors_from_the_broker(self) -> None:
        path = self.new_stream(shards=2)
        cases = [
            (felix.NotFound, "not_found", lambda: self.client.describe_stream(fresh_stream("missing"))),
            (felix.NotFound, "not_found", lambda: self.client.publish(fresh_stream("missing"), 0, b"x")),
            (felix.NotFound, "not_found", lambda: self.client.read(path, 9, 0)),
            (felix.AlreadyExists, "already_exists", lambda: self.client.create_stream(path, 2)),
            (felix.InvalidRequest, "invalid_request", lambda: self.client.read(path, 0, 5)),
            (felix.TooLarge, "too_large", lambda: self.client.publish(path, 0, b"x" * (self.client.max_frame_bytes - 512))),
        ]
        for cls, code, call in cases:
            with self.subTest(code=code), self.assertRaises(cls) as caught:
                call()
            self.assertEqual(caught.exception.code, code)
            self.assertTrue(caught.exception.from_broker)
        self.assertEqual(self.client.describe_shard(path, 0).end_offset, 0)

    def test_a_publish_refused_by_its_own_lookup_was_not_applied(self) -> None:
        # On more than one core the client looks the stream up to find the
        # shard's core; that lookup's not_found is the publish's, unsent.
        self.assertGreater(self.client.cores, 1)
        with self.assertRaises(felix.NotFound) as caught:
            self.client.publish(fresh_stream("missing"), 0, b"x")
        self.assertTrue(caught.exception.not_applied)
        with self.assertRaises(felix.NotFound) as caught:
            self.client.publish_keyed(fresh_stream("missing"), b"k", b"x")
        self.assertTrue(caught.exception.not_applied)

    def test_arguments_are_checked_before_sending(self) -> None:
        path = self.new_stream()
        cases = [
            lambda: self.client.create_stream("pytest/default/bad name", 1),
            lambda: self.client.create_stream("pytest/default", 1),
            lambda: self.client.create_stream(fresh_stream(), 0),
            lambda: self.client.read(path, 0, -1),
            lambda: self.client.read(path, -1, 0),
            lambda: self.client.read(path, 0, 0, max_records=0),
            lambda: self.client.publish_batch(path, 0, []),
            lambda: self.client.publish(path, 0, 42),  # type: ignore[arg-type]
            lambda: self.client.group_poll(path, 0, "bad group"),
            lambda: self.client.group_poll(path, 0, "g", consumer=""),
            lambda: self.client.group_poll(path, 0, "g", reclaim=True),
            lambda: self.client.read(path, 0, 0, wait=-1),
            lambda: self.client.read(path, 0, 0, wait=float("inf")),
            lambda: self.client.read(path, 0, 0, wait=float("nan")),
            lambda: self.client.read(path, 0, 0, wait="1"),  # type: ignore[arg-type]
            lambda: self.client.group_poll(path, 0, "g", visibility=float("-inf")),
            lambda: self.client.publish(path, 0, "\ud800"),
            lambda: self.client.publish(path, 0, b"x", headers=[("\udc00", b"v")]),
            lambda: self.client.publish(path, 0, b"x", timestamp_ms=-1),
            lambda: self.client.publish_batch(path, 0, [felix.RecordIn(b"x", timestamp_ms=-5)]),
            lambda: self.client.group_poll(path, 0, "g", consumer="\ud800"),
            lambda: self.client.describe_stream("pytest/default/\ud800"),
            lambda: self.client.group_ack(path, 0, "g", 1.5),  # type: ignore[arg-type]
            lambda: self.client.group_ack(path, 0, "g", "1"),  # type: ignore[arg-type]
            lambda: self.client.group_ack(path, 0, "g", [1, 2.5]),  # type: ignore[list-item]
        ]
        for i, call in enumerate(cases):
            with self.subTest(case=i), self.assertRaises(felix.InvalidArgument):
                call()

    def test_huge_durations_saturate_instead_of_failing(self) -> None:
        path = self.new_stream()
        self.client.publish(path, 0, b"x")
        # u32 wait_ms saturates; the record is there, so no wait happens.
        self.assertEqual(len(self.client.read(path, 0, 0, wait=1e30).records), 1)
        self.assertEqual(len(self.client.read(path, 0, 0, wait=10**400).records), 1)
        self.assertEqual(len(self.client.read(path, 0, 0, wait=timedelta(days=999_999_999)).records), 1)

    def test_a_batch_over_the_frame_cap_is_refused_locally(self) -> None:
        path = self.new_stream()
        # As in the Rust client: invalid_argument, before anything is encoded.
        with self.assertRaises(felix.InvalidArgument) as caught:
            self.client.publish(path, 0, b"x" * (self.client.max_frame_bytes + 1))
        self.assertFalse(caught.exception.from_broker)
        half = b"x" * (self.client.max_frame_bytes // 2 + 1)
        with self.assertRaises(felix.InvalidArgument):
            self.client.publish_batch(path, 0, [half, half])
        self.assertEqual(self.client.describe_shard(path, 0).end_offset, 0)


class PublishReadTest(BrokerTestCase):
    def test_round_trip_on_every_shard_in_offset_order(self) -> None:
        path = self.new_stream(shards=4)
        placement = self.client.describe_stream(path).placement
        self.assertEqual(set(placement), set(range(self.client.cores)), "shards should span every core")
        for shard in range(4):
            offsets = [self.client.publish(path, shard, f"{shard}-{i}", key=b"k", headers=[("h", b"v")]) for i in range(5)]
            self.assertEqual(offsets, list(range(5)))
        for shard in range(4):
            batch = self.client.read(path, shard, felix.StartPosition.EARLIEST, max_records=100)
            self.assertEqual([r.offset for r in batch.records], list(range(5)))
            self.assertEqual([r.payload for r in batch.records], [f"{shard}-{i}".encode() for i in range(5)])
            self.assertEqual((batch.records[0].key, batch.records[0].headers), (b"k", (("h", b"v"),)))
            self.assertEqual((batch.next_offset, batch.end_offset), (5, 5))
            self.assertEqual([r.offset for r in self.client.read(path, shard, 3).records], [3, 4])
        self.assertEqual(self.client.connected_cores, list(range(self.client.cores)), "one connection per core")

    def test_batch_publish_gets_consecutive_offsets(self) -> None:
        path = self.new_stream(shards=2)
        self.client.publish(path, 1, b"first")
        published = self.client.publish_batch(
            path, 1, [b"a", "b", felix.RecordIn.of(b"c", key="kc", timestamp_ms=1234)]
        )
        self.assertEqual((published.shard, published.base_offset, published.count, published.last_offset), (1, 1, 3, 3))
        records = self.client.read(path, 1, 1).records
        self.assertEqual([r.payload for r in records], [b"a", b"b", b"c"])
        self.assertEqual((records[2].key, records[2].timestamp_ms), (b"kc", 1234))

    def test_keyed_publishes_land_where_the_routing_function_says(self) -> None:
        path = self.new_stream(shards=5)
        for i in range(40):
            key = f"user-{i}".encode()
            published = self.client.publish_keyed(path, key, b"payload")
            self.assertEqual(published.shard, felix.shard_for_key(key, 5), key)
            self.assertEqual(self.client.publish_keyed(path, key, b"again").shard, published.shard)
        batch = self.client.publish_keyed_batch(path, "user-7", [b"x", b"y"])
        self.assertEqual((batch.shard, batch.count), (felix.shard_for_key(b"user-7", 5), 2))
        stored = self.client.read(path, batch.shard, batch.base_offset).records
        self.assertEqual([r.key for r in stored], [b"user-7", b"user-7"])

    def test_ack_on_commit_publishes(self) -> None:
        path = self.new_stream()
        committed = self.connect(ack_on_commit=True)
        self.assertEqual(committed.publish(path, 0, b"durable"), 0)

    def test_a_long_poll_at_the_tail_wakes_on_a_publish_from_another_thread(self) -> None:
        path = self.new_stream()
        self.client.publish(path, 0, b"old")
        timer = threading.Timer(0.3, lambda: self.client.publish(path, 0, b"new"))
        timer.start()
        started = time.monotonic()
        batch = self.client.read(path, 0, felix.StartPosition.LATEST, wait=10)
        timer.join()
        self.assertLess(time.monotonic() - started, 5)
        self.assertEqual([(r.offset, r.payload) for r in batch.records], [(1, b"new")])

    def test_a_long_poll_does_not_block_other_calls_on_the_same_connection(self) -> None:
        path = self.new_stream(shards=1)
        results = {}
        poller = threading.Thread(target=lambda: results.update(read=self.client.read(path, 0, 0, wait=3)))
        poller.start()
        time.sleep(0.2)  # The read is now waiting on the broker.
        started = time.monotonic()
        self.client.describe_shard(path, 0)
        self.client.ping()
        self.assertLess(time.monotonic() - started, 1.0, "calls queued behind the long poll")
        self.client.publish(path, 0, b"wake")
        poller.join(5)
        self.assertEqual([r.payload for r in results["read"].records], [b"wake"])

    def test_subscribe_follows_the_shard(self) -> None:
        path = self.new_stream()
        self.client.publish_batch(path, 0, [b"0", b"1"])
        subscription = self.client.subscribe(path, 0, felix.StartPosition.EARLIEST, wait=5)
        threading.Timer(0.2, lambda: self.client.publish(path, 0, b"2")).start()
        self.assertEqual([next(subscription).payload for _ in range(3)], [b"0", b"1", b"2"])
        self.assertEqual(subscription.position, felix.StartPosition.at(3))

    def test_many_threads_share_one_client(self) -> None:
        path = self.new_stream(shards=2)
        errors = []

        def publish_some(shard: int) -> None:
            try:
                for i in range(50):
                    self.client.publish(path, shard, f"{i}")
            except felix.FelixError as e:
                errors.append(e)

        threads = [threading.Thread(target=publish_some, args=(t % 2,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        self.assertEqual(errors, [])
        self.assertEqual([self.client.describe_shard(path, s).end_offset for s in (0, 1)], [200, 200])

    def test_a_closed_client_refuses_calls(self) -> None:
        client = self.connect()
        client.close()
        self.assertTrue(client.closed)
        self.assertIn("closed", repr(client))
        with self.assertRaises(felix.Disconnected):
            client.ping()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _felix_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("felix-reader"))


@unittest.skipUnless(os.path.isdir("/proc/self/fd"), "needs /proc/self/fd to count sockets")
class CleanupTest(BrokerTestCase):
    def settled(self, threads: int, fds: int) -> bool:
        """Wait (a bounded while) for reader threads and sockets to go back to these counts."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if _felix_threads() <= threads and _fds() <= fds:
                return True
            gc.collect()
            time.sleep(0.01)
        return False

    def test_close_ends_reader_threads_and_closes_sockets(self) -> None:
        path = self.new_stream(shards=self.client.cores)
        threads, fds = _felix_threads(), _fds()
        client = felix.Client.connect(broker_addr())
        for shard in range(self.client.cores):
            client.publish(path, shard, b"x")
        self.assertEqual(client.connected_cores, list(range(self.client.cores)))
        self.assertEqual(_felix_threads(), threads + self.client.cores)
        client.close()
        # close() waits for the reader threads: no polling needed.
        self.assertEqual((_felix_threads(), _fds()), (threads, fds))
        self.assertEqual(client.connected_cores, [])

    def test_a_client_dropped_without_close_is_cleaned_up(self) -> None:
        threads, fds = _felix_threads(), _fds()
        client = felix.Client.connect(broker_addr())
        client.ping()
        self.assertEqual(_felix_threads(), threads + 1)
        del client
        self.assertTrue(self.settled(threads, fds), "a dropped client kept its sockets or threads")
