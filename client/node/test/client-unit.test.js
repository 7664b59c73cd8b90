'use strict';

// Tests that need no broker: the codec, key routing, and the client's
// behaviour against a scripted fake broker.

const test = require('node:test');
const assert = require('node:assert/strict');
const felix = require('../src');
const wire = require('../src/wire');
const { fakeBroker, responseFrame, answer } = require('../test-support/fake-broker');

const { Client } = felix;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
/** Settles within `ms`? Resolves to 'pending' if not. */
const within = (p, ms) => Promise.race([p.then(() => 'resolved', () => 'rejected'), sleep(ms).then(() => 'pending')]);
/** Writes a StreamInfo of `path` with `placement`. */
const putStreamInfo = (w, path, placement, retention = [undefined, undefined]) => {
  const [tenant, namespace, stream] = path.split('/');
  wire.putStreamRef(w, { tenant, namespace, stream });
  w.u32(placement.length);
  w.opt(retention[0], w.u64);
  w.opt(retention[1], w.u64);
  w.u32(placement.length);
  for (const c of placement) w.u32(c);
};

test('crc32c and shardForKey match the protocol', () => {
  assert.equal(felix.crc32c(Buffer.from('123456789')), 0xe3069283);
  assert.equal(felix.crc32c(Buffer.alloc(0)), 0);
  assert.equal(felix.shardForKey('123456789', 7), 0xe3069283 % 7);
  assert.equal(felix.shardForKey(Buffer.from('x'), 0), 0);
});

test('the frame parser reassembles frames fed a byte at a time', () => {
  const ping = responseFrame(9, 0x02);
  const ok = responseFrame(10, 0x03);
  const parser = new wire.FrameParser(1024);
  const frames = [];
  for (const b of Buffer.concat([ping, ok])) frames.push(...parser.push(Buffer.from([b])));
  assert.deepEqual(frames.map((f) => [f.requestId, f.opcode]), [[9n, 0x02], [10n, 0x03]]);
});

test('the frame parser refuses an oversized or undersized length before buffering', () => {
  const header = Buffer.alloc(4);
  header.writeUInt32LE(2048);
  assert.throws(() => new wire.FrameParser(1024).push(header), wire.DecodeError);
  header.writeUInt32LE(11);
  assert.throws(() => new wire.FrameParser(1024).push(header), wire.DecodeError);
});

test('the decoder refuses bad presence bytes, trailing bytes and lying counts', () => {
  // Extended with a trailing byte.
  assert.throws(() => wire.decodeResponse(0x31, Buffer.alloc(9)), /trailing/);
  // Groups claiming 1e9 names in 4 bytes.
  const lying = Buffer.alloc(4);
  lying.writeUInt32LE(1e9);
  assert.throws(() => wire.decodeResponse(0x41, lying), /truncated/);
  // DeadLetterPage with next's presence byte 2.
  const page = Buffer.from([0, 0, 0, 0, 2]);
  assert.throws(() => wire.decodeResponse(0x33, page), /invalid next/);
  assert.throws(() => wire.decodeResponse(0x77, Buffer.alloc(0)), /unknown response opcode/);
});

test('an unknown error code becomes InternalError keeping the number', () => {
  const err = felix.errorFromWire(4242, 'from the future');
  assert.ok(err instanceof felix.InternalError);
  assert.equal(err.code, 'internal');
  assert.equal(err.wireCode, 4242);
  assert.match(err.message, /4242/);
});

test('an error says not_applied only in its trailing byte', () => {
  const message = Buffer.from('disk nearly full');
  const body = Buffer.concat([Buffer.from([7, 0, message.length, 0]), message, Buffer.from([0])]);
  const plain = wire.decodeResponse(0xff, body);
  assert.equal(plain.notApplied, undefined);
  assert.equal(felix.errorFromWire(plain.code, plain.message, plain.core, plain.leader, plain.notApplied).notApplied, false);
  const refused = wire.decodeResponse(0xff, Buffer.concat([body, Buffer.from([1])]));
  const err = felix.errorFromWire(refused.code, refused.message, refused.core, refused.leader, refused.notApplied);
  assert.ok(err instanceof felix.UnavailableError);
  assert.equal(err.notApplied, true);
  for (const tail of [[0], [2], [1, 1]]) {
    assert.throws(() => wire.decodeResponse(0xff, Buffer.concat([body, Buffer.from(tail)])), /not_applied|trailing/);
  }
  // not_leader: as the broker says (a publish's is flagged).
  assert.equal(felix.errorFromWire(10, 'deposed').notApplied, false);
  assert.equal(felix.errorFromWire(10, 'deposed', undefined, undefined, true).notApplied, true);
  assert.equal(new felix.InvalidArgumentError('bad').notApplied, true);
  // A connection that never opened sent nothing.
  assert.equal(new felix.ConnectionError('cannot connect').notApplied, true);
  assert.equal(new felix.DisconnectedError('lost').notApplied, false);
});

test('a stream-wide call done on some shards is never "nothing done"', () => {
  const { settle } = require('../src/stream_groups');
  const nothing = () => ({ ok: false, err: felix.errorFromWire(7, 'stopping', undefined, undefined, true) });
  assert.throws(() => settle([nothing(), nothing()]), (err) => err.notApplied === true && /done on no shard/.test(err.message));
  assert.throws(
    () => settle([{ ok: true }, nothing()]),
    (err) => err.notApplied === false && /\(shard 1; done on shard\(s\) 0\)/.test(err.message),
  );
});

test('arguments are checked before anything is sent', async (t) => {
  const fake = await fakeBroker({ onRequest: () => assert.fail('nothing should be sent') });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr);
  t.after(() => client.close());
  const s = 't/n/s';
  await assert.rejects(client.publish('t/n', 0, 'x'), felix.InvalidArgumentError);
  await assert.rejects(client.publish(s, -1, 'x'), felix.InvalidArgumentError);
  await assert.rejects(client.publishBatch(s, 0, []), felix.InvalidArgumentError);
  await assert.rejects(client.read(s, 0, -5), felix.InvalidArgumentError);
  await assert.rejects(client.read(s, 0, 1.5), felix.InvalidArgumentError);
  await assert.rejects(client.read(s, 0, 1n << 64n), felix.InvalidArgumentError);
  await assert.rejects(client.groupPoll(s, 0, 'g', { consumer: '' }), felix.InvalidArgumentError);
  await assert.rejects(client.groupPoll(s, 0, 'g', { consumer: 'x'.repeat(129) }), felix.InvalidArgumentError);
  await assert.rejects(client.groupExtend(s, 0, 'g', { offset: 0n, attempts: 1 }, 0), felix.InvalidArgumentError);
  await assert.rejects(client.createStream(s, 0), felix.InvalidArgumentError);
  // A misspelled option is refused, not left at its default.
  const typo = /unknown .*option key "maxRecord"/;
  await assert.rejects(client.groupPoll(s, 0, 'g', { maxRecord: 5 }), typo);
  await assert.rejects(client.read(s, 0, 0n, { maxRecord: 5 }), typo);
  await assert.rejects(client.createStream(s, 1, { retentionByte: 5 }), /unknown createStream option key "retentionByte"/);
  const claim = { offset: 0n, attempts: 1 };
  await assert.rejects(client.groupNack(s, 0, 'g', claim, { delay: 5 }), /unknown groupNack option key "delay"/);
  await assert.rejects(client.groupNackAfter(s, 0, 'g', claim, 5, { delayMs: 9 }), /unknown groupNackAfter option key "delayMs"/);
  assert.throws(() => client.subscribe(s, 0, 0n, { wait: 5 }), /unknown subscribe option key "wait"/);
  assert.equal(fake.state.requests.length, 0);
});

test('a field the broker did not advertise is refused locally with UnsupportedError', async (t) => {
  const fake = await fakeBroker({
    features: wire.FEATURES.GROUPS, // no claim control, admin, ack mode
    onRequest: () => assert.fail('nothing should be sent'),
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { ackOnCommit: true });
  t.after(() => client.close());
  assert.equal(client.features, wire.FEATURES.GROUPS);
  const record = { offset: 0n, attempts: 1 };
  const local = (err) => err instanceof felix.UnsupportedError && err.local && err.code === 'unsupported' && err.wireCode === undefined;
  await assert.rejects(client.groupPoll('t/n/s', 0, 'g', { visibilityMs: 1000 }), local);
  await assert.rejects(client.groupNackAfter('t/n/s', 0, 'g', record, 500), local);
  await assert.rejects(client.groupExtend('t/n/s', 0, 'g', record, 500), local);
  await assert.rejects(client.groupDeadLetter('t/n/s', 0, 'g', record, 'why'), local);
  await assert.rejects(client.groupDescribe('t/n/s', 0, 'g'), local);
  await assert.rejects(client.groupCreate('t/n/s', 0, 'g', 'latest'), local);
  await assert.rejects(client.publish('t/n/s', 0, 'x'), local); // ackOnCommit
  await assert.rejects(client.describeCluster(), (err) => local(err) && /describeCluster needs FEATURE_CLUSTER_INFO/.test(err.message));
  assert.equal(fake.state.requests.length, 0);
});

test('a bad answer body fails only its call; a broken frame header drops the connection', async (t) => {
  const answers = [
    responseFrame(0, 0x02, Buffer.alloc(0), { kind: 1 }), // wrong kind
    responseFrame(0, 0x02, Buffer.alloc(0), { flags: 1 }), // flags set
    responseFrame(0, 0x31, Buffer.alloc(3)), // truncated body
    responseFrame(0, 0x77, Buffer.alloc(0)), // unknown opcode
    answer(0, 0x41, (w) => { w.u32(1); w.u16(2); w.bytes(Buffer.from([0xc3, 0x28])); }), // invalid UTF-8
    responseFrame(0, 0x02, Buffer.alloc(0), { len: 0xfffffff0 }), // over the frame cap
    responseFrame(0, 0x02, Buffer.alloc(0), { len: 3 }), // shorter than a header
    responseFrame(0, 0x02, Buffer.alloc(0), { len: 3 }),
  ];
  let next = 0;
  let good = false;
  const fake = await fakeBroker({
    onRequest: (frame, socket) => {
      if (good) {
        socket.write(responseFrame(frame.requestId, 0x02));
        return;
      }
      const bad = answers[next++];
      bad.writeBigUInt64LE(frame.requestId, 8);
      socket.write(bad);
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { reconnectBackoffMs: 1 });
  t.after(() => client.close());
  for (let i = 0; i < 5; i++) await assert.rejects(client.ping(), felix.ProtocolError, `answer ${i}`);
  assert.equal(fake.state.connections, 1, 'a bad body keeps the connection');
  good = true;
  assert.equal(typeof (await client.ping()), 'number', 'still usable');
  good = false;
  for (let i = 5; i < 7; i++) await assert.rejects(client.ping(), felix.ProtocolError, `answer ${i}`);
  await assert.rejects(client.ping(), felix.ProtocolError, 'answer 7 (on a third connection)');
  assert.equal(fake.state.connections, 3, 'each broken header dropped the connection');
});

test('a late answer after a timeout is ignored', async (t) => {
  const fake = await fakeBroker({
    onRequest: (frame, socket, state) => {
      // The first request is answered late; later ones at once.
      const delay = state.requests.length === 1 ? 150 : 0;
      setTimeout(() => socket.write(responseFrame(frame.requestId, 0x02)), delay);
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { requestTimeoutMs: 50 });
  t.after(() => client.close());
  await assert.rejects(client.ping(), felix.TimeoutError);
  await sleep(150); // the late answer arrives
  assert.equal(typeof (await client.ping()), 'number');
  assert.equal(fake.state.connections, 1, 'the late answer did not drop the connection');
});

test('invalid UTF-8 from the broker is a ProtocolError; a leading BOM is kept', () => {
  const names = (bytes) => {
    const w = new wire.Writer();
    w.u32(1);
    w.u16(bytes.length);
    w.bytes(Buffer.from(bytes));
    return Buffer.from(w.finish());
  };
  assert.deepEqual(wire.decodeResponse(0x41, names([0xef, 0xbb, 0xbf, 0x61])).names, ['\ufeffa']);
  assert.throws(() => wire.decodeResponse(0x41, names([0xff])), /not valid UTF-8/);
});

test('a frame of many empty elements shares one empty buffer and is bounded by its bytes', () => {
  // One record carrying 100,000 empty headers (6 bytes each on the wire).
  const w = new wire.Writer(700_000);
  w.u64(0n); w.u64(0n); w.u64(1n); // start, next, end
  w.u32(1);
  w.u64(0n); w.u64(0n); w.u8(0);
  w.u32(100_000);
  for (let i = 0; i < 100_000; i++) { w.u16(0); w.u32(0); }
  w.u32(0); // payload
  const { records } = wire.decodeResponse(0x21, Buffer.from(w.finish()));
  const [record] = records;
  assert.equal(record.headers.length, 100_000);
  const values = new Set(record.headers.map(([, v]) => v));
  values.add(record.payload);
  assert.equal(values.size, 1, 'every empty blob is the same buffer');
  // A count the remaining bytes cannot hold fails before allocating.
  const lying = Buffer.alloc(8 * 3 + 4 + 25 * 10);
  lying.writeUInt32LE(11, 24); // 11 records of at least 25 bytes in 250 bytes
  assert.throws(() => wire.decodeResponse(0x21, lying), /truncated records/);
});

test('retention limits decode as bigints, past 2^53 exactly', () => {
  const big = (1n << 64n) - 1n;
  const w = new wire.Writer();
  putStreamInfo(w, 't/n/s', [0], [big, (1n << 53n) + 1n]);
  const { info } = wire.decodeResponse(0x10, Buffer.from(w.finish()));
  assert.equal(info.retentionBytes, big);
  assert.equal(info.retentionMs, (1n << 53n) + 1n);
});

test('a dropped connection rejects in-flight calls with DisconnectedError and the next call reconnects', async (t) => {
  const fake = await fakeBroker({
    onRequest: (frame, socket, state) => {
      if (state.connections === 1) socket.destroy();
      else socket.write(responseFrame(frame.requestId, 0x02));
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { reconnectBackoffMs: 10 });
  t.after(() => client.close());
  const results = await Promise.allSettled([client.ping(), client.ping()]);
  for (const r of results) assert.ok(r.reason instanceof felix.DisconnectedError, String(r.reason));
  assert.equal(typeof (await client.ping()), 'number');
  assert.equal(fake.state.connections, 2);
});

test('an unanswered request times out with TimeoutError', async (t) => {
  const fake = await fakeBroker({ onRequest: () => {} });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { requestTimeoutMs: 100 });
  t.after(() => client.close());
  await assert.rejects(client.ping(), felix.TimeoutError);
});

test('close() rejects calls in flight with DisconnectedError', async (t) => {
  const fake = await fakeBroker({ onRequest: () => {} });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr);
  const pending = client.ping();
  client.close();
  await assert.rejects(pending, felix.DisconnectedError);
  await assert.rejects(client.ping(), felix.DisconnectedError);
});

test('connecting to nothing fails with ConnectionError', async () => {
  const fake = await fakeBroker({ onRequest: () => {} });
  const addr = fake.addr;
  await fake.close();
  await assert.rejects(Client.connect(addr), (err) => err instanceof felix.ConnectionError && err.code === 'io');
  await assert.rejects(Client.connect('no-port'), felix.InvalidArgumentError);
});

/** A TCP server answering every connection's first bytes with `reply` and closing it. */
async function answeringServer(t, reply) {
  const net = require('node:net');
  const server = net.createServer((socket) => {
    socket.on('error', () => {});
    socket.once('data', () => socket.end(reply));
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  t.after(() => new Promise((resolve) => server.close(resolve)));
  return `127.0.0.1:${server.address().port}`;
}

test('connecting to something that is not a Felix broker says so', async (t) => {
  const http = await answeringServer(t, 'HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n');
  await assert.rejects(Client.connect(http, { connectTimeoutMs: 2000 }), (err) => {
    assert.ok(err instanceof felix.ProtocolError, String(err));
    assert.equal(err.message, `not a Felix broker at ${http} (it answered HTTP: the metrics port?)`);
    return true;
  });
  const junk = await answeringServer(t, Buffer.from([0xff, 0xff, 0xff, 0x7f, 1, 2, 3, 4]));
  await assert.rejects(Client.connect(junk, { connectTimeoutMs: 2000 }), (err) => {
    assert.ok(err instanceof felix.ProtocolError, String(err));
    assert.match(err.message, new RegExp(`^not a Felix broker at ${junk}: its first answer declares a 2147483647-byte frame$`));
    return true;
  });
  // The bytes arriving one at a time change nothing.
  const net = require('node:net');
  const slow = net.createServer((socket) => {
    socket.on('error', () => {});
    socket.once('data', async () => {
      for (const b of Buffer.from('HTTP/1.0 200 OK\r\n\r\n')) {
        if (socket.destroyed) return;
        socket.write(Buffer.from([b]));
        await sleep(2);
      }
      socket.end();
    });
  });
  await new Promise((resolve) => slow.listen(0, '127.0.0.1', resolve));
  t.after(() => new Promise((resolve) => slow.close(resolve)));
  await assert.rejects(Client.connect(`127.0.0.1:${slow.address().port}`, { connectTimeoutMs: 2000 }), /it answered HTTP: the metrics port\?/);
});

test('unknown option keys are refused', async () => {
  await assert.rejects(Client.connect('127.0.0.1:1', { requestTimeout: 5 }), (err) => err instanceof felix.InvalidArgumentError && /requestTimeout/.test(err.message));
  assert.equal(felix.errorFromWire(5, 'no').wireCode, 5, 'the broker\'s unsupported keeps its wire code');
});


test('a Replica answer decodes, and an unknown role is refused', () => {
  const s = (v) => Buffer.concat([Buffer.from([v.length, 0]), Buffer.from(v)]);
  const u32 = (v) => { const b = Buffer.alloc(4); b.writeUInt32LE(v); return b; };
  const u64 = (v) => { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(v)); return b; };
  const body = (role) => Buffer.concat([
    s('t'), s('n'), s('s'), u32(3), u64(2), Buffer.from([role]), u64(7),
    Buffer.from([1]), u64(1), Buffer.from([1]), s('127.0.0.1:7400'),
    u64(40), u64(40), u64(41), u64(32), Buffer.from([0]),
    u32(1), u64(3), u64(39),
  ]);
  const msg = wire.decodeResponse(0x13, body(2));
  assert.equal(msg.type, 'replica');
  const r = msg.info;
  assert.deepEqual([r.shard, r.node, r.role, r.term], [3, 2n, 'follower', 7n]);
  assert.deepEqual([r.leader, r.leaderAddr], [1n, '127.0.0.1:7400']);
  assert.deepEqual([r.commit, r.applied, r.lastIndex, r.compacted], [40n, 40n, 41n, 32n]);
  assert.equal(r.stopped, undefined);
  assert.deepEqual(r.peers, [{ node: 3n, matched: 39n }]);
  assert.throws(() => wire.decodeResponse(0x13, body(9)), /unknown replica role/);
});

/** A Cluster answer body: the answering broker's node, then `[node, addr]` members. */
function clusterBody(node, members) {
  const w = new wire.Writer();
  w.u64(node);
  w.u32(members.length);
  for (const [n, addr] of members) {
    w.u64(n);
    w.str(addr);
  }
  return Buffer.from(w.finish());
}

test('a Cluster answer decodes; a cut, padded or lying one is refused', () => {
  const members = [[1n, '127.0.0.1:7400'], [2n, '127.0.0.1:7410'], [(1n << 64n) - 1n, '[::1]:7420']];
  const full = clusterBody(2n, members);
  assert.deepEqual(wire.decodeResponse(0x14, full), {
    type: 'cluster',
    info: { node: 2n, members: members.map(([node, addr]) => ({ node, addr })) },
  });
  assert.deepEqual(wire.decodeResponse(0x14, clusterBody(7n, [])).info, { node: 7n, members: [] });
  // Cut anywhere: within the node, the count, a member's node or its address.
  for (let n = 0; n < full.length; n++) {
    assert.throws(() => wire.decodeResponse(0x14, full.subarray(0, n)), (err) => err instanceof wire.DecodeError && /^truncated (node|members|member node|member addr)$/.test(err.message), `cut at ${n}`);
  }
  assert.throws(() => wire.decodeResponse(0x14, Buffer.concat([full, Buffer.alloc(1)])), /trailing bytes/);
  // A count the bytes left cannot hold (a member takes at least 10).
  const lying = clusterBody(2n, [[1n, '']]);
  lying.writeUInt32LE(2, 8);
  assert.throws(() => wire.decodeResponse(0x14, lying), /truncated members/);
  const many = Buffer.alloc(12);
  many.writeUInt32LE(0xffffffff, 8);
  assert.throws(() => wire.decodeResponse(0x14, many), /truncated members/);
  const badUtf8 = Buffer.concat([clusterBody(2n, []).subarray(0, 8), Buffer.from([1, 0, 0, 0]), Buffer.alloc(8), Buffer.from([1, 0, 0xff])]);
  assert.throws(() => wire.decodeResponse(0x14, badUtf8), /member addr is not valid UTF-8/);
});

test('describeCluster sends DescribeCluster (0x16, an empty body) to a broker with CLUSTER_INFO, offered in HELLO', async (t) => {
  let wrongType = false;
  const fake = await fakeBroker({
    features: 0x1ff,
    onRequest: (frame, socket) => {
      if (wrongType) socket.write(responseFrame(frame.requestId, 0x03));
      else socket.write(responseFrame(frame.requestId, 0x14, clusterBody(3n, [[1n, 'a:1'], [3n, 'c:3']])));
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr);
  t.after(() => client.close());
  assert.equal(wire.FEATURES.CLUSTER_INFO, 0x100);
  assert.equal(fake.state.offered & 0x100n, 0x100n, 'the client offers CLUSTER_INFO');
  assert.ok(client.hasFeature(felix.FEATURES.CLUSTER_INFO));
  assert.deepEqual(await client.describeCluster(), { node: 3n, members: [{ node: 1n, addr: 'a:1' }, { node: 3n, addr: 'c:3' }] });
  const [sent] = fake.state.requests;
  assert.equal(sent.opcode, 0x16);
  assert.equal(sent.body.length, 0, 'an empty body');
  wrongType = true;
  await assert.rejects(client.describeCluster(), (err) => err instanceof felix.ProtocolError && /answered describe_cluster with ok/.test(err.message));
});
