'use strict';

// Tests that need no broker: the codec, key routing, and the client's
// behaviour against a scripted fake broker.

const test = require('node:test');
const assert = require('node:assert/strict');
const felix = require('../src');
const wire = require('../src/wire');
const { fakeBroker, responseFrame } = require('../test-support/fake-broker');

const { Client } = felix;

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
  const local = (err) => err instanceof felix.UnsupportedError && err.local && err.code === 'unsupported';
  await assert.rejects(client.groupPoll('t/n/s', 0, 'g', { visibilityMs: 1000 }), local);
  await assert.rejects(client.groupNackAfter('t/n/s', 0, 'g', record, 500), local);
  await assert.rejects(client.groupExtend('t/n/s', 0, 'g', record, 500), local);
  await assert.rejects(client.groupDeadLetter('t/n/s', 0, 'g', record, 'why'), local);
  await assert.rejects(client.groupDescribe('t/n/s', 0, 'g'), local);
  await assert.rejects(client.groupCreate('t/n/s', 0, 'g', 'latest'), local);
  await assert.rejects(client.publish('t/n/s', 0, 'x'), local); // ackOnCommit
  assert.equal(fake.state.requests.length, 0);
});

test('malformed bytes from the broker fail pending calls with ProtocolError and drop the socket', async (t) => {
  const answers = [
    responseFrame(0, 0x02, Buffer.alloc(0), { kind: 1 }), // wrong kind
    responseFrame(0, 0x31, Buffer.alloc(3)), // truncated body
    responseFrame(0, 0x02, Buffer.alloc(0), { len: 0xfffffff0 }), // over the frame cap
    responseFrame(0, 0x02, Buffer.alloc(0), { len: 3 }), // shorter than a header
  ];
  let next = 0;
  const fake = await fakeBroker({
    onRequest: (frame, socket) => {
      const bad = answers[next++];
      bad.writeBigUInt64LE(frame.requestId, 8);
      socket.write(bad);
    },
  });
  t.after(() => fake.close());
  const client = await Client.connect(fake.addr, { reconnectBackoffMs: 1 });
  t.after(() => client.close());
  for (let i = 0; i < answers.length; i++) {
    await assert.rejects(client.ping(), felix.ProtocolError, `answer ${i}`);
  }
  assert.equal(fake.state.connections, answers.length, 'each bad answer dropped the connection');
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
