'use strict';

// ClusterClient without a cluster: the incarnation a create chooses, the
// wire's incarnation and not_leader fields, and the retry rules against
// scripted fake brokers (a not_leader followed, a lost answer sent again
// or not, a close during a backoff or with a request out).

const test = require('node:test');
const assert = require('node:assert/strict');
const net = require('node:net');
const felix = require('../src');
const wire = require('../src/wire');
const { enoughAnswered, incarnationToCreate, showIncarnation, keepsIncarnations, retryable, Retry } = require('../src/cluster');
const { fakeBroker, answer, errorFrame, streamRefOf } = require('../test-support/fake-broker');

const {
  AlreadyExistsError, Client, ClusterClient, ConnectionError, DisconnectedError, InvalidArgumentError,
  NotLeaderError, UnavailableError, UnsupportedError,
} = felix;
const { FEATURES } = wire;

const info = (shards, incarnation) => ({
  stream: { tenant: 't', namespace: 'n', stream: 's' },
  shards,
  placement: new Array(shards).fill(0),
  incarnation,
});
const held = (...pairs) => pairs.map(([broker, i]) => ({ broker, info: i }));

/** Expect `f()` to throw AlreadyExistsError saying `says`. */
function refused(f, says) {
  assert.throws(f, (err) => err instanceof AlreadyExistsError && err.message.includes(says), says);
}

test('a create takes the incarnation a majority holds, or a new one, or refuses', () => {
  // Nobody holds it: a new one, within what a broker stores, new each time.
  const fresh = incarnationToCreate('t/n/s', 2, 3, []);
  assert.equal(typeof fresh, 'bigint');
  assert.ok(fresh >= 1n && fresh <= wire.MAX_INCARNATION);
  assert.notEqual(incarnationToCreate('t/n/s', 2, 3, []), fresh, 'a new one each time');
  // A majority agree: theirs, a stream without one included.
  assert.equal(incarnationToCreate('t/n/s', 2, 3, held(['a', info(2, 7n)], ['b', info(2, 7n)])), 7n);
  assert.equal(incarnationToCreate('t/n/s', 2, 3, held(['a', info(2, 7n)], ['b', info(2, 7n)], ['c', info(2, 7n)])), 7n);
  assert.equal(incarnationToCreate('t/n/s', 2, 3, held(['a', info(2)], ['b', info(2)])), undefined);
  // Holders that disagree, one without an incarnation included.
  refused(() => incarnationToCreate('t/n/s', 2, 3, held(['a', info(2, 7n)], ['b', info(2, 8n)])), 'not the same stream everywhere');
  refused(
    () => incarnationToCreate('t/n/s', 2, 3, held(['a', info(2, 7n)], ['b', info(2)])),
    'a holds incarnation 0x0000000000000007 and b none',
  );
  // Too few hold it: perhaps a stream the others deleted.
  refused(() => incarnationToCreate('t/n/s', 2, 3, held(['c', info(2, 7n)])), 'held by only 1 of the 3 brokers (c)');
  refused(() => incarnationToCreate('t/n/s', 2, 3, held(['c', info(2, 7n)])), 'delete it on that broker');
  refused(() => incarnationToCreate('t/n/s', 2, 4, held(['a', info(2, 7n)], ['b', info(2, 7n)])), 'only 2 of the 4 brokers (a, b)');
  refused(() => incarnationToCreate('t/n/s', 2, 4, held(['a', info(2, 7n)], ['b', info(2, 7n)])), 'delete it on those brokers');
  // Another shard count is said first.
  refused(
    () => incarnationToCreate('t/n/s', 2, 3, held(['a', info(3, 7n)], ['b', info(2, 8n)])),
    't/n/s exists on a with 3 shards, not 2',
  );
});

test('a create passes over unreached brokers only with a sure majority', () => {
  const gone = (n) => Array.from({ length: n }, (_, i) => `b${i}`);
  const ok = (total, answered, holding, n) => enoughAnswered('s', total, answered, holding, gone(n));
  assert.doesNotThrow(() => ok(3, 3, 0, 0), 'everyone answered');
  assert.doesNotThrow(() => ok(3, 2, 0, 1), 'a new stream, two of three');
  assert.doesNotThrow(() => ok(3, 2, 2, 1), 'held by a majority already');
  const unavailable = (f, says) => assert.throws(f, (err) => err instanceof UnavailableError && err.message.includes(says), says);
  unavailable(() => ok(3, 1, 0, 2), 'only 1 of the 3 brokers answered');
  unavailable(() => ok(4, 2, 0, 2), 'only 2 of the 4 brokers answered');
  // One of three holds it, one did not answer: that one may hold it too
  // (a majority: spread it) or not (a copy to keep out).
  unavailable(() => ok(3, 2, 1, 1), 'is on 1 of the 3 brokers, and b0 did not answer');
  // The whole messages, as the Rust client's.
  unavailable(
    () => ok(3, 1, 0, 2),
    'only 1 of the 3 brokers answered (b0, b1 did not): nothing created; run the same create again once more of them are back',
  );
  unavailable(
    () => ok(3, 2, 1, 1),
    's is on 1 of the 3 brokers, and b0 did not answer: nothing created; run the same create again once they are back',
  );
});

test('incarnations show as felix stream describe shows them', () => {
  assert.equal(showIncarnation(7n), '0x0000000000000007');
  assert.equal(showIncarnation(wire.MAX_INCARNATION), '0x7fffffffffffffff');
  assert.equal(showIncarnation(undefined), 'none');
});

test('a broker that does not keep incarnations is refused one, locally', () => {
  const old = { hasFeature: (bits) => (FEATURES.GROUPS & bits) === bits };
  assert.throws(() => keepsIncarnations(old, 'b:1', 7n), (err) => err instanceof UnsupportedError && err.local && /b:1 does not keep stream incarnations/.test(err.message));
  keepsIncarnations(old, 'b:1', undefined);
  keepsIncarnations({ hasFeature: () => true }, 'b:1', 7n);
});

/** A StreamInfo body, with the trailing incarnation when given. */
function streamInfo(w, path, shards, incarnation) {
  const [tenant, namespace, stream] = path.split('/');
  wire.putStreamRef(w, { tenant, namespace, stream });
  w.u32(shards);
  w.opt(undefined, w.u64);
  w.opt(undefined, w.u64);
  w.u32(shards);
  for (let i = 0; i < shards; i++) w.u32(0);
  if (incarnation !== undefined) w.u64(incarnation);
}

const body = (write) => {
  const w = new wire.Writer();
  write(w);
  return Buffer.from(w.finish());
};

test('a Stream answer carries the incarnation as a trailing field', () => {
  assert.equal(wire.decodeResponse(0x10, body((w) => streamInfo(w, 't/n/s', 2, 0x1234n))).info.incarnation, 0x1234n);
  assert.equal(wire.decodeResponse(0x10, body((w) => streamInfo(w, 't/n/s', 2))).info.incarnation, undefined);
  assert.throws(() => wire.decodeResponse(0x10, body((w) => streamInfo(w, 't/n/s', 2, 0n))), /invalid incarnation/);
  const cut = body((w) => streamInfo(w, 't/n/s', 2, 5n)).subarray(0, -3);
  assert.throws(() => wire.decodeResponse(0x10, cut), /truncated incarnation/);
});

/** A not_leader answer, naming `leader` when given. */
const notLeader = (id, leader) => answer(id, 0xff, (w) => {
  w.u16(10);
  w.str(leader ? `led by ${leader}` : 'electing');
  w.opt(undefined, w.u32);
  w.opt(leader, w.str);
});
const published = (id, base) => answer(id, 0x20, (w) => {
  w.u32(0);
  w.u64(base);
  w.u32(1);
});
const ok = (id) => answer(id, 0x03);
const ops = (fake, opcode) => fake.state.requests.filter((r) => r.opcode === opcode).length;

/** A fake broker started for the test and closed after it. */
async function fake(t, options) {
  const f = await fakeBroker(options);
  t.after(() => f.close());
  return f;
}

/** A cluster client of `fakes`, closed after the test. */
async function cluster(t, fakes, options) {
  const c = await ClusterClient.connect(fakes.map((f) => f.addr), options);
  t.after(() => c.close());
  return c;
}

/** A port nothing listens on. */
async function deadAddr() {
  return (await deadAddrs(1))[0];
}

/** `n` different ports nothing listens on (held open together while chosen). */
async function deadAddrs(n) {
  const servers = Array.from({ length: n }, () => net.createServer());
  await Promise.all(servers.map((server) => new Promise((resolve) => server.listen(0, '127.0.0.1', resolve))));
  const addrs = servers.map((server) => `127.0.0.1:${server.address().port}`);
  await Promise.all(servers.map((server) => new Promise((resolve) => server.close(resolve))));
  return addrs;
}

test('the not_leader error carries the leader the broker names', async (t) => {
  const e = felix.errorFromWire(10, 'not me', undefined, '10.0.0.2:7400');
  assert.ok(e instanceof NotLeaderError);
  assert.equal(e.leader, '10.0.0.2:7400');
  assert.equal(e.code, 'not_leader');
  const f = await fake(t, { onRequest: (frame, socket) => socket.write(notLeader(frame.requestId, '10.0.0.9:1')) });
  const c = await Client.connect(f.addr);
  t.after(() => c.close());
  await assert.rejects(c.publish('t/n/s', 0, 'x'), (err) => err instanceof NotLeaderError && err.leader === '10.0.0.9:1');
});

test('connect: addresses checked, each once, trimmed; at least one must answer', async (t) => {
  await assert.rejects(ClusterClient.connect([]), (err) => err instanceof InvalidArgumentError && /at least one broker/.test(err.message));
  await assert.rejects(ClusterClient.connect(42), InvalidArgumentError);
  await assert.rejects(ClusterClient.connect('nope'), InvalidArgumentError);
  await assert.rejects(ClusterClient.connect(['nope']), InvalidArgumentError);
  await assert.rejects(ClusterClient.connect(['a:1'], { requestTimeout: 1 }), InvalidArgumentError);
  const a = await fake(t, {});
  const dead = await deadAddr();
  const c = await ClusterClient.connect([dead, ` ${a.addr} `, a.addr, `${dead} `]);
  t.after(() => c.close());
  assert.deepEqual(c.brokers, [dead, a.addr]);
  // A broker that cannot name its cluster (no CLUSTER_INFO): the brokers given are its members.
  assert.deepEqual(c.members, [dead, a.addr]);
  assert.equal(ops(a, 0x16), 0, 'not asked');
  // One address needs no array.
  const one = await ClusterClient.connect(` ${a.addr}`);
  t.after(() => one.close());
  assert.deepEqual(one.brokers, [a.addr]);
  await assert.rejects(ClusterClient.connect([dead]), ConnectionError, 'none answers: the last error');
});

test('a not_leader answer naming another broker is followed, and the leader remembered', async (t) => {
  const b = await fake(t, { onRequest: (frame, socket) => socket.write(published(frame.requestId, 5n)) });
  const a = await fake(t, { onRequest: (frame, socket) => socket.write(notLeader(frame.requestId, b.addr)) });
  // Only `a` is given: `b` is reached by following.
  const c = await cluster(t, [a]);
  assert.equal(await c.publish('t/n/s', 0, 'x'), 5n);
  assert.equal(c.leaderOf('t/n/s', 0), b.addr);
  assert.equal(await c.publish('t/n/s', 0, 'y'), 5n);
  assert.deepEqual([ops(a, 0x20), ops(b, 0x20)], [1, 2], 'the second publish went to the leader at once');
  assert.equal(c.leaderOf('t/n/s', 1), undefined, 'per shard');
});

test('calls that need a broker at once share one connection attempt', async (t) => {
  const b = await fake(t, { onRequest: (frame, socket) => socket.write(published(frame.requestId, 1n)) });
  // Five shards' publishes, answered together: all five follow to `b` at once.
  const asked = [];
  const a = await fake(t, {
    onRequest: (frame, socket) => {
      asked.push(frame.requestId);
      if (asked.length === 5) socket.write(Buffer.concat(asked.map((id) => notLeader(id, b.addr))));
    },
  });
  const c = await cluster(t, [a]);
  const offsets = await Promise.all([0, 1, 2, 3, 4].map((shard) => c.publish('t/n/s', shard, 'x')));
  assert.deepEqual(offsets, [1n, 1n, 1n, 1n, 1n]);
  assert.equal(ops(b, 0x20), 5);
  assert.equal(b.state.connections, 1, 'one connection to the broker followed');
});

test('while no leader is known the next broker is tried, backing off', async (t) => {
  let electing = 2;
  const b = await fake(t, {
    onRequest: (frame, socket) => socket.write(electing-- > 0 ? notLeader(frame.requestId) : published(frame.requestId, 1n)),
  });
  const a = await fake(t, { onRequest: (frame, socket) => socket.write(notLeader(frame.requestId)) });
  const c = await cluster(t, [a, b]);
  const start = Date.now();
  assert.equal(await c.publish('t/n/s', 0, 'x'), 1n);
  // a, b, a, b, a, b: five backoffs of 25, 50, 100, 200 and 400 ms.
  assert.deepEqual([ops(a, 0x20), ops(b, 0x20)], [3, 3]);
  assert.ok(Date.now() - start >= 700, `backed off (${Date.now() - start} ms)`);
  assert.equal(c.leaderOf('t/n/s', 0), b.addr);
});

test('a publish whose answer was lost is sent again; a nack is not', async (t) => {
  const dropped = new Set();
  const a = await fake(t, {
    onRequest: (frame, socket) => {
      // The first of each kind: the connection drops with it unanswered.
      if (!dropped.has(frame.opcode)) {
        dropped.add(frame.opcode);
        socket.destroy();
        return;
      }
      socket.write(frame.opcode === 0x20 ? published(frame.requestId, 3n) : ok(frame.requestId));
    },
  });
  const c = await cluster(t, [a]);
  assert.equal(await c.publish('t/n/s', 0, 'x'), 3n, 'at least once');
  assert.equal(ops(a, 0x20), 2);
  assert.equal(c.leaderOf('t/n/s', 0), a.addr);
  await assert.rejects(c.groupNack('t/n/s', 0, 'g', { offset: 3n, attempts: 1 }), DisconnectedError);
  assert.equal(ops(a, 0x32), 1, 'a nack whose answer was lost is not sent again');
  assert.equal(c.leaderOf('t/n/s', 0), undefined, 'the leader is forgotten');
  // The next call connects anew.
  await c.groupNack('t/n/s', 0, 'g', { offset: 3n, attempts: 1 });
  assert.equal(ops(a, 0x32), 2);
});

test('unavailable: a publish is sent again, a seek is not', async (t) => {
  const unavailable = new Set();
  const a = await fake(t, {
    onRequest: (frame, socket) => {
      if (!unavailable.has(frame.opcode)) {
        unavailable.add(frame.opcode);
        socket.write(errorFrame(frame.requestId, 7, 'not committed within 10 s'));
        return;
      }
      socket.write(frame.opcode === 0x20 ? published(frame.requestId, 9n) : ok(frame.requestId));
    },
  });
  const c = await cluster(t, [a]);
  assert.equal(await c.publish('t/n/s', 0, 'x'), 9n);
  assert.equal(ops(a, 0x20), 2);
  await assert.rejects(c.groupSeek('t/n/s', 0, 'g', 'latest'), UnavailableError);
  assert.equal(ops(a, 0x41), 1);
});

test('a read is answered by any broker, which is not remembered as the leader', async (t) => {
  const a = await fake(t, {
    onRequest: (frame, socket) => socket.write(answer(frame.requestId, 0x21, (w) => {
      w.u64(0n);
      w.u64(0n);
      w.u64(0n);
      w.u32(0);
    })),
  });
  const c = await cluster(t, [a]);
  assert.deepEqual((await c.read('t/n/s', 0, 'earliest')).records, []);
  assert.equal(c.leaderOf('t/n/s', 0), undefined);
});

test('close() ends a call that is backing off', async (t) => {
  const a = await fake(t, { onRequest: (frame, socket) => socket.write(notLeader(frame.requestId)) });
  const c = await cluster(t, [a]);
  const call = c.publish('t/n/s', 0, 'x');
  await new Promise((resolve) => setTimeout(resolve, 100));
  const start = Date.now();
  c.close();
  await assert.rejects(call, DisconnectedError);
  assert.ok(Date.now() - start < 100, 'at once');
  await assert.rejects(c.publish('t/n/s', 0, 'x'), DisconnectedError, 'closed');
});

test('close() ends a call whose request is out at once, leaving no timer behind', async (t) => {
  // Five "no leader" answers (backoffs of 25 to 400 ms: the next would be
  // 500 ms), then the publish is left unanswered: close() lands while it is out.
  let sent;
  const out = new Promise((resolve) => { sent = resolve; });
  let electing = 5;
  const a = await fake(t, {
    onRequest: (frame, socket) => {
      if (electing-- > 0) socket.write(notLeader(frame.requestId));
      else sent();
    },
  });
  const c = await cluster(t, [a]);
  const call = c.publish('t/n/s', 0, 'x');
  // Its failure is awaited below, not unhandled meanwhile.
  call.catch(() => {});
  await out;
  assert.equal(ops(a, 0x20), 6);
  const start = Date.now();
  c.close();
  // Once what close() set off has run, nothing waits on a timer (a
  // backoff started after close() would, keeping the process alive).
  await new Promise((resolve) => setImmediate(resolve));
  const timers = process.getActiveResourcesInfo().filter((k) => k === 'Timeout');
  assert.deepEqual(timers, [], 'no timer left to keep the process alive');
  await assert.rejects(call, (err) => err instanceof DisconnectedError && /closed/.test(err.message));
  const took = Date.now() - start;
  assert.ok(took < 200, `rejected ${took} ms after close()`);
  assert.equal(ops(a, 0x20), 6, 'not sent again');
});

/**
 * A fake broker of a cluster for creates: holds `holds` (an incarnation,
 * `null` for one without, or nothing). `stream.cluster(requestId)`, when
 * set, answers DescribeCluster.
 */
async function streamBroker(t, features, holds) {
  const state = { holds, creates: [] };
  const f = await fake(t, {
    features,
    onRequest: (frame, socket) => {
      if (frame.opcode === 0x16 && state.cluster) {
        socket.write(state.cluster(frame.requestId));
        return;
      }
      const { path, rest } = streamRefOf(frame.body);
      if (frame.opcode === 0x11) {
        if (state.holds === undefined) socket.write(errorFrame(frame.requestId, 2, `${path} not found`));
        else socket.write(answer(frame.requestId, 0x10, (w) => streamInfo(w, path, 2, state.holds ?? undefined)));
      } else if (frame.opcode === 0x10) {
        // shards u32, two opt<u64> (absent here), then the trailing incarnation.
        const trailing = frame.body.length - (rest + 6);
        const incarnation = trailing === 8 ? frame.body.readBigUInt64LE(rest + 6) : undefined;
        state.creates.push(incarnation);
        state.holds = incarnation ?? null;
        socket.write(answer(frame.requestId, 0x10, (w) => streamInfo(w, path, 2, incarnation)));
      } else {
        assert.fail(`unexpected opcode ${frame.opcode}`);
      }
    },
  });
  return Object.assign(f, { stream: state });
}

const ALL = 0xff;

test('createStream: one new incarnation on every broker, sent as the trailing field', async (t) => {
  const brokers = [await streamBroker(t, ALL), await streamBroker(t, ALL), await streamBroker(t, ALL)];
  const c = await cluster(t, brokers);
  const made = await c.createStream('t/n/s', 2);
  const [i] = brokers[0].stream.creates;
  assert.equal(typeof i, 'bigint');
  assert.deepEqual(brokers.map((b) => b.stream.creates), [[i], [i], [i]]);
  assert.equal(made.incarnation, i);
  // Run again: every broker holds it; nothing is created.
  await c.createStream('t/n/s', 2);
  assert.deepEqual(brokers.map((b) => b.stream.creates.length), [1, 1, 1]);
});

test('createStream: the brokers that lack it get the majority\'s incarnation', async (t) => {
  const brokers = [await streamBroker(t, ALL, 42n), await streamBroker(t, ALL), await streamBroker(t, ALL, 42n)];
  const c = await cluster(t, brokers);
  await c.createStream('t/n/s', 2);
  assert.deepEqual(brokers.map((b) => b.stream.creates), [[], [42n], []]);
});

test('createStream: nothing is created where a broker does not keep incarnations', async (t) => {
  const brokers = [await streamBroker(t, ALL), await streamBroker(t, ALL & ~FEATURES.STREAM_INCARNATION)];
  const c = await cluster(t, brokers);
  await assert.rejects(c.createStream('t/n/s', 2), (err) => err instanceof UnsupportedError
    && err.local && err.message.includes(`${brokers[1].addr} does not keep stream incarnations`));
  assert.deepEqual(brokers.map((b) => b.stream.creates), [[], []]);
  // A plain client refuses to send one, too.
  const plain = await Client.connect(brokers[1].addr);
  t.after(() => plain.close());
  await assert.rejects(plain.createStream('t/n/s', 2, { incarnation: 7n }), (err) => err instanceof UnsupportedError && err.local);
  await assert.rejects(plain.createStream('t/n/s', 2, { incarnation: 1n << 63n }), InvalidArgumentError);
  assert.deepEqual(brokers[1].stream.creates, []);
  // Without one, as before incarnations.
  await plain.createStream('t/n/s', 2);
  assert.deepEqual(brokers[1].stream.creates, [undefined]);
});

/** A Cluster answer: the answering broker's `node`, then `[node, addr]` members. */
const clusterAnswer = (id, node, members) => answer(id, 0x14, (w) => {
  w.u64(node);
  w.u32(members.length);
  for (const [n, addr] of members) {
    w.u64(n);
    w.str(addr);
  }
});
const WITH_CLUSTER = ALL | FEATURES.CLUSTER_INFO;

test('connect: the one broker given names the cluster; a create goes to every broker of it', async (t) => {
  const brokers = [];
  for (let i = 0; i < 3; i++) brokers.push(await streamBroker(t, WITH_CLUSTER));
  const members = brokers.map((b, i) => [BigInt(i + 1), b.addr]);
  for (const [i, b] of brokers.entries()) b.stream.cluster = (id) => clusterAnswer(id, BigInt(i + 1), members);
  const c = await cluster(t, [brokers[1]]);
  assert.deepEqual(c.members, brokers.map((b) => b.addr), 'in node order');
  assert.deepEqual(c.brokers, [brokers[1].addr, brokers[0].addr, brokers[2].addr], 'the one given first');
  assert.deepEqual(brokers.map((b) => ops(b, 0x16)), [0, 1, 0], 'the first broker reached is asked, once');
  assert.equal(brokers[1].state.requests[0].body.length, 0);

  const made = await c.createStream('t/n/s', 2);
  const [i] = brokers[0].stream.creates;
  assert.equal(typeof i, 'bigint');
  assert.deepEqual(brokers.map((b) => b.stream.creates), [[i], [i], [i]], 'on all three, as one incarnation');
  assert.equal(made.incarnation, i);
  // Two of three hold it, the third lost it: counted over the cluster, not the one given.
  brokers[2].stream.holds = undefined;
  await c.createStream('t/n/s', 2);
  assert.deepEqual(brokers.map((b) => b.stream.creates), [[i], [i], [i, i]]);
});

test('connect: a broker that fails to name its cluster is passed over for the next one given', async (t) => {
  const named = await streamBroker(t, WITH_CLUSTER);
  const failing = await streamBroker(t, WITH_CLUSTER);
  failing.stream.cluster = (id) => errorFrame(id, 11, 'cannot say');
  const lying = await streamBroker(t, WITH_CLUSTER);
  lying.stream.cluster = (id) => clusterAnswer(id, 1n, [[1n, 'nope']]);
  const empty = await streamBroker(t, WITH_CLUSTER);
  empty.stream.cluster = (id) => clusterAnswer(id, 1n, []);
  // It names itself and a broker not given (twice: counted once).
  named.stream.cluster = (id) => clusterAnswer(id, 2n, [[1n, failing.addr], [2n, named.addr], [3n, '127.0.0.1:1'], [3n, '127.0.0.1:1']]);

  const c = await cluster(t, [failing, lying, empty, named]);
  assert.deepEqual(c.members, [failing.addr, named.addr, '127.0.0.1:1']);
  assert.deepEqual(c.brokers, [failing.addr, lying.addr, empty.addr, named.addr, '127.0.0.1:1']);
  assert.deepEqual([failing, lying, empty, named].map((b) => ops(b, 0x16)), [1, 1, 1, 1]);
  // The clients of those passed over are closed.
  await new Promise((resolve) => setTimeout(resolve, 50));
  assert.deepEqual([failing, lying, empty].map((b) => b.state.sockets.size), [0, 0, 0]);

  await assert.rejects(ClusterClient.connect([lying.addr]), (err) => err instanceof felix.ProtocolError && /node 1 of its cluster at "nope"/.test(err.message));
  await assert.rejects(ClusterClient.connect([empty.addr]), (err) => err instanceof felix.ProtocolError && /named no broker/.test(err.message));
  await assert.rejects(ClusterClient.connect([failing.addr]), (err) => err instanceof felix.InternalError && /cannot say/.test(err.message));
});

/** A broker that accepts connections and closes them before answering HELLO. */
async function closingAddr(t) {
  const server = net.createServer((socket) => socket.destroy());
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  t.after(() => new Promise((resolve) => server.close(resolve)));
  return `127.0.0.1:${server.address().port}`;
}

test('createStream: a broker not reached is passed over, and named', async (t) => {
  const brokers = [await streamBroker(t, ALL), await streamBroker(t, ALL)];
  const dead = await deadAddr();
  const c = await ClusterClient.connect([...brokers.map((b) => b.addr), dead]);
  t.after(() => c.close());
  assert.deepEqual(c.members, [...brokers.map((b) => b.addr), dead]);
  await assert.rejects(c.createStream('t/n/s', 2), (err) => err instanceof UnavailableError
    && err.message.startsWith(`t/n/s was created on the other brokers, not on ${dead} (cannot connect to ${dead}: `)
    && err.message.endsWith(': run the same create again once it is back'));
  const [i] = brokers[0].stream.creates;
  assert.equal(typeof i, 'bigint');
  assert.deepEqual(brokers.map((b) => b.stream.creates), [[i], [i]], 'on the other two, as one incarnation');
  // Run again while it is still away: the two hold it, nothing more is made.
  await assert.rejects(c.createStream('t/n/s', 2), (err) => err instanceof UnavailableError && err.message.includes(dead));
  assert.deepEqual(brokers.map((b) => b.stream.creates), [[i], [i]]);
});

test('createStream: a broker that closes the connection during HELLO is named', async (t) => {
  const brokers = [await streamBroker(t, ALL), await streamBroker(t, ALL)];
  const closing = await closingAddr(t);
  const c = await ClusterClient.connect([...brokers.map((b) => b.addr), closing]);
  t.after(() => c.close());
  await assert.rejects(c.createStream('t/n/s', 2), (err) => err instanceof UnavailableError
    && err.message.includes(`not on ${closing} (cannot connect to ${closing}: the broker closed the connection during HELLO)`));
  assert.deepEqual(brokers.map((b) => b.stream.creates.length), [1, 1]);
});

test('createStream: nothing is made without a sure majority', async (t) => {
  // Two of three not reached: nothing sent to the one that answered.
  const a = await streamBroker(t, ALL);
  const [dead1, dead2] = await deadAddrs(2);
  const c = await ClusterClient.connect([a.addr, dead1, dead2]);
  t.after(() => c.close());
  await assert.rejects(c.createStream('t/n/s', 2), (err) => err instanceof UnavailableError
    && err.message.startsWith(`only 1 of the 3 brokers answered (${dead1} (cannot connect to ${dead1}: `)
    && err.message.includes(`${dead2} (cannot connect to ${dead2}: `)
    && err.message.endsWith(' did not): nothing created; run the same create again once more of them are back'));
  assert.deepEqual(a.stream.creates, []);
  assert.equal(ops(a, 0x10), 0, 'no create sent');

  // One of three holds it, one lacks it, one not reached: whether the
  // holders are a majority turns on the third.
  const holds = await streamBroker(t, ALL, 42n);
  const lacks = await streamBroker(t, ALL);
  const d = await ClusterClient.connect([holds.addr, lacks.addr, dead1]);
  t.after(() => d.close());
  await assert.rejects(d.createStream('t/n/s', 2), (err) => err instanceof UnavailableError
    && err.message.startsWith(`t/n/s is on 1 of the 3 brokers, and ${dead1} (`)
    && err.message.endsWith(' did not answer: nothing created; run the same create again once they are back'));
  assert.deepEqual([holds, lacks].map((b) => ops(b, 0x10)), [0, 0]);
});

test('a call that must not run twice is tried again only where it did nothing', () => {
  const refused = felix.errorFromWire(7, 'stopping', undefined, undefined, true);
  const unknown = felix.errorFromWire(7, 'not committed in time');
  const nothingThere = felix.errorFromWire(2, 'no such shard', undefined, undefined, true);
  for (const [err, mustNotRunTwice, mayRunTwice] of [[refused, true, true], [unknown, false, true], [nothingThere, false, false]]) {
    assert.equal(retryable(err, Retry.REFUSED), mustNotRunTwice, err.message);
    assert.equal(retryable(err, Retry.LOST), mayRunTwice, err.message);
  }
});

test('deleteStream: done on some brokers names them and is not "nothing done"', async (t) => {
  const member = (refuses) => fake(t, {
    features: ALL | FEATURES.ERROR_NOT_APPLIED,
    onRequest: (frame, socket) => {
      if (frame.opcode === 0x13 && !refuses) {
        socket.write(ok(frame.requestId));
        return;
      }
      // Unavailable, marked as having done nothing.
      socket.write(answer(frame.requestId, 0xff, (w) => {
        w.u16(7);
        w.str('stopping');
        w.opt(undefined, w.u32);
        w.u8(1);
      }));
    },
  });
  const [a, b, c] = [await member(false), await member(true), await member(false)];
  const cc = await cluster(t, [a, b, c]);
  await assert.rejects(cc.deleteStream('t/n/s'), (err) => err instanceof UnavailableError
    && err.notApplied === false
    && err.message.includes(`(broker ${b.addr}; deleted on ${a.addr}, ${c.addr})`));
  // Refused everywhere: nothing done, and it says so.
  const only = await cluster(t, [b]);
  await assert.rejects(only.deleteStream('t/n/s'), (err) => err instanceof UnavailableError
    && err.notApplied === true && err.message.includes('deleted on no broker'));
});
