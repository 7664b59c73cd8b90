'use strict';

// Routing, reconnection, timers, backpressure and answers a real broker
// rarely gives, against a scripted fake broker (no FELIX_ADDR needed).

const test = require('node:test');
const assert = require('node:assert/strict');
const felix = require('../src');
const wire = require('../src/wire');
const { fakeBroker, responseFrame, answer, errorFrame, streamRefOf } = require('../test-support/fake-broker');

const { Client } = felix;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
/** 'resolved', 'rejected', or 'pending' if `p` has not settled within `ms`. */
const within = (p, ms) => Promise.race([p.then(() => 'resolved', () => 'rejected'), sleep(ms).then(() => 'pending')]);

function putStreamInfo(w, path, placement) {
  const [tenant, namespace, stream] = path.split('/');
  wire.putStreamRef(w, { tenant, namespace, stream });
  w.u32(placement.length);
  w.opt(undefined, w.u64);
  w.opt(undefined, w.u64);
  w.u32(placement.length);
  for (const c of placement) w.u32(c);
}

const published = (id, shard, base = 0n) => answer(id, 0x20, (w) => {
  w.u32(shard);
  w.u64(base);
  w.u32(1);
});

/** The shard a publish request names (it must name one, not a key). */
function publishShard(body) {
  const { rest } = streamRefOf(body);
  assert.equal(body[rest], 0);
  return body.readUInt32LE(rest + 1);
}

/** `from` of a read request (undefined for earliest/latest). */
function readFrom(body) {
  const { rest } = streamRefOf(body);
  return body[rest + 4] === 2 ? body.readBigUInt64LE(rest + 5) : undefined;
}

function records(id, start, next, offsets) {
  return answer(id, 0x21, (w) => {
    w.u64(start);
    w.u64(next);
    w.u64(next);
    w.u32(offsets.length);
    for (const o of offsets) {
      w.u64(o);
      w.u64(0n);
      w.u8(0);
      w.u32(0);
      w.blob(Buffer.from(`r${o}`));
    }
  });
}

test('the home core gone after a restart with fewer cores: the client moves home and re-routes', async (t) => {
  let cores = 3;
  const placement = () => (cores === 3 ? [2, 0] : [0, 1]);
  const fake = await fakeBroker({
    // As the broker: a HELLO naming a core it does not run is refused with
    // invalid_request; one naming none lands on the last core.
    onHello: (want) => {
      if (want !== undefined && want >= cores) return { error: [1, `HELLO asks for core ${want}; this broker runs cores 0..${cores}`] };
      return { cores, core: want ?? cores - 1 };
    },
    onRequest: (frame, socket) => {
      const id = frame.requestId;
      if (frame.opcode === 0x02) socket.write(responseFrame(id, 0x02));
      else if (frame.opcode === 0x11) socket.write(answer(id, 0x10, (w) => putStreamInfo(w, streamRefOf(frame.body).path, placement())));
      else if (frame.opcode === 0x20) {
        const shard = publishShard(frame.body);
        const owner = placement()[shard];
        socket.write(owner === frame.core ? published(id, shard) : errorFrame(id, 4, 'wrong core', owner));
      } else assert.fail(`unexpected opcode ${frame.opcode}`);
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { reconnectBackoffMs: 1 });
  t.after(() => client.close());
  assert.deepEqual([client.cores, client.homeCore], [3, 2]);
  assert.equal((await client.publishBatch('t/n/s', 0, ['x'])).shard, 0);
  assert.deepEqual(client.connectedCores, [2], 'shard 0 is on core 2, home');

  cores = 2; // restart with fewer cores: home (2) is gone
  fake.drop();
  await sleep(50);
  const p = await client.publishBatch('t/n/s', 0, ['y']);
  assert.equal(p.shard, 0);
  assert.deepEqual([client.cores, client.homeCore], [2, 1], 'home moved to the core it landed on');
  const publishes = fake.state.requests.filter((f) => f.opcode === 0x20);
  assert.equal(publishes.at(-1).core, 0, 'shard 0 now goes to core 0, from a fresh placement');
  assert.deepEqual(client.connectedCores, [0, 1]);
  assert.equal(typeof (await client.ping()), 'number');
  assert.ok(fake.state.hellos.includes(2), 'asked for core 2 once');
  assert.equal(fake.state.hellos.filter((h) => h === 2).length, 1, 'and did not keep asking for it');
});

test('the home core gone (1 of 2): calls go to the new home', async (t) => {
  let cores = 2;
  const fake = await fakeBroker({
    onHello: (want) => (want !== undefined && want >= cores ? { error: [1, 'no such core'] } : { cores, core: want ?? cores - 1 }),
    onRequest: (frame, socket) => socket.write(responseFrame(frame.requestId, 0x02)),
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr);
  t.after(() => client.close());
  assert.equal(client.homeCore, 1);
  cores = 1;
  fake.drop();
  await sleep(50);
  assert.equal(typeof (await client.ping()), 'number');
  assert.deepEqual([client.cores, client.homeCore], [1, 0]);
  assert.equal(typeof (await client.ping()), 'number');
});

test('wrong_core is followed to the named core even when the placement refresh fails', async (t) => {
  let describes = 0;
  const fake = await fakeBroker({
    onHello: (want) => ({ cores: 2, core: want ?? 0 }),
    onRequest: (frame, socket) => {
      const id = frame.requestId;
      if (frame.opcode === 0x11) {
        // First a stale placement (shard 1 on core 0), then a failure.
        describes++;
        if (describes === 1) socket.write(answer(id, 0x10, (w) => putStreamInfo(w, 't/n/s', [0, 0])));
        else socket.write(errorFrame(id, 11, 'disk on fire'));
      } else if (frame.opcode === 0x20) {
        const shard = publishShard(frame.body);
        socket.write(shard === 1 && frame.core !== 1 ? errorFrame(id, 4, 'wrong core', 1) : published(id, shard, 7n));
      }
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr);
  t.after(() => client.close());
  const p = await client.publishBatch('t/n/s', 1, ['x']);
  assert.deepEqual([p.shard, p.baseOffset], [1, 7n]);
  assert.deepEqual(fake.state.requests.filter((f) => f.opcode === 0x20).map((f) => f.core), [0, 1]);
  assert.equal(describes, 2, 'the refresh was tried');
});

test('timer delays past 2^31-1 ms are capped, not fired at once', async (t) => {
  const fake = await fakeBroker({ onRequest: () => {} });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { requestTimeoutMs: 2 ** 31 + 10 });
  const ping = client.ping();
  // A read's wait on top of the default timeout also passes 2^31.
  const other = await Client.connect(fake.addr);
  const read = other.read('t/n/s', 0, 'latest', { waitMs: 2 ** 32 - 1 });
  assert.equal(await within(ping, 100), 'pending');
  assert.equal(await within(read, 10), 'pending');
  client.close();
  other.close();
  await assert.rejects(ping, felix.DisconnectedError);
  await assert.rejects(read, felix.DisconnectedError);
  const hanging = await fakeBroker({ onHello: () => ({ hang: true }) });
  t.after(() => hanging.close());
  const connecting = Client.connect(hanging.addr, { connectTimeoutMs: 2 ** 40 });
  assert.equal(await within(connecting, 100), 'pending');
  hanging.drop();
  await assert.rejects(connecting, felix.ConnectionError);
});

test('close() aborts a connect in progress', async (t) => {
  let hellos = 0;
  const fake = await fakeBroker({
    onHello: () => (++hellos === 1 ? { cores: 1, core: 0 } : { hang: true }),
    onRequest: (frame, socket) => socket.write(responseFrame(frame.requestId, 0x02)),
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { connectTimeoutMs: 60_000 });
  t.after(() => client.close());
  await client.ping(); // proves the connection: the reconnect does not back off
  fake.drop();
  await sleep(50);
  const ping = client.ping(); // reconnects; the broker never answers HELLO
  await sleep(50);
  assert.equal(hellos, 2);
  assert.equal(fake.state.sockets.size, 1, 'the reconnect is waiting');
  client.close();
  assert.equal(await within(ping, 200), 'rejected');
  await assert.rejects(ping, felix.DisconnectedError);
  await sleep(50);
  assert.equal(fake.state.sockets.size, 0, 'its socket was closed');
});

test('a socket that stops draining queues requests in order until it drains', async (t) => {
  let base = 0n;
  const fake = await fakeBroker({
    onRequest: (frame, socket) => {
      if (frame.opcode === 0x02) {
        socket.write(responseFrame(frame.requestId, 0x02));
        return;
      }
      socket.write(published(frame.requestId, 0, base));
      base += 1n;
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr);
  t.after(() => client.close());
  await client.ping();
  for (const s of fake.state.sockets) s.pause(); // the broker stops reading
  const payload = Buffer.alloc(1 << 20);
  const calls = Array.from({ length: 24 }, () => client.publish('t/n/s', 0, payload));
  await sleep(100);
  assert.ok(client.queuedBytes > 0, 'requests wait in the client, not in the socket');
  for (const s of fake.state.sockets) s.resume();
  const offsets = await Promise.all(calls);
  assert.deepEqual(offsets, Array.from({ length: 24 }, (_, i) => BigInt(i)), 'sent and answered in call order');
  assert.equal(client.queuedBytes, 0);
  const ids = fake.state.requests.filter((f) => f.opcode === 0x20).map((f) => f.requestId);
  assert.deepEqual(ids, [...ids].sort((a, b) => (a < b ? -1 : 1)));
});

test('a subscription pauses after fast empty answers (waitMs 0) instead of spinning', async (t) => {
  const fake = await fakeBroker({
    onRequest: (frame, socket) => socket.write(records(frame.requestId, 0n, 0n, [])),
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr);
  t.after(() => client.close());
  const sub = client.subscribe('t/n/s', 0, 'earliest', { waitMs: 0 });
  setTimeout(() => sub.close(), 300);
  for await (const r of sub) assert.fail(`no records expected, got ${r.offset}`);
  const reads = fake.state.requests.length;
  assert.ok(reads >= 2 && reads <= 10, `${reads} reads in 300 ms`);
});

test('a subscription rejects a failed read, then reads again from the same position after a pause', async (t) => {
  const froms = [];
  const fake = await fakeBroker({
    onRequest: (frame, socket, state) => {
      froms.push(readFrom(frame.body));
      if (state.requests.length === 1) socket.write(errorFrame(frame.requestId, 7, 'shard stopped'));
      // Retention removed offsets 3 and 4 before the subscription read them.
      else socket.write(records(frame.requestId, 5n, 6n, [5n]));
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { reconnectBackoffMs: 1 });
  t.after(() => client.close());
  const sub = client.subscribe('t/n/s', 0, 3n, { waitMs: 0 });
  await assert.rejects(sub.next(), felix.UnavailableError);
  const failed = Date.now();
  const { value } = await sub.next();
  assert.ok(Date.now() - failed >= 90, 'paused at least 100 ms before reading again');
  assert.equal(value.offset, 5n);
  assert.deepEqual(froms, [3n, 3n], 'the same position again');
  assert.equal(sub.skippedByRetention, 2n);
  assert.equal(sub.position, 6n);
  sub.close();
});

test('createStream accepts ok (then describes); groupCreate and groupSeek accept a group answer', async (t) => {
  const groupInfo = (w) => {
    w.str('g');
    w.u64(0n); w.u64(0n); w.u64(0n);
    w.u32(0); w.u32(0); w.u32(0); w.u32(0);
    w.u8(0); w.u8(0); w.u8(0);
  };
  const fake = await fakeBroker({
    onRequest: (frame, socket) => {
      const id = frame.requestId;
      if (frame.opcode === 0x10) socket.write(responseFrame(id, 0x03));
      else if (frame.opcode === 0x11) socket.write(answer(id, 0x10, (w) => putStreamInfo(w, 't/n/s', [0, 0, 0])));
      else if (frame.opcode === 0x40 || frame.opcode === 0x41) socket.write(answer(id, 0x40, groupInfo));
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr);
  t.after(() => client.close());
  const info = await client.createStream('t/n/s', 3);
  assert.equal(info.shards, 3);
  await client.groupCreate('t/n/s', 0, 'g', 'earliest');
  await client.groupSeek('t/n/s', 0, 'g', 'latest');
  assert.deepEqual(fake.state.requests.map((f) => f.opcode), [0x10, 0x11, 0x40, 0x41]);
});

test('dead letters are fetched over several pages', async (t) => {
  const froms = [];
  const pages = new Map([[0n, [[0n, 1n], 2n]], [2n, [[2n, 3n], 4n]], [4n, [[4n], undefined]]]);
  const fake = await fakeBroker({
    onRequest: (frame, socket) => {
      assert.equal(frame.opcode, 0x38);
      const { rest } = streamRefOf(frame.body);
      const groupLen = frame.body.readUInt16LE(rest + 4);
      const from = frame.body.readBigUInt64LE(rest + 6 + groupLen);
      froms.push(from);
      const [offsets, next] = pages.get(from);
      socket.write(answer(frame.requestId, 0x33, (w) => {
        w.u32(offsets.length);
        for (const o of offsets) {
          w.u64(o); w.u32(3); w.u64(1000n); w.opt(`r${o}`, w.str); w.bool(false);
        }
        w.opt(next, w.u64);
      }));
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr);
  t.after(() => client.close());
  assert.deepEqual(await client.groupDeadLetters('t/n/s', 0, 'g'), [0n, 1n, 2n, 3n, 4n]);
  assert.deepEqual(froms, [0n, 2n, 4n]);
});

test('skippedBefore is cleared unless FEATURES.GROUP_SKIPPED was negotiated', async (t) => {
  const poll = (id) => answer(id, 0x30, (w) => {
    w.u32(1);
    w.u64(4n); w.u32(1); w.u64(0n); w.u8(0); w.u32(0); w.blob(Buffer.from('x'));
    w.opt(3n, w.u64);
  });
  for (const [features, expected] of [[felix.FEATURES.GROUPS, undefined], [felix.FEATURES.GROUPS | felix.FEATURES.GROUP_SKIPPED, 3n]]) {
    const fake = await fakeBroker({ features, onRequest: (frame, socket) => socket.write(poll(frame.requestId)) });
    t.after(() => fake.close());
    const client = await Client.connect(fake.addr);
    t.after(() => client.close());
    const [r] = await client.groupPoll('t/n/s', 0, 'g');
    assert.equal(r.offset, 4n);
    assert.equal(r.skippedBefore, expected, `features 0x${features.toString(16)}`);
  }
});
