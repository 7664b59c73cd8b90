"""ShardedGroup: one consumer of a group on every shard of a stream, against a
real broker (run with FELIX_GROUP_MAX_ATTEMPTS=3)."""

import threading
import time
from typing import Callable, Dict, List, Set, Tuple

import felix
from felix import ShardedGroup, ShardedRecord

from .support import BrokerTestCase, broker_addr, in_thread

GROUP = "workers"


def setUpModule() -> None:
    broker_addr()


def keys(records: List[ShardedRecord]) -> List[Tuple[int, int]]:
    return [(r.shard, r.offset) for r in records]


def eventually(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class ShardedTestCase(BrokerTestCase):
    def publish_to(self, stream: str, shard: int, count: int) -> None:
        self.client.publish_batch(stream, shard, [f"s{shard}-{i}".encode() for i in range(count)])

    def group(
        self, stream: str, client: "felix.Client" = None, **options: object  # type: ignore[assignment]
    ) -> ShardedGroup:
        g = (client or self.client).sharded_group(stream, GROUP, **options)  # type: ignore[arg-type]
        self.addCleanup(g.close)
        return g

    def parked(self, g: ShardedGroup, count: int) -> None:
        """Wait until ``g`` has ``count`` waiting polls out, and give the broker
        a moment to park them."""
        eventually(f"{count} polls out", lambda: len(g._out) == count)
        time.sleep(0.1)

    def in_flight(self, stream: str, shard: int) -> int:
        return self.client.group_describe(stream, shard, GROUP).in_flight

    def finish(self, thread: threading.Thread, outcome: Dict[str, object]) -> List[ShardedRecord]:
        thread.join(15)
        self.assertFalse(thread.is_alive())
        self.assertNotIn("error", outcome)
        return outcome["result"]  # type: ignore[return-value]


class DeliveryTest(ShardedTestCase):
    def test_every_record_of_every_shard_is_handed_out_once(self) -> None:
        stream = self.new_stream(shards=3)
        for shard in range(3):
            self.publish_to(stream, shard, 60)
        sizes: List[int] = []

        def consume(client: felix.Client) -> List[Tuple[int, int]]:
            got: List[Tuple[int, int]] = []
            with client.sharded_group(stream, GROUP, wait_slice=0.2) as g:
                while True:
                    batch = g.poll(16, wait=0.3)
                    if not batch:
                        return got
                    sizes.append(len(batch))
                    g.ack_many(batch)
                    got.extend(keys(batch))

        # Two consumers, each on its own connections, drain the stream at once.
        ta, a = in_thread(self, lambda: consume(self.connect()))
        tb, b = in_thread(self, lambda: consume(self.connect()))
        ta.join(15)
        tb.join(15)
        self.assertNotIn("error", a)
        self.assertNotIn("error", b)
        seen: Set[Tuple[int, int]] = set()
        for k in a["result"] + b["result"]:  # type: ignore[operator]
            self.assertNotIn(k, seen, f"{k} was handed out twice")
            seen.add(k)
        self.assertEqual(seen, {(s, o) for s in range(3) for o in range(60)})
        self.assertTrue(all(1 <= n <= 16 for n in sizes), sizes)

        g = self.group(stream)
        self.assertEqual(g.shards, 3)
        self.assertEqual(g.lag(), 0)
        self.assertEqual([(i.position, i.in_flight) for i in g.describe()], [(60, 0)] * 3)

    def test_max_records_is_respected_and_sweeps_rotate(self) -> None:
        stream = self.new_stream(shards=2)
        for shard in range(2):
            self.publish_to(stream, shard, 10)
        g = self.group(stream)
        first = g.poll(3)
        self.assertEqual(len(first), 3)
        self.assertEqual({r.shard for r in first}, {0})
        # The next sweep starts at the next shard.
        second = g.poll(1)
        self.assertEqual(keys(second), [(1, 0)])
        self.assertEqual((second[0].payload, second[0].attempts), (b"s1-0", 1))
        rest = g.poll(100)
        self.assertEqual(len(rest), 16)
        self.assertEqual(sorted(keys(first + second + rest)), [(s, o) for s in range(2) for o in range(10)])
        self.assertEqual(g.held, 0)
        self.assertEqual(g.poll(100), [])
        self.assertEqual(g.lag(), 20)
        g.ack_many(first + second + rest)
        self.assertEqual(g.lag(), 0)

    def test_a_poll_for_fewer_records_than_shards_claims_no_more(self) -> None:
        stream = self.new_stream(shards=4)
        a = self.group(stream, self.connect())
        thread, outcome = in_thread(self, lambda: a.poll(1, wait=20))
        self.parked(a, 1)
        for shard in range(4):
            self.publish_to(stream, shard, 1)
        got = self.finish(thread, outcome)
        self.assertEqual(len(got), 1)
        self.assertEqual(a.held, 0)
        # The other three were never claimed: first deliveries for another consumer, at once.
        rest = self.group(stream).poll(10)
        self.assertEqual(len(rest), 3, f"{keys(got)} then {keys(rest)}")
        self.assertTrue(all(r.attempts == 1 for r in rest))
        self.assertNotIn(got[0].shard, {r.shard for r in rest})


class WaitingTest(ShardedTestCase):
    def test_a_waiting_poll_wakes_for_any_shard_and_holds_what_the_others_claim(self) -> None:
        stream = self.new_stream(shards=2)
        # Waits long enough to still be out when the test publishes.
        g = self.group(stream, wait_slice=5)
        started = time.monotonic()
        thread, outcome = in_thread(self, lambda: g.poll(10, wait=20))
        self.parked(g, 2)
        self.publish_to(stream, 1, 1)
        first = self.finish(thread, outcome)
        self.assertLess(time.monotonic() - started, 4)
        self.assertEqual(keys(first), [(1, 0)])

        # The wait on shard 0 (for 5 records) is still out: what arrives
        # there is claimed by it, held, and handed out first, once.
        self.assertEqual(list(g._out), [0])
        self.publish_to(stream, 0, 3)
        eventually("the claim ahead", lambda: self.in_flight(stream, 0) == 3)
        self.assertEqual(g.held, 0)  # Not taken in until the next poll.
        second = g.poll(2, wait=10)
        self.assertEqual(keys(second), [(0, 0), (0, 1)])
        self.assertEqual(g.held, 1)
        third = g.poll(10)
        self.assertEqual(keys(third), [(0, 2)])
        self.assertEqual(g.held, 0)
        self.assertTrue(all(r.attempts == 1 for r in second + third))
        self.assertEqual(third[0].payload, b"s0-2")
        self.assertEqual(g.poll(10), [])
        g.ack_many(first + second + third)
        self.assertEqual(g.lag(), 0)

    def test_close_hands_back_what_was_claimed_ahead(self) -> None:
        stream = self.new_stream(shards=2)
        a = self.connect().sharded_group(stream, GROUP, wait_slice=5)
        thread, outcome = in_thread(self, lambda: a.poll(2, wait=20))
        self.parked(a, 2)
        self.publish_to(stream, 0, 1)
        self.assertEqual(keys(self.finish(thread, outcome)), [(0, 0)])
        self.publish_to(stream, 1, 1)
        eventually("the claim ahead", lambda: self.in_flight(stream, 1) == 1)
        started = time.monotonic()
        a.close()
        self.assertLess(time.monotonic() - started, 2)
        self.assertEqual(a.held, 0)
        a.close()  # Again: nothing to do.
        with self.assertRaises(felix.Disconnected):
            a.poll(1)

        b = self.group(stream)
        again = b.poll(10)
        self.assertEqual(keys(again), [(1, 0)])
        self.assertEqual(again[0].attempts, 2, "claimed ahead, then handed back")
        b.ack_many(again)
        info = b.describe()
        self.assertEqual(info[0].in_flight, 1, "the returned record stays claimed")
        self.assertEqual(info[1].in_flight, 0)

    def test_close_from_another_thread_ends_a_waiting_poll(self) -> None:
        stream = self.new_stream(shards=2)
        g = self.group(stream, self.connect(), wait_slice=0.5)
        thread, outcome = in_thread(self, lambda: g.poll(10, wait=20))
        self.parked(g, 2)
        before = {t.ident for t in threading.enumerate()}  # The client's readers included.
        started = time.monotonic()
        g.close()
        self.assertEqual(self.finish(thread, outcome), [])
        self.assertLess(time.monotonic() - started, 2)
        self.assertEqual(g._out, {})
        # The group started no threads of its own.
        self.assertEqual({t.ident for t in threading.enumerate()} - before, set())
        self.assertFalse(thread.is_alive())

    def test_a_waiting_poll_that_times_out_returns_nothing(self) -> None:
        stream = self.new_stream(shards=3)
        with self.client.sharded_group(stream, GROUP, wait_slice=0.1) as g:
            started = time.monotonic()
            self.assertEqual(g.poll(8, wait=0.4), [])
            self.assertGreaterEqual(time.monotonic() - started, 0.39)


class RoutingTest(ShardedTestCase):
    def test_acks_nacks_extends_and_dead_letters_go_to_each_records_shard(self) -> None:
        stream = self.new_stream(shards=4)
        for shard in range(4):
            self.publish_to(stream, shard, 1)
        g = self.group(stream, wait_slice=0.2)
        got = sorted(g.poll(10), key=lambda r: r.shard)
        self.assertEqual(g.lag(), 4)
        self.assertEqual(keys(got), [(0, 0), (1, 0), (2, 0), (3, 0)])

        stands = g.extend(got[0], 45)
        self.assertGreater(stands, 40)
        g.ack(got[0])
        g.nack(got[1])
        g.dead_letter(got[2], reason="unparseable")
        g.nack_after(got[3], 0.3)

        info = g.describe()
        self.assertEqual((info[0].position, info[0].in_flight), (1, 0))
        self.assertEqual((info[1].position, info[1].owed), (0, 1))
        self.assertEqual((info[2].position, info[2].dead_letters), (1, 1))
        self.assertEqual((info[3].position, info[3].delayed), (0, 1))
        self.assertEqual(g.lag(), 2)
        (letter,) = self.client.group_dead_letters_detailed(stream, 2, GROUP)
        self.assertEqual((letter.offset, letter.reason, letter.by_consumer), (0, "unparseable", True))

        # The nacked record comes again, from its own shard; the delayed one
        # once its delay has passed.
        again = g.poll(10)
        self.assertEqual([(r.shard, r.offset, r.attempts) for r in again], [(1, 0, 2)])
        later = g.poll(10, wait=3)
        self.assertEqual([(r.shard, r.offset, r.attempts) for r in later], [(3, 0, 2)])
        g.ack_many(again + later)
        self.assertEqual(g.lag(), 0)
        with self.assertRaises(felix.InvalidArgument):
            g.ack(again[0].record)  # type: ignore[arg-type]

    def test_a_named_member_takes_back_its_claims_on_every_shard(self) -> None:
        stream = self.new_stream(shards=2)
        for shard in range(2):
            self.publish_to(stream, shard, 3)
        # The first run claims everything and stops answering (its client
        # stays connected, as a hung process's would).
        old = self.connect().sharded_group(stream, GROUP, consumer="worker-1", reclaim=True)
        held = old.poll(100) + old.poll(100)
        self.assertEqual(len(held), 6)
        self.assertEqual(old.held, 0)

        # An anonymous consumer gets nothing: the claims stand.
        anon = self.group(stream)
        self.assertEqual(anon.poll(100), [])

        # The restarted member, on a new connection, takes all six back.
        new = self.group(stream, self.connect(), consumer="worker-1", reclaim=True)
        back: List[ShardedRecord] = []
        for _ in range(4):
            back.extend(new.poll(100))
        self.assertEqual(sorted(keys(back)), [(s, o) for s in range(2) for o in range(3)])
        self.assertTrue(all(r.attempts == 2 for r in back))
        new.ack_many(back)
        self.assertEqual(new.lag(), 0)

    def test_a_reclaiming_member_drops_what_a_lost_connection_held(self) -> None:
        stream = self.new_stream(shards=3)
        client = self.connect()
        g = self.group(stream, client, consumer="worker-2", reclaim=True, wait_slice=5)
        cores = list(g._placement)
        # Shards a and b share a core; d is on another.
        a, b = next((x, y) for x in range(3) for y in range(x + 1, 3) if cores[x] == cores[y])
        (d,) = {0, 1, 2} - {a, b}
        self.assertNotEqual(cores[d], cores[a])

        thread, outcome = in_thread(self, lambda: g.poll(3, wait=20))
        self.parked(g, 3)
        self.publish_to(stream, d, 1)
        first = self.finish(thread, outcome)
        self.assertEqual(keys(first), [(d, 0)])
        # The wait still out on a claims its record; the answer lands, not
        # yet taken in.
        self.publish_to(stream, a, 1)
        eventually("the answer of a", lambda: g._out[a].landed is not None)
        # The connection of that core drops: b's wait answers Disconnected.
        client._slots[cores[a]].conn.close("dropped by the test")  # type: ignore[union-attr]
        with self.assertRaises(felix.Disconnected):
            g.poll(10)
        self.assertEqual(g.held, 0, "what the lost connection held was dropped")

        # The reclaim over the new connection hands it out again, once.
        back: List[ShardedRecord] = []
        eventually("the reclaim", lambda: bool(back.extend(g.poll(10)) or back))
        self.assertEqual([(r.shard, r.offset, r.attempts) for r in back], [(a, 0, 2)])
        self.assertEqual(g.poll(10), [])
        g.ack_many(first + back)
        self.assertEqual(g.lag(), 0)

    def test_bad_arguments_are_refused(self) -> None:
        stream = self.new_stream(shards=2)
        with self.assertRaises(felix.NotFound):
            self.client.sharded_group(stream + "-nope", GROUP)
        for options in ({"consumer": ""}, {"reclaim": True}, {"visibility": 0}, {"wait_slice": -1}):
            with self.assertRaises(felix.InvalidArgument, msg=str(options)):
                self.client.sharded_group(stream, GROUP, **options)  # type: ignore[arg-type]
        with self.assertRaises(felix.InvalidArgument):
            self.client.sharded_group(stream, "bad name")
        g = self.group(stream, wait_slice=0)
        self.assertEqual(g.wait_slice, 0.01)
        with self.assertRaises(felix.InvalidArgument):
            g.poll(0)
        with self.assertRaises(felix.InvalidArgument):
            g.poll(1, wait=-1)
