"""Shared helpers: the broker under test and fresh names."""

import os
import threading
import unittest
import uuid
from typing import Callable, Dict, Optional, Tuple

import felix


def broker_addr() -> str:
    """The broker every integration test talks to, from ``FELIX_ADDR``.

    Fails loudly when it is unset: the suite is meant to run against a real
    broker, and quietly skipping would pass without testing anything.
    """
    addr = os.environ.get("FELIX_ADDR")
    if not addr:
        raise RuntimeError(
            "FELIX_ADDR is not set: start a broker with durable storage and 2 cores, with "
            "FELIX_GROUP_MAX_ATTEMPTS=3 (FELIX_GROUP_MAX_ATTEMPTS=3 ./target/release/felix serve --data-dir DIR "
            "--listen 127.0.0.1:7611 --cores 2) and export FELIX_ADDR=127.0.0.1:7611; "
            "the broker-free tests: cd client/python && python3 -m unittest tests.test_wire tests.test_sharded_fake"
        )
    return addr


def in_thread(
    case: unittest.TestCase, call: Callable[[], object]
) -> Tuple[threading.Thread, Dict[str, object]]:
    """Run ``call`` in a thread joined when ``case`` ends; the dict gets its
    ``result`` or ``error``."""
    outcome: Dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as e:  # noqa: B902 - reported to the test
            outcome["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    case.addCleanup(thread.join, 10)
    return thread, outcome


def fresh_stream(prefix: str = "s") -> str:
    """A stream path no other test uses."""
    return f"pytest/default/{prefix}-{uuid.uuid4().hex[:12]}"


class BrokerTestCase(unittest.TestCase):
    """A test with a connected :class:`felix.Client` (``self.client``), closed after it."""

    client: felix.Client

    def setUp(self) -> None:
        self.client = self.connect()

    def connect(self, **options: object) -> felix.Client:
        """Another client to the broker under test, closed after the test."""
        options.setdefault("request_timeout", 10.0)
        client = felix.Client.connect(broker_addr(), **options)  # type: ignore[arg-type]
        self.addCleanup(client.close)
        return client

    def new_stream(self, shards: int = 1, prefix: Optional[str] = None) -> str:
        """Create a fresh stream and return its path."""
        path = fresh_stream(prefix or self._testMethodName[:40])
        self.client.create_stream(path, shards)
        return path
