"""Offline tests: encoding, key routing, decoder robustness, and what the
client does with a misbehaving broker. No real broker needed."""

import random
import socket
import struct
import threading
import time
import unittest

import felix
from felix import _wire
from felix.errors import error_from_wire

from .fake_broker import FakeBroker, response_frame


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

    def test_unknown_error_codes_map_to_internal_keeping_the_number(self) -> None:
        error = error_from_wire(99, "from the future")
        self.assertIsInstance(error, felix.Internal)
        self.assertEqual((error.code, error.number), ("internal", 99))
        self.assertIn("99", error.message)
        self.assertIsInstance(error_from_wire(9, "x"), felix.StaleClaim)


class DecoderRobustnessTest(unittest.TestCase):
    def decode(self, opcode: int, body: bytes) -> _wire.Response:
        return _wire.decode_response(_wire.FrameHeader(12 + len(body), 2, opcode, 0, 1), body)

    def test_a_huge_count_in_a_tiny_body_is_refused_before_allocating(self) -> None:
        with self.assertRaises(felix.ProtocolError):
            self.decode(0x30, struct.pack("<I", 1_000_000_000))

    def test_bad_presence_bytes_trailing_bytes_and_unknown_opcodes_are_refused(self) -> None:
        for opcode, body in [(0x31, b"\x01" * 9), (0x33, b"\x00\x00\x00\x00\x07"), (0x77, b""), (0x03, b"\x00")]:
            with self.subTest(opcode=opcode), self.assertRaises(felix.ProtocolError):
                self.decode(opcode, body)

    def test_random_bytes_only_ever_raise_protocol_errors(self) -> None:
        rng = random.Random(7)
        opcodes = [0x01, 0x02, 0x03, 0x10, 0x11, 0x12, 0x20, 0x21, 0x30, 0x31, 0x32, 0x33, 0x40, 0x41, 0xFF]
        for _ in range(5000):
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
            try:
                self.decode(rng.choice(opcodes), body)
            except felix.ProtocolError:
                pass


class MisbehavingBrokerTest(unittest.TestCase):
    def serve(self, script, features: int = 0) -> FakeBroker:  # type: ignore[no-untyped-def]
        fake = FakeBroker(script, features)
        self.addCleanup(fake.close)
        return fake

    def connect(self, fake: FakeBroker, **options: object) -> felix.Client:
        client = felix.Client.connect(fake.addr, **options)  # type: ignore[arg-type]
        self.addCleanup(client.close)
        return client

    def test_calls_needing_unadvertised_features_are_refused_without_sending(self) -> None:
        fake = self.serve(lambda h, b: response_frame(h.request_id, 0x03, b""), features=int(felix.Feature.GROUPS))
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

    def test_garbage_from_the_broker_is_a_protocol_error_and_drops_the_connection(self) -> None:
        fake = self.serve(lambda h, b: response_frame(h.request_id, 0x21, b"\x01\x02"))
        client = self.connect(fake)
        with self.assertRaises(felix.ProtocolError):
            client.ping()
        with self.assertRaises(felix.ProtocolError):
            client.ping()  # The next call reconnects, and gets garbage again.

    def test_an_oversized_length_prefix_fails_calls_in_flight(self) -> None:
        fake = self.serve(lambda h, b: struct.pack("<I", 0xFFFFFFF0) + b"\x00" * 12)
        client = self.connect(fake, max_frame_bytes=1 << 20)
        with self.assertRaises(felix.Disconnected):
            client.ping()

    def test_a_silent_broker_times_out_and_the_call_does_not_hang(self) -> None:
        fake = self.serve(lambda h, b: b"")
        client = self.connect(fake, request_timeout=0.3)
        started = time.monotonic()
        with self.assertRaises(felix.Timeout):
            client.ping()
        self.assertLess(time.monotonic() - started, 2.0)

    def test_answers_out_of_order_reach_their_callers(self) -> None:
        held = []

        def script(header, body):  # type: ignore[no-untyped-def]
            # Hold the first ping, answer it after the second.
            if not held:
                held.append(header.request_id)
                return b""
            return response_frame(header.request_id, 0x02, b"") + response_frame(held[0], 0x02, b"")

        client = self.connect(self.serve(script))
        first = threading.Thread(target=client.ping)
        first.start()
        time.sleep(0.1)
        client.ping()
        first.join(2.0)
        self.assertFalse(first.is_alive())

    def test_a_refused_connection_is_a_typed_error(self) -> None:
        unused = socket.socket()
        unused.bind(("127.0.0.1", 0))
        addr = unused.getsockname()
        unused.close()
        with self.assertRaises(felix.ConnectionFailed):
            felix.Client.connect(addr, connect_timeout=1.0)


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
