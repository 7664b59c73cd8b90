"""Consumer groups against a real broker (run with FELIX_GROUP_MAX_ATTEMPTS=3)."""

import threading
import time
from typing import List, Optional

import felix

from .support import BrokerTestCase, broker_addr

#: The broker under test gives up on a record after this many deliveries.
MAX_ATTEMPTS = 3


def setUpModule() -> None:
    broker_addr()


class GroupTestCase(BrokerTestCase):
    stream: str
    group = "workers"

    def setUp(self) -> None:
        super().setUp()
        self.stream = self.new_stream(shards=2)

    def publish(self, count: int, shard: int = 0) -> None:
        self.client.publish_batch(self.stream, shard, [f"job-{i}".encode() for i in range(count)])

    def poll(self, max_records: int = 16, client: Optional[felix.Client] = None, **options: object) -> List[felix.GroupRecord]:
        return (client or self.client).group_poll(self.stream, 0, self.group, max_records, **options)  # type: ignore[arg-type]

    def describe(self) -> felix.GroupInfo:
        return self.client.group_describe(self.stream, 0, self.group)


class ClaimTest(GroupTestCase):
    def test_each_record_is_claimed_once_and_acks_finish_it(self) -> None:
        self.publish(5)
        first = self.poll(3)
        second = self.poll(16, client=self.connect())
        self.assertEqual([r.offset for r in first] + [r.offset for r in second], [0, 1, 2, 3, 4])
        self.assertTrue(all(r.attempts == 1 for r in first + second))
        self.assertEqual(first[0].payload, b"job-0")
        self.assertEqual(self.poll(), [])
        self.client.group_ack(self.stream, 0, self.group, first)
        self.client.group_ack(self.stream, 0, self.group, [r.offset for r in second])
        info = self.describe()
        self.assertEqual((info.position, info.in_flight, info.lag), (5, 0, 0))
        self.assertIn(self.group, self.client.list_groups(self.stream, 0))

    def test_skipped_before_is_negotiated_and_present(self) -> None:
        self.assertTrue(self.client.has_feature(felix.Feature.GROUP_SKIPPED))
        self.publish(1)
        (record,) = self.poll()
        self.assertEqual(record.skipped_before, 0)

    def test_a_lapsed_claim_is_redelivered_with_attempts_2(self) -> None:
        self.publish(1)
        (first,) = self.poll(visibility=0.2)
        self.assertEqual(self.poll(), [])
        time.sleep(0.4)
        (again,) = self.poll()
        self.assertEqual((again.offset, again.attempts), (first.offset, 2))

    def test_nack_hands_the_record_back_at_once(self) -> None:
        self.publish(1)
        (record,) = self.poll()
        self.client.group_nack(self.stream, 0, self.group, record)
        (again,) = self.poll()
        self.assertEqual((again.offset, again.attempts), (0, 2))

    def test_nack_after_delays_the_redelivery(self) -> None:
        self.publish(1)
        (record,) = self.poll()
        self.client.group_nack_after(self.stream, 0, self.group, record, 0.5)
        self.assertEqual(self.poll(), [])
        self.assertEqual(self.describe().delayed, 1)
        (again,) = self.poll(wait=3)
        self.assertEqual((again.offset, again.attempts), (0, 2))

    def test_extend_keeps_the_claim_past_its_visibility(self) -> None:
        self.publish(1)
        (record,) = self.poll(visibility=0.3)
        stands = self.client.group_extend(self.stream, 0, self.group, record, 5)
        self.assertGreater(stands, 3)
        self.assertLessEqual(stands, 5.5)
        time.sleep(0.5)
        self.assertEqual(self.poll(), [])

    def test_an_old_delivery_is_a_stale_claim(self) -> None:
        self.publish(1)
        (old,) = self.poll(visibility=0.2)
        time.sleep(0.4)
        (new,) = self.poll()
        self.assertEqual(new.attempts, 2)
        for call in (
            lambda: self.client.group_nack(self.stream, 0, self.group, old),
            lambda: self.client.group_extend(self.stream, 0, self.group, old, 5),
            lambda: self.client.group_dead_letter(self.stream, 0, self.group, old),
        ):
            with self.assertRaises(felix.StaleClaim) as caught:
                call()
            self.assertEqual(caught.exception.code, "stale_claim")
        self.client.group_ack(self.stream, 0, self.group, new)

    def test_a_long_poll_wakes_on_a_publish(self) -> None:
        threading.Timer(0.3, lambda: self.publish(1)).start()
        started = time.monotonic()
        records = self.poll(wait=5)
        self.assertEqual([r.offset for r in records], [0])
        self.assertLess(time.monotonic() - started, 4)


class DeadLetterTest(GroupTestCase):
    def test_the_broker_gives_up_after_max_attempts_then_redrive_and_discard(self) -> None:
        self.publish(2)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            records = self.poll(1)
            self.assertEqual([(r.offset, r.attempts) for r in records], [(0, attempt)])
            self.client.group_nack(self.stream, 0, self.group, records[0], reason="boom")
        self.assertEqual(self.client.group_dead_letters(self.stream, 0, self.group), [0])
        (letter,) = self.client.group_dead_letters_detailed(self.stream, 0, self.group)
        self.assertEqual((letter.offset, letter.attempts, letter.by_consumer), (0, MAX_ATTEMPTS, False))
        self.assertEqual(self.describe().dead_letters, 1)
        # The group moved past it.
        (next_record,) = self.poll(1)
        self.assertEqual(next_record.offset, 1)
        self.client.group_ack(self.stream, 0, self.group, next_record)
        # Redrive: owed again with its attempts reset.
        self.client.group_redrive(self.stream, 0, self.group, 0)
        self.assertEqual(self.client.group_dead_letters(self.stream, 0, self.group), [])
        (redriven,) = self.poll(1)
        self.assertEqual((redriven.offset, redriven.attempts), (0, 1))
        # A consumer gives up itself, with a reason; then discards it.
        self.client.group_dead_letter(self.stream, 0, self.group, redriven, reason="unparseable")
        (letter,) = self.client.group_dead_letters_detailed(self.stream, 0, self.group)
        self.assertEqual((letter.offset, letter.reason, letter.by_consumer), (0, "unparseable", True))
        page = self.client.group_dead_letters_page(self.stream, 0, self.group, 0, 10)
        self.assertEqual(([d.offset for d in page.letters], page.next), ([0], None))
        self.client.group_discard(self.stream, 0, self.group, 0)
        self.assertEqual(self.client.group_dead_letters(self.stream, 0, self.group), [])
        self.assertEqual(self.poll(), [])


class AdminTest(GroupTestCase):
    def test_create_seek_describe_and_delete(self) -> None:
        self.publish(3)
        self.client.group_create(self.stream, 0, self.group, felix.StartPosition.LATEST)
        self.client.group_create(self.stream, 0, self.group, felix.StartPosition.EARLIEST)  # Left alone.
        info = self.describe()
        self.assertEqual((info.group, info.position, info.end_offset, info.lag), (self.group, 3, 3, 0))
        self.publish(2)
        self.assertEqual(self.describe().lag, 2)
        (record,) = self.poll(1)
        self.assertEqual(record.offset, 3)
        info = self.describe()
        self.assertEqual((info.in_flight, info.owed, info.delayed, info.dead_letters), (1, 0, 0, 0))
        self.assertIsNotNone(info.oldest_in_flight_age_ms)
        self.assertIsNotNone(info.last_active_ms)
        self.client.group_seek(self.stream, 0, self.group, 1)
        self.assertEqual(self.describe().position, 1)
        self.assertEqual([r.offset for r in self.poll()], [1, 2, 3, 4])
        self.client.group_delete(self.stream, 0, self.group)
        with self.assertRaises(felix.NotFound):
            self.describe()

    def test_whole_stream_calls_reach_shards_the_group_has_not_polled(self) -> None:
        self.publish(2, shard=0)
        self.publish(3, shard=1)
        # Polled (and finished) on shard 1 only.
        got = self.client.group_poll(self.stream, 1, "part", max_records=10)
        self.client.group_ack(self.stream, 1, "part", got)
        infos = self.client.group_describe_stream(self.stream, "part")
        self.assertEqual([(i.position, i.lag) for i in infos], [(0, 2), (3, 0)])
        self.client.group_seek_stream(self.stream, "part", felix.StartPosition.LATEST)
        self.assertEqual([self.client.group_describe(self.stream, s, "part").position for s in (0, 1)], [2, 3])
        self.client.group_delete(self.stream, 0, "part")
        self.client.group_delete_stream(self.stream, "part")
        self.assertEqual(self.client.list_groups(self.stream, 1), [])
        for call in (
            lambda: self.client.group_delete_stream(self.stream, "part"),
            lambda: self.client.group_seek_stream(self.stream, "part", felix.StartPosition.EARLIEST),
            lambda: self.client.group_describe_stream(self.stream, "part"),
        ):
            with self.assertRaises(felix.NotFound) as caught:
                call()
            self.assertIn("does not exist on any shard", str(caught.exception))
        self.assertEqual(self.client.list_groups(self.stream, 0), [])

    def test_whole_stream_calls_act_on_every_shard(self) -> None:
        self.publish(2, shard=0)
        self.publish(3, shard=1)
        self.client.group_create_stream(self.stream, "all", felix.StartPosition.EARLIEST)
        self.assertEqual([i.lag for i in self.client.group_describe_stream(self.stream, "all")], [2, 3])
        self.client.group_seek_stream(self.stream, "all", felix.StartPosition.LATEST)
        self.assertEqual([i.position for i in self.client.group_describe_stream(self.stream, "all")], [2, 3])
        with self.assertRaises(felix.InvalidArgument):
            self.client.group_seek_stream(self.stream, "all", 0)
        self.client.group_delete_stream(self.stream, "all")
        self.assertEqual(self.client.list_groups(self.stream, 1), [])


class NamedConsumerTest(GroupTestCase):
    def test_a_restarted_member_reclaims_what_it_held(self) -> None:
        self.publish(3)
        before = self.poll(2, consumer="worker-1", reclaim=True)
        self.assertEqual([r.offset for r in before], [0, 1])
        restarted = self.connect()
        # Another member gets only what nobody holds.
        self.assertEqual([r.offset for r in self.poll(client=restarted, consumer="worker-2")], [2])
        reclaimed = self.poll(client=restarted, consumer="worker-1", reclaim=True)
        self.assertEqual([(r.offset, r.attempts) for r in reclaimed], [(0, 2), (1, 2)])
        restarted.group_ack(self.stream, 0, self.group, reclaimed)
