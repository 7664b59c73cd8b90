'use strict';

// Streams, publishing and reading against a real broker (FELIX_ADDR).

const test = require('node:test');
const assert = require('node:assert/strict');
const felix = require('../src');
const { ADDR, connect, freshStream, sleep } = require('../test-support/helpers');

test('publish and read round trip on every shard, in offset order, over both cores', async (t) => {
  const client = await connect(t);
  const stream = freshStream();
  const info = await client.createStream(stream, 4, { retentionBytes: 1 << 30, retentionMs: 86_400_000 });
  assert.equal(info.shards, 4);
  assert.equal(info.retentionBytes, 1n << 30n);
  assert.equal(info.retentionMs, 86_400_000n);
  assert.equal(info.placement.length, 4);
  for (let shard = 0; shard < 4; shard++) {
    for (let i = 0; i < 3; i++) {
      const offset = await client.publish(stream, shard, { payload: `s${shard}-${i}`, headers: { h: 'v' } });
      assert.equal(offset, BigInt(i));
    }
  }
  for (let shard = 0; shard < 4; shard++) {
    const batch = await client.read(stream, shard, 'earliest', { maxRecords: 10 });
    assert.deepEqual(batch.records.map((r) => r.offset), [0n, 1n, 2n]);
    assert.deepEqual(batch.records.map((r) => r.payload.toString()), [0, 1, 2].map((i) => `s${shard}-${i}`));
    assert.deepEqual(batch.records[0].headers, [['h', Buffer.from('v')]]);
    assert.equal(batch.nextOffset, 3n);
    assert.equal(batch.endOffset, 3n);
    const from1 = await client.read(stream, shard, 1, { maxRecords: 1 });
    assert.deepEqual(from1.records.map((r) => r.offset), [1n]);
    // A single broker is in no cluster: the client does not ask it.
    assert.equal(client.hasFeature(felix.FEATURES.REPLICA_INFO), false);
    await assert.rejects(client.describeReplica(stream, shard), felix.UnsupportedError);
    const shardInfo = await client.describeShard(stream, shard);
    assert.equal(shardInfo.core, info.placement[shard]);
    assert.equal(shardInfo.endOffset, 3n);
  }
  const cores = new Set(info.placement);
  assert.equal(cores.size, Math.min(client.cores, 4), 'shards spread over the cores');
  for (const core of cores) assert.ok(client.connectedCores.includes(core), `a connection to core ${core}`);
  const listed = await client.listStreams('node');
  assert.ok(listed.some((s) => `${s.stream.tenant}/${s.stream.namespace}/${s.stream.stream}` === stream));
  await client.deleteStream(stream);
  await assert.rejects(client.describeStream(stream), felix.NotFoundError);
});

test('keyed publishes land on the shard shardForKey predicts, in key order', async (t) => {
  const client = await connect(t);
  const stream = freshStream();
  await client.createStream(stream, 5);
  for (let i = 0; i < 20; i++) {
    const key = `user-${i}`;
    const at = await client.publishKeyed(stream, key, `event-${i}`);
    assert.equal(at.shard, felix.shardForKey(key, 5), key);
    const batch = await client.read(stream, at.shard, at.baseOffset, { maxRecords: 1 });
    assert.equal(batch.records[0].key.toString(), key);
  }
  const first = await client.publishKeyedBatch(stream, 'user-1', ['a', 'b', 'c']);
  assert.equal(first.count, 3);
  assert.equal(first.shard, felix.shardForKey('user-1', 5));
  const again = await client.publishKeyed(stream, Buffer.from('user-1'), 'd');
  assert.equal(again.shard, first.shard);
  assert.equal(again.baseOffset, first.lastOffset + 1n);
});

test('a batch publish gets consecutive offsets', async (t) => {
  const client = await connect(t);
  const stream = freshStream();
  await client.createStream(stream, 1);
  await client.publish(stream, 0, 'first');
  const records = Array.from({ length: 50 }, (_, i) => ({ payload: Buffer.from([i]), key: `k${i}`, timestampMs: 1_000 + i }));
  const p = await client.publishBatch(stream, 0, records);
  assert.deepEqual(p, { shard: 0, baseOffset: 1n, count: 50, lastOffset: 50n });
  const batch = await client.read(stream, 0, 1n, { maxRecords: 100 });
  assert.equal(batch.records.length, 50);
  assert.deepEqual(batch.records.map((r) => r.timestampMs), records.map((r) => r.timestampMs));
  assert.equal(batch.records[49].payload[0], 49);
});

test('a read from latest long-polls and is woken by a concurrent publish', async (t) => {
  const client = await connect(t);
  const publisher = await connect(t);
  const stream = freshStream();
  await client.createStream(stream, 2);
  await client.publish(stream, 1, 'old');
  const started = Date.now();
  const read = client.read(stream, 1, 'latest', { waitMs: 5_000 });
  await sleep(200);
  await publisher.publish(stream, 1, 'new');
  const batch = await read;
  assert.ok(Date.now() - started < 3_000, 'woken before the wait ran out');
  assert.deepEqual(batch.records.map((r) => r.payload.toString()), ['new']);
  assert.equal(batch.records[0].offset, 1n);
});

test('a long poll does not block other calls on the same connection', async (t) => {
  const client = await connect(t);
  const stream = freshStream();
  await client.createStream(stream, 1);
  const poll = client.read(stream, 0, 'latest', { waitMs: 3_000 });
  const started = Date.now();
  await client.describeShard(stream, 0);
  await client.publish(stream, 0, 'x');
  assert.ok(Date.now() - started < 1_000, 'other calls answered while the poll waits');
  const batch = await poll;
  assert.equal(batch.records.length, 1);
});

test('subscribe follows the tail', async (t) => {
  const client = await connect(t);
  const stream = freshStream();
  await client.createStream(stream, 1);
  await client.publishBatch(stream, 0, ['a', 'b']);
  const sub = client.subscribe(stream, 0, 'earliest', { waitMs: 2_000 });
  const seen = [];
  setTimeout(() => client.publish(stream, 0, 'c'), 100);
  for await (const record of sub) {
    seen.push(`${record.offset}:${record.payload}`);
    if (seen.length === 3) break;
  }
  assert.deepEqual(seen, ['0:a', '1:b', '2:c']);
  assert.equal(sub.position, 3n);
});

test('refusals arrive as typed errors', async (t) => {
  const client = await connect(t);
  const stream = freshStream();
  await assert.rejects(client.describeStream(freshStream()), (err) => err instanceof felix.NotFoundError && err.code === 'not_found' && err.wireCode === 2);
  await assert.rejects(client.read(freshStream(), 0, 'earliest'), felix.NotFoundError);
  // On more than one core the client looks the stream up to find the
  // shard's core: that lookup's not_found is the publish's, never sent.
  assert.ok(client.cores > 1);
  await assert.rejects(client.publish(freshStream(), 0, Buffer.from('x')), (err) => err instanceof felix.NotFoundError && err.notApplied === true);
  await assert.rejects(client.publishKeyed(freshStream(), 'k', 'x'), (err) => err instanceof felix.NotFoundError && err.notApplied === true);
  await client.createStream(stream, 2);
  await assert.rejects(client.createStream(stream, 2), felix.AlreadyExistsError);
  await assert.rejects(client.read(stream, 0, 5n), (err) => err instanceof felix.InvalidRequestError && /past the tail/.test(err.message));
  await assert.rejects(client.describeShard(stream, 7), felix.NotFoundError);
  await assert.rejects(client.createStream('node/test/bad name!', 1), felix.InvalidRequestError);
  await assert.rejects(client.createStream('node/test/..', 1), felix.InvalidRequestError);
  await assert.rejects(client.createStream(`node/test/${'x'.repeat(129)}`, 1), felix.InvalidRequestError);
  await assert.rejects(client.createStream('node//x', 1), felix.InvalidArgumentError);
  const max = client.maxFrameBytes;
  // Fits in a frame, but over the broker's per-record limit (max_frame_bytes - 1,024).
  await assert.rejects(client.publish(stream, 0, Buffer.alloc(max - 900)), felix.TooLargeError);
  // Cannot fit in a frame at all: refused before sending.
  await assert.rejects(client.publish(stream, 0, Buffer.alloc(max + 1)), felix.InvalidArgumentError);
  assert.equal((await client.describeShard(stream, 0)).endOffset, 0n, 'nothing of a refused publish is stored');
});

test('retention past 2^53 round-trips exactly as a bigint', async (t) => {
  const client = await connect(t);
  const stream = freshStream();
  const big = (1n << 63n) - 1n; // the largest the broker stores
  const info = await client.createStream(stream, 1, { retentionBytes: big, retentionMs: (1n << 53n) + 1n });
  assert.equal(info.retentionBytes, big);
  assert.equal((await client.describeStream(stream)).retentionMs, (1n << 53n) + 1n);
});

test('ackOnCommit publishes with commit acknowledgements', async (t) => {
  const client = await connect(t, { ackOnCommit: true });
  assert.ok(client.hasFeature(felix.FEATURES.PUBLISH_ACK_MODE));
  const stream = freshStream();
  await client.createStream(stream, 1);
  assert.equal(await client.publish(stream, 0, 'durable'), 0n);
});

test('a single broker is in no cluster: describeCluster is refused without asking it', async (t) => {
  const client = await connect(t);
  assert.equal(client.hasFeature(felix.FEATURES.CLUSTER_INFO), false, 'only a broker in a cluster advertises CLUSTER_INFO');
  await assert.rejects(client.describeCluster(), (err) => err instanceof felix.UnsupportedError
    && err.local && err.wireCode === undefined && /FEATURE_CLUSTER_INFO/.test(err.message));
  // The connection is fine afterwards: nothing was sent.
  assert.equal(typeof (await client.ping()), 'number');
  // A cluster client of it: the broker cannot name a cluster, so its members are the one given.
  const cluster = await felix.ClusterClient.connect([ADDR]);
  t.after(() => cluster.close());
  assert.deepEqual(cluster.members, [ADDR]);
  assert.deepEqual(cluster.brokers, [ADDR]);
});
