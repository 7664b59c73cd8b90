"""Shared helpers: the broker under test, clusters of brokers started here,
and fresh names."""

import atexit
import ctypes
import ctypes.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

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
            "the broker-free tests: cd client/python && python3 -m unittest tests.test_wire tests.test_sharded_fake "
            "tests.test_cluster_unit"
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


def broker_binary() -> str:
    """The broker binary the cluster tests start three of, from
    ``FELIX_TEST_BROKER`` (``felix-test-broker DATA_DIR LISTEN CORES``).

    Fails loudly when it is unset, as :func:`broker_addr` does.
    """
    binary = os.environ.get("FELIX_TEST_BROKER")
    if not binary:
        raise RuntimeError(
            "FELIX_TEST_BROKER is not set: the cluster tests start brokers of their own. Build the test "
            "broker (cargo build -p felix-tests --bin felix-test-broker) and export "
            "FELIX_TEST_BROKER=$PWD/target/debug/felix-test-broker; cargo test runs this suite with it set"
        )
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"FELIX_TEST_BROKER={binary} is not an executable file")
    return binary


def free_ports(count: int) -> List[int]:
    """``count`` distinct ports the OS had free a moment ago."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


#: How long a broker may take to say it listens.
_START_DEADLINE = 20.0


def _die_with_parent() -> Optional[Callable[[], None]]:
    """On Linux, a ``preexec_fn`` that has the broker killed (``SIGKILL``) when
    the thread that started it exits; ``None`` elsewhere (atexit alone then)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    # Looked up and typed here: the forked child only calls it, before exec.
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    pr_set_pdeathsig = 1
    parent = os.getpid()

    def preexec() -> None:
        if prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # The tests died before the prctl took.
            os._exit(125)

    return preexec


#: Brokers must not outlive the tests, however they end. atexit (in
#: Cluster) covers a normal exit and an uncaught exception, but not SIGTERM
#: (a CI job cancelled, a test runner's timeout) nor SIGKILL. So each broker
#: also gets PR_SET_PDEATHSIG=SIGKILL: the kernel kills it when its parent
#: goes, whatever the signal. The "parent" there is the *thread* that forked
#: it, so a broker started from a test's helper thread would die when that
#: thread ends: every broker is started from this one worker thread instead,
#: which lives until the interpreter shuts down (chosen over a SIGTERM
#: handler, which only runs once the main thread gets back to Python code
#: and cannot cover SIGKILL).
_DIE_WITH_PARENT = _die_with_parent()
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="felix-broker-spawner")


def _start_broker(args: List[str], env: Dict[str, str], stderr: object) -> "subprocess.Popen[bytes]":
    """Start a broker from the spawner thread (see above)."""
    return _SPAWNER.submit(
        subprocess.Popen,
        args,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        preexec_fn=_DIE_WITH_PARENT,
    ).result()


class _Node:
    """One broker process of a :class:`Cluster`: its stdout is read to the end
    by a thread of its own (so the broker never blocks writing to it), which
    notes the address it says it listens on."""

    def __init__(self, args: List[str], env: Dict[str, str], log_path: str) -> None:
        self.listening = threading.Event()
        self.output: List[str] = []
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = _start_broker(args, env, log)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.output.append(line)
            if line.startswith("felix: listening on "):
                self.listening.set()
        self.process.stdout.close()

    def wait_listening(self, deadline: float) -> None:
        while not self.listening.wait(min(0.05, max(deadline - time.monotonic(), 0))):
            if self.process.poll() is not None:
                raise RuntimeError(f"the broker exited with {self.process.returncode} before listening{self._said()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the broker did not say it listens within {_START_DEADLINE:.0f} s{self._said()}")

    def _said(self) -> str:
        """What the broker printed, for an error: its stdout and its log's end."""
        try:
            with open(self.log_path, "rb") as log:
                tail = log.read()[-2000:].decode("utf-8", "replace")
        except OSError as e:
            tail = f"(its log {self.log_path} cannot be read: {e})"
        return f"; stdout: {self.output}; log: {tail}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self._reader.join(10)


class Cluster:
    """Three brokers forming a cluster of their own (``$FELIX_TEST_BROKER``, one
    core each, ``FELIX_GROUP_MAX_ATTEMPTS=3``), on ports the OS picked, with
    data in a temporary directory removed by :meth:`stop`. Nodes are
    numbered 1 to 3; ``addrs[n - 1]`` is node ``n``'s client address. Each
    broker's log (stderr) is ``<dir>/n<N>.log``."""

    def __init__(self) -> None:
        self._binary = broker_binary()
        self.dir = tempfile.mkdtemp(prefix="felix-py-cluster-")
        ports = free_ports(6)
        #: The brokers' client addresses, node 1 first.
        self.addrs = [f"127.0.0.1:{p}" for p in ports[:3]]
        replication = [f"127.0.0.1:{p}" for p in ports[3:]]
        self._secret = os.path.join(self.dir, "cluster.secret")
        fd = os.open(self._secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("a secret for the python cluster tests\n")
        self._nodes_setting = ",".join(f"{i + 1}={self.addrs[i]}/{replication[i]}" for i in range(3))
        self._nodes: Dict[int, _Node] = {}
        # An exit that skips the cleanups (an interrupt) still stops the
        # brokers and removes the data; a signal is covered by
        # _DIE_WITH_PARENT (the data then stays in the temporary directory).
        atexit.register(self.stop)
        try:
            for node in (1, 2, 3):
                self._spawn(node)
            deadline = time.monotonic() + _START_DEADLINE
            for node in (1, 2, 3):
                self._nodes[node].wait_listening(deadline)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, node: int) -> None:
        # The brokers' settings only: none of this process's FELIX_* variables.
        env = {k: v for k, v in os.environ.items() if not k.startswith("FELIX_")}
        env.update(
            FELIX_NODE_ID=str(node),
            FELIX_CLUSTER_NODES=self._nodes_setting,
            FELIX_CLUSTER_SECRET_FILE=self._secret,
            FELIX_METRICS_LISTEN="",
            FELIX_GROUP_MAX_ATTEMPTS="3",
            RUST_LOG="warn",
        )
        data = os.path.join(self.dir, f"n{node}")
        args = [self._binary, data, self.addrs[node - 1], "1"]
        self._nodes[node] = _Node(args, env, os.path.join(self.dir, f"n{node}.log"))

    def node_of(self, addr: str) -> int:
        """The node whose client address is ``addr``."""
        return self.addrs.index(addr) + 1

    def running(self, node: int) -> bool:
        n = self._nodes.get(node)
        return n is not None and n.process.poll() is None

    def kill9(self, node: int) -> None:
        """``kill -9`` the broker of ``node``, and wait for it to be gone."""
        self._nodes[node].kill()

    def restart(self, node: int) -> None:
        """Start the broker of ``node`` again, on its data directory and ports;
        returns once it listens."""
        if self.running(node):
            raise RuntimeError(f"node {node} is running")
        self._spawn(node)
        self._nodes[node].wait_listening(time.monotonic() + _START_DEADLINE)

    def stop(self) -> None:
        """Kill every broker and remove the data (again: nothing more)."""
        for node in list(self._nodes.values()):
            node.kill()
        self._nodes.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.stop)
