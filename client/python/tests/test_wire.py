"""Offline tests: encoding, key routing, decoder robustness, and what the
client does with a misbehaving broker. No real broker needed."""

import math
import random
import signal
import socket
import struct
import threading
import time
import unittest
from datetime import timedelta
from typing import List

import felix
from felix import _wire
from felix.errors import error_from_wire

from .fake_broker import FakeBrokerCase, error_frame, response_frame
from .support import in_thread


class KeyRoutingTest(unittest.TestCase):
    def test_crc32c_check_value(self) -> None:
        self.assertEqual(felix.crc32c(b"123456789"), 0xE3069283)
        self.assertEqual(felix.crc32c(b""), 0)

    def test_shard_for_key_is_crc32c_mod_shards(self) -> None:
        self.assertEqual(felix.shard_for_key(b"123456789", 7), 0xE3069283 % 7)
        self.assertEqual(felix.shard_for_key(b"anything", 0), 0)


class EncodingTest(unittest.TestCase):
    def test_ping_frame_matches_the_documented_bytes(self) -> None:
        data = _wire.frame(1, _wire.ping())
        self.assertEqual(data, bytes.fromhex("0c000000" "01" "02" "0000" "0100000000000000"))

    def test_feature_requirements_follow_the_table(self) -> None:
        ref = felix.StreamRef("t", "n", "s")
        F = felix.Feature
        self.assertEqual(_wire.group_poll(ref, 0, "g", 1, 0, None, None).required, F.GROUPS)
        self.assertEqual(_wire.group_poll(ref, 0, "g", 1, 0, None, 5).required, F.GROUPS | F.GROUP_CLAIM_CONTROL)
        self.assertEqual(_wire.group_nack(ref, 0, "g", 0, 1, None, None).required, F.GROUPS)
        self.assertEqual(_wire.group_nack(ref, 0, "g", 0, 1, 5, None).required, F.GROUPS | F.GROUP_CLAIM_CONTROL)
        self.assertEqual(_wire.publish(ref, 0, None, _wire.ACK_DURABLE, []).required, F.PUBLISH_ACK_MODE)
        self.assertEqual(_wire.publish(ref, 0, None, _wire.ACK_DEFAULT, []).required, F(0))
        self.assertEqual(_wire.group_describe(ref, 0, "g").required, F.GROUPS | F.GROUP_ADMIN)

    def test_describe_replica_needs_its_feature_and_its_answer_decodes(self) -> None:
        ref = felix.StreamRef("t", "n", "s")
        request = _wire.describe_replica(ref, 3)
        self.assertEqual(request.required, felix.Feature.REPLICA_INFO)
        s = lambda v: struct.pack("<H", len(v)) + v.encode()
        body = (
            s("t") + s("n") + s("s") + struct.pack("<IQBQ", 3, 2, 2, 7)
            + b"\x01" + struct.pack("<Q", 1) + b"\x01" + s("127.0.0.1:7400")
            + struct.pack("<QQQQ", 40, 40, 41, 32) + b"\x00"
            + struct.pack("<I", 1) + struct.pack("<QQ", 3, 39)
        )
        header = _wire.FrameHeader(12 + len(body), 2, 0x13, 0, 1)
        info = _wire.decode_response(header, body).value
        self.assertEqual((info.stream, info.shard, info.node, info.role, info.term), (ref, 3, 2, "follower", 7))
        self.assertEqual((info.leader, info.leader_addr), (1, "127.0.0.1:7400"))
        self.assertEqual((info.commit, info.applied, info.last_index, info.compacted), (40, 40, 41, 32))
        self.assertEqual((info.stopped, info.peers), (None, (felix.PeerProgress(3, 39),)))
        bad_role = body.replace(struct.pack("<IQBQ", 3, 2, 2, 7), struct.pack("<IQBQ", 3, 2, 9, 7))
        with self.assertRaises(felix.ProtocolError):
            _wire.decode_response(header, bad_role)

    def test_describe_cluster_is_an_empty_request_needing_its_feature(self) -> None:
        self.assertEqual(int(felix.Feature.CLUSTER_INFO), 0x100)
        self.assertTrue(_wire.FEATURES_ALL & felix.Feature.CLUSTER_INFO, "HELLO offers it")
        request = _wire.describe_cluster()
        self.assertEqual((request.name, request.opcode, request.required), ("describe_cluster", 0x16, felix.Feature.CLUSTER_INFO))
        self.assertEqual(request.body, b"")
        self.assertEqual(_wire.frame(5, request), bytes.fromhex("0c000000" "01" "16" "0000" "0500000000000000"))

    def test_a_cluster_answer_decodes_strictly(self) -> None:
        s = lambda v: struct.pack("<H", len(v)) + v
        body = (
            struct.pack("<Q", 2) + struct.pack("<I", 3)
            + struct.pack("<Q", 1) + s(b"10.0.0.1:7400")
            + struct.pack("<Q", 2) + s(b"10.0.0.2:7400")
            + struct.pack("<Q", 3) + s("h\u00f4te:7400".encode())
        )

        def decode(data: bytes) -> _wire.Response:
            return _wire.decode_response(_wire.FrameHeader(12 + len(data), 2, 0x14, 0, 1), data)

        answer = decode(body)
        self.assertEqual(answer.name, "cluster")
        self.assertEqual(
            answer.value,
            felix.ClusterInfo(
                2,
                (
                    felix.ClusterMember(1, "10.0.0.1:7400"),
                    felix.ClusterMember(2, "10.0.0.2:7400"),
                    felix.ClusterMember(3, "h\u00f4te:7400"),
                ),
            ),
        )
        self.assertEqual(decode(struct.pack("<QI", 7, 0)).value, felix.ClusterInfo(7, ()))
        # Cut anywhere, the answer is refused.
        for end in range(len(body)):
            with self.subTest(cut_at=end), self.assertRaises(felix.ProtocolError):
                decode(body[:end])
        # Trailing bytes, a count the body cannot hold, bad UTF-8: refused.
        bad = [
            body + b"\x00",
            struct.pack("<QI", 2, 1_000_000_000) + body[12:],
            struct.pack("<QI", 2, 4) + body[12:],
            struct.pack("<QI", 2, 1) + struct.pack("<Q", 1) + s(b"\xff\xfe:7400"),
        ]
        for data in bad:
            with self.subTest(body=data[:16]), self.assertRaises(felix.ProtocolError):
                decode(data)

    def test_unknown_error_codes_map_to_internal_keeping_the_number(self) -> None:
        error = error_from_wire(99, "from the future")
        self.assertIsInstance(error, felix.Internal)
        self.assertEqual((error.code, error.number), ("internal", 99))
        self.assertIn("99", error.message)
        self.assertIsInstance(error_from_wire(9, "x"), felix.StaleClaim)


class DecoderRobustnessTest(unittest.TestCase):
    def decode(self, opcode: int, body: bytes) -> _wire.Response:
        return _wire.decode_response(_wire.FrameHeader(12 + len(body), 2, opcode, 0, 1), body)

    def test_an_error_says_not_applied_only_in_its_trailing_byte(self) -> None:
        message = b"disk nearly full"
        body = struct.pack("<HH", 7, len(message)) + message + b"\x00"
        plain = self.decode(0xFF, body).value
        self.assertIsInstance(plain, felix.Unavailable)
        self.assertFalse(plain.not_applied)
        self.assertTrue(self.decode(0xFF, body + b"\x01").value.not_applied)
        for tail in (b"\x00", b"\x02", b"\x01\x01"):
            with self.subTest(tail=tail), self.assertRaises(felix.ProtocolError):
                self.decode(0xFF, body + tail)
        # not_leader: as the broker says (a publish's is flagged).
        leader = struct.pack("<HH", 10, 1) + b"x" + b"\x00" + b"\x00"
        self.assertFalse(self.decode(0xFF, leader).value.not_applied)
        self.assertTrue(self.decode(0xFF, leader + b"\x01").value.not_applied)

    def test_a_huge_count_in_a_tiny_body_is_refused_before_allocating(self) -> None:
        with self.assertRaises(felix.ProtocolError):
            self.decode(0x30, struct.pack("<I", 1_000_000_000))

    def test_bad_presence_bytes_trailing_bytes_and_unknown_opcodes_are_refused(self) -> None:
        for opcode, body in [(0x31, b"\x01" * 9), (0x33, b"\x00\x00\x00\x00\x07"), (0x77, b""), (0x03, b"\x00")]:
            with self.subTest(opcode=opcode), self.assertRaises(felix.ProtocolError):
                self.decode(opcode, body)

    def test_empty_blobs_share_one_object_and_counts_are_bounded_by_the_body(self) -> None:
        empty_record = struct.pack("<QQBII", 0, 0, 0, 0, 0)
        body = struct.pack("<QQQI", 0, 3, 3, 3) + empty_record * 3
        records = self.decode(0x21, body).value[3]
        self.assertEqual(len(records), 3)
        self.assertTrue(all(r.payload is records[0].payload for r in records))
        # One record fewer than the count claims: refused before decoding any.
        with self.assertRaises(felix.ProtocolError):
            self.decode(0x21, struct.pack("<QQQI", 0, 3, 3, 4) + empty_record * 3)

    def test_a_request_frame_is_built_once_with_its_header(self) -> None:
        request = _wire.publish(felix.StreamRef("t", "n", "s"), 0, None, 0, [felix.RecordIn(b"abc")])
        self.assertIsInstance(request.frame, bytearray)
        self.assertEqual(int.from_bytes(request.frame[:4], "little"), len(request.frame) - 4)
        self.assertEqual(request.frame[16:], request.body)
        request.set_request_id(9)
        self.assertEqual(_wire.FrameHeader.parse(bytes(request.frame[:16])).request_id, 9)

    def test_random_bytes_only_ever_raise_protocol_errors(self) -> None:
        rng = random.Random(7)
        opcodes = [0x01, 0x02, 0x03, 0x10, 0x11, 0x12, 0x13, 0x14, 0x20, 0x21, 0x30, 0x31, 0x32, 0x33, 0x40, 0x41, 0xFF]
        for _ in range(5000):
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
            try:
                self.decode(rng.choice(opcodes), body)
            except felix.ProtocolError:
                pass


def _pong(request_id: int) -> bytes:
    return response_frame(request_id, 0x02, b"")


def _records_answer(request_id: int, next_offset: int = 0) -> bytes:
    """A ``Records`` answer with no records."""
    return response_frame(request_id, 0x21, struct.pack("<QQQI", 0, next_offset, next_offset, 0))


def _stream_answer(request_id: int, placement: list) -> bytes:  # type: ignore[type-arg]
    w = _wire.Writer().stream(felix.StreamRef("t", "n", "s")).u32(len(placement)).u8(0).u8(0).u32(len(placement))
    for core in placement:
        w.u32(core)
    return response_frame(request_id, 0x10, bytes(w.buf))


def _dead_letters(w: _wire.Writer, offsets: list) -> _wire.Writer:  # type: ignore[type-arg]
    w.u32(len(offsets))
    for offset in offsets:
        w.u64(offset).u32(3).u64(1000 + offset).u8(1).string(f"r{offset}").u8(0)
    return w


class MisbehavingBrokerTest(FakeBrokerCase):
    def test_calls_needing_unadvertised_features_are_refused_without_sending(self) -> None:
        fake = self.serve(lambda h, b, c: response_frame(h.request_id, 0x03, b""), features=int(felix.Feature.GROUPS))
        client = self.connect(fake, ack_on_commit=True)
        record = felix.GroupRecord(0, 1, 0, None, (), b"", None)
        for call in [
            lambda: client.group_poll("t/n/s", 0, "g", visibility=5),
            lambda: client.group_nack_after("t/n/s", 0, "g", record, 1.0),
            lambda: client.group_extend("t/n/s", 0, "g", record, 1.0),
            lambda: client.group_dead_letter("t/n/s", 0, "g", record),
            lambda: client.group_describe("t/n/s", 0, "g"),
            lambda: client.publish("t/n/s", 0, b"x"),
        ]:
            with self.assertRaises(felix.Unsupported) as caught:
                call()
            self.assertIsNone(caught.exception.number)
        self.assertEqual(fake.received, [])
        client.group_ack("t/n/s", 0, "g", [1, 2])
        self.assertEqual(fake.received, [0x31])

    def test_describe_cluster_is_refused_without_its_feature_and_answered_with_it(self) -> None:
        def cluster_answer(header, body, core):  # type: ignore[no-untyped-def]
            w = _wire.Writer().u64(1).u32(1).u64(1).string("127.0.0.1:7400")
            return response_frame(header.request_id, 0x14, bytes(w.buf))

        plain = self.serve(cluster_answer, features=int(felix.Feature.GROUPS))
        with self.assertRaises(felix.Unsupported) as caught:
            self.connect(plain).describe_cluster()
        self.assertIn("FEATURE_CLUSTER_INFO", caught.exception.message)
        self.assertIsNone(caught.exception.number)
        self.assertEqual(plain.received, [], "nothing sent")
        member = self.serve(cluster_answer, features=int(felix.Feature.CLUSTER_INFO))
        info = self.connect(member).describe_cluster()
        self.assertEqual(info, felix.ClusterInfo(1, (felix.ClusterMember(1, "127.0.0.1:7400"),)))
        self.assertEqual(member.received, [0x16])

    def test_garbage_from_the_broker_fails_the_call_and_keeps_the_connection(self) -> None:
        fake = self.serve(lambda h, b, c: response_frame(h.request_id, 0x21, b"\x01\x02"))
        client = self.connect(fake)
        for _ in range(2):
            with self.assertRaises(felix.ProtocolError) as caught:
                client.ping()
            self.assertIn("undecodable", caught.exception.message)
        self.assertEqual((fake.accepted, client.connected_cores), (1, [0]))

    def test_an_undecodable_answer_fails_only_its_request(self) -> None:
        held: List[int] = []

        def script(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x21:  # The long poll: held until the ping.
                held.append(header.request_id)
                return b""
            if len(held) == 1:
                held.append(0)
                # A pong with a body it cannot have, then the held answer.
                return response_frame(header.request_id, 0x02, b"\x00") + _records_answer(held[0], 3)
            return _pong(header.request_id)

        fake = self.serve(script)
        client = self.connect(fake)
        poller, outcome = in_thread(self, lambda: client.read("t/n/s", 0, 3, wait=10))
        self.assertTrue(fake.wait_for_requests(1))
        with self.assertRaises(felix.ProtocolError):
            client.ping()
        poller.join(5)
        self.assertNotIn("error", outcome)
        self.assertEqual(outcome["result"].next_offset, 3)  # type: ignore[attr-defined]
        client.ping()  # The same connection goes on working.
        self.assertEqual(fake.accepted, 1)

    def test_an_oversized_length_prefix_fails_calls_in_flight(self) -> None:
        fake = self.serve(lambda h, b, c: struct.pack("<I", 0xFFFFFFF0) + b"\x00" * 12)
        client = self.connect(fake, max_frame_bytes=1 << 20)
        with self.assertRaises(felix.Disconnected):
            client.ping()
        self.assertEqual(client.connected_cores, [])

    def test_a_silent_broker_times_out_and_the_call_does_not_hang(self) -> None:
        fake = self.serve(lambda h, b, c: b"")
        client = self.connect(fake, request_timeout=0.3)
        started = time.monotonic()
        with self.assertRaises(felix.Timeout):
            client.ping()
        self.assertLess(time.monotonic() - started, 2.0)

    def test_a_send_that_backs_up_is_bounded_by_the_request_timeout(self) -> None:
        fake = self.serve(lambda h, b, c: b"", stall=True, max_frame=64 << 20)
        client = self.connect(fake, request_timeout=0.5)
        started = time.monotonic()
        with self.assertRaises(felix.Timeout):
            client.publish("t/n/s", 0, b"x" * (48 << 20))
        self.assertLess(time.monotonic() - started, 2.0)
        self.assertEqual(client.connected_cores, [], "a half-sent frame must drop the connection")

    @unittest.skipUnless(hasattr(signal, "setitimer"), "needs signal.setitimer")
    def test_an_interrupt_mid_send_drops_the_connection(self) -> None:
        fake = self.serve(lambda h, b, c: b"", stall=True, max_frame=64 << 20)
        client = self.connect(fake, request_timeout=10)

        def interrupt(signum, frame):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with self.assertRaises(KeyboardInterrupt):
                client.publish("t/n/s", 0, b"x" * (48 << 20))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        self.assertEqual(client.connected_cores, [], "a half-sent frame must drop the connection")

    def test_a_trickling_hello_is_bounded_by_the_connect_timeout(self) -> None:
        fake = self.serve(lambda h, b, c: b"", trickle=0.1)
        started = time.monotonic()
        with self.assertRaises(felix.Timeout):
            felix.Client.connect(fake.addr, connect_timeout=0.5)
        self.assertLess(time.monotonic() - started, 1.5)

    def test_a_refused_hello_raises_the_brokers_error(self) -> None:
        fake = self.serve(lambda h, b, c: b"", hello=lambda h, b: error_frame(0, 8, "no such token"))
        with self.assertRaises(felix.Unauthorized) as caught:
            felix.Client.connect(fake.addr, token="nope")
        self.assertEqual((caught.exception.number, caught.exception.message), (8, "no such token"))

    def test_a_broker_closing_during_hello_is_connection_failed_once(self) -> None:
        fake = self.serve(lambda h, b, c: b"", hello=lambda h, b: None)
        with self.assertRaises(felix.ConnectionFailed) as caught:
            felix.Client.connect(fake.addr)
        self.assertNotIsInstance(caught.exception.__cause__, felix.ConnectionFailed)
        self.assertNotIn("HELLO failed", caught.exception.message)

    def test_answers_out_of_order_reach_their_callers(self) -> None:
        held: List[int] = []

        def script(header, body, core):  # type: ignore[no-untyped-def]
            # Hold the first ping, answer it after the second.
            if not held:
                held.append(header.request_id)
                return b""
            return _pong(header.request_id) + _pong(held[0])

        fake = self.serve(script)
        client = self.connect(fake)
        first, outcome = in_thread(self, client.ping)
        self.assertTrue(fake.wait_for_requests(1))
        client.ping()
        first.join(2.0)
        self.assertFalse(first.is_alive())
        self.assertNotIn("error", outcome)
        self.assertIsInstance(outcome["result"], float)

    def test_a_wrong_core_answer_is_followed_even_if_the_refresh_fails(self) -> None:
        describes: List[int] = []

        def script(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                describes.append(core)
                if len(describes) == 1:
                    return _stream_answer(header.request_id, [0])
                return error_frame(header.request_id, 11, "refresh refused")
            if header.opcode == 0x20 and core == 0:
                return error_frame(header.request_id, 4, "shard 0 is on core 1", core=1)
            return response_frame(header.request_id, 0x20, struct.pack("<IQI", 0, 7, 1))

        fake = self.serve(script, cores=2)
        client = self.connect(fake)
        self.assertEqual(client.publish("t/n/s", 0, b"x"), 7)
        self.assertEqual(fake.calls, [(0, 0x11), (0, 0x20), (0, 0x11), (1, 0x20)])
        self.assertEqual(client.connected_cores, [0, 1])

    def test_a_second_wrong_core_answer_is_raised(self) -> None:
        def script(header, body, core):  # type: ignore[no-untyped-def]
            if header.opcode == 0x11:
                return _stream_answer(header.request_id, [0])
            return error_frame(header.request_id, 4, "not here either", core=1 - core)

        client = self.connect(self.serve(script, cores=2))
        with self.assertRaises(felix.WrongCore) as caught:
            client.publish("t/n/s", 0, b"x")
        self.assertEqual((caught.exception.code, caught.exception.core), ("wrong_core", 0))

    def test_close_fails_calls_in_flight(self) -> None:
        fake = self.serve(lambda h, b, c: b"")
        client = self.connect(fake, request_timeout=30)
        caller, outcome = in_thread(self, client.ping)
        self.assertTrue(fake.wait_for_requests(1))
        client.close()
        caller.join(5)
        self.assertIsInstance(outcome.get("error"), felix.Disconnected)
        with self.assertRaises(felix.Disconnected):
            client.ping()

    def test_dead_letters_are_fetched_page_by_page(self) -> None:
        letters = [3, 5, 8, 9, 12]

        def script(header, body, core):  # type: ignore[no-untyped-def]
            from_offset = struct.unpack_from("<Q", body, len(body) - 12)[0]
            page = [o for o in letters if o >= from_offset][:2]
            rest = [o for o in letters if o > page[-1]] if page else []
            w = _dead_letters(_wire.Writer(), page)
            w.opt(page[-1] + 1 if rest else None, w.u64)
            return response_frame(header.request_id, 0x33, bytes(w.buf))

        F = felix.Feature
        fake = self.serve(script, features=int(F.GROUPS | F.GROUP_DEAD_LETTER_PAGES))
        client = self.connect(fake)
        detailed = client.group_dead_letters_detailed("t/n/s", 0, "g")
        self.assertEqual([d.offset for d in detailed], letters)
        self.assertEqual((detailed[0].attempts, detailed[0].reason, detailed[0].by_consumer), (3, "r3", False))
        self.assertEqual(fake.received, [0x38, 0x38, 0x38])
        page = client.group_dead_letters_page("t/n/s", 0, "g", 6, 2)
        self.assertEqual(([d.offset for d in page.letters], page.next), ([8, 9], 10))

    def test_without_pages_the_whole_dead_letter_list_is_asked_for(self) -> None:
        def script(header, body, core):  # type: ignore[no-untyped-def]
            return response_frame(header.request_id, 0x32, bytes(_dead_letters(_wire.Writer(), [1, 4]).buf))

        fake = self.serve(script, features=int(felix.Feature.GROUPS))
        client = self.connect(fake)
        self.assertEqual(client.group_dead_letters("t/n/s", 0, "g"), [1, 4])
        self.assertEqual(fake.received, [0x35])
        with self.assertRaises(felix.Unsupported):
            client.group_dead_letters_page("t/n/s", 0, "g")

    def test_a_refused_connection_is_a_typed_error(self) -> None:
        unused = socket.socket()
        unused.bind(("127.0.0.1", 0))
        addr = unused.getsockname()
        unused.close()
        with self.assertRaises(felix.ConnectionFailed) as caught:
            felix.Client.connect(addr, connect_timeout=1.0)
        self.assertIn(f"{addr[0]}:{addr[1]}: ", caught.exception.message, "host:port, not a tuple")

    def answering_server(self, reply: bytes, *, trickle: float = 0.0) -> str:
        """A TCP server answering each connection's first bytes with ``reply``
        (a byte at a time when ``trickle``) and closing it; its ``host:port``."""
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        self.addCleanup(server.close)

        def serve() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    try:
                        conn.recv(4096)
                        if not trickle:
                            conn.sendall(reply)
                        for i in range(len(reply)) if trickle else ():
                            conn.sendall(reply[i : i + 1])
                            time.sleep(trickle)
                    except OSError:
                        pass

        threading.Thread(target=serve, daemon=True).start()
        host, port = server.getsockname()
        return f"{host}:{port}"

    def test_something_that_is_not_a_felix_broker_is_named(self) -> None:
        http = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        for trickle in (0.0, 0.002):
            addr = self.answering_server(http, trickle=trickle)
            with self.assertRaises(felix.ProtocolError) as caught:
                felix.Client.connect(addr, connect_timeout=2.0)
            self.assertEqual(
                caught.exception.message, f"not a Felix broker at {addr} (it answered HTTP: the metrics port?)"
            )
        addr = self.answering_server(b"\xff\xff\xff\x7f\x01\x02\x03\x04")
        with self.assertRaises(felix.ProtocolError) as caught:
            felix.Client.connect(addr, connect_timeout=2.0)
        self.assertEqual(
            caught.exception.message, f"not a Felix broker at {addr}: its first answer declares a 2147483647-byte frame"
        )


class ArgumentValidationTest(unittest.TestCase):
    def test_stream_paths_and_names_are_checked(self) -> None:
        for path in ["a/b", "a/b/c/d", "a//c", "a/b/c d", "a/b/..", "a/b/" + "x" * 129, "a/b/é"]:
            with self.subTest(path=path), self.assertRaises(felix.InvalidArgument):
                felix.StreamRef.parse(path)
        self.assertEqual(str(felix.StreamRef.parse("t-1/ns.x/s_2")), "t-1/ns.x/s_2")

    def test_start_positions(self) -> None:
        self.assertEqual(felix.StartPosition.of(5), felix.StartPosition.at(5))
        with self.assertRaises(felix.InvalidArgument):
            felix.StartPosition.of(-1)
        with self.assertRaises(felix.InvalidArgument):
            felix.StartPosition.of(True)  # type: ignore[arg-type]
        self.assertEqual(str(felix.StartPosition.LATEST), "latest")

    def test_durations_are_finite_and_not_negative_and_saturate(self) -> None:
        from felix.client import _ms_u32, _ms_u64, _seconds

        for bad in (float("inf"), float("-inf"), float("nan"), -1, -0.5, "1", None, True):
            with self.subTest(value=bad), self.assertRaises(felix.InvalidArgument):
                _seconds("wait", bad)  # type: ignore[arg-type]
        self.assertEqual(_ms_u32("wait", 1e30), (1 << 32) - 1)
        self.assertEqual(_ms_u64("by", 1e30), (1 << 64) - 1)
        self.assertEqual(_ms_u64("by", 10**400), (1 << 64) - 1)
        self.assertEqual(_ms_u64("by", 0.0001), 1)
        self.assertEqual(_ms_u64("by", 0), 0)
        self.assertEqual(_ms_u64("by", timedelta(milliseconds=1500)), 1500)
        self.assertFalse(math.isinf(_seconds("wait", 10**400)))

    def test_client_config_takes_timedeltas_and_checks_its_fields(self) -> None:
        config = felix.ClientConfig(request_timeout=timedelta(seconds=2), connect_timeout=timedelta(milliseconds=500))
        self.assertEqual((config.request_timeout, config.connect_timeout), (2.0, 0.5))
        for bad in [
            dict(request_timeout=0),
            dict(connect_timeout=float("nan")),
            dict(reconnect_backoff_max=float("inf")),
            dict(reconnect_backoff_initial=timedelta(seconds=-1)),
            dict(client_name="\ud800"),
            dict(client_name=42),
            dict(client_name="x" * 70000),
            dict(token="\udfff"),
            dict(token=b"bytes"),
            dict(max_frame_bytes=100),
            dict(ack_on_commit="yes"),
        ]:
            with self.subTest(**{k: repr(v)[:20] for k, v in bad.items()}), self.assertRaises(felix.InvalidArgument):
                felix.ClientConfig(**bad)  # type: ignore[arg-type]
        with self.assertRaises(felix.InvalidArgument):
            felix.Client.connect("127.0.0.1:1", config="fast")  # type: ignore[arg-type]

    def test_record_in_checks_its_fields(self) -> None:
        record = felix.RecordIn(bytearray(b"p"), key="k", headers=[("h", "v")])  # type: ignore[arg-type]
        self.assertEqual((record.payload, record.key, record.headers), (b"p", b"k", (("h", b"v"),)))
        for bad in [
            lambda: felix.RecordIn(42),  # type: ignore[arg-type]
            lambda: felix.RecordIn(b"x", key=3),  # type: ignore[arg-type]
            lambda: felix.RecordIn(b"x", timestamp_ms=-1),
            lambda: felix.RecordIn(b"x", timestamp_ms=1.5),  # type: ignore[arg-type]
            lambda: felix.RecordIn(b"x", headers=[("h",)]),  # type: ignore[list-item]
            lambda: felix.RecordIn(b"x", headers=[(b"h", b"v")]),  # type: ignore[list-item]
            lambda: felix.RecordIn(b"x", headers=[("\ud800", b"v")]),
            lambda: felix.RecordIn(b"x", headers=5),  # type: ignore[arg-type]
            lambda: felix.RecordIn.of("\udc00"),
        ]:
            with self.assertRaises(felix.InvalidArgument):
                bad()

    def test_lone_surrogates_in_encoded_text_are_invalid_arguments(self) -> None:
        ref = felix.StreamRef("t", "n", "s")
        with self.assertRaises(felix.InvalidArgument):
            _wire.group_nack(ref, 0, "g", 0, 1, None, "bad \ud800 reason")
        with self.assertRaises(felix.InvalidArgument):
            _wire.list_streams("\ud800")

    def test_start_kind_is_an_enum(self) -> None:
        self.assertIs(felix.StartPosition.at(3).kind, felix.StartKind.OFFSET)
        self.assertIs(felix.StartPosition("latest").kind, felix.StartKind.LATEST)
        self.assertEqual(felix.StartPosition.EARLIEST.kind, "earliest")
        with self.assertRaises(felix.InvalidArgument):
            felix.StartPosition("newest")  # type: ignore[arg-type]
