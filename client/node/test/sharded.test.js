'use strict';

// ShardedGroup: one consumer of a group on every shard of a stream, against
// a real broker (FELIX_ADDR) started with FELIX_GROUP_MAX_ATTEMPTS=3.

const test = require('node:test');
const assert = require('node:assert/strict');
const felix = require('../src');
const { connect, freshStream, sleep } = require('../test-support/helpers');

/** A fresh stream of `shards` shards. */
async function shardedStream(client, shards) {
  const stream = freshStream('sg');
  await client.createStream(stream, shards);
  return stream;
}

/** Publish `n` records to `shard`, payloads `s{shard}-{i}`. */
async function publishTo(client, stream, shard, n) {
  const p = await client.publishBatch(stream, shard, Array.from({ length: n }, (_, i) => `s${shard}-${i}`));
  assert.equal(p.count, n);
}

/** A ShardedGroup, closed after the test (a second close is a no-op). */
async function group(t, client, stream, name = 'workers', options) {
  const g = await client.shardedGroup(stream, name, options);
  t.after(() => g.close().catch(() => {}));
  return g;
}

const keys = (records) => records.map((r) => `${r.shard}:${r.offset}`);
const sorted = (list) => [...list].sort();

/** Wait until `cond()` holds, at most `ms`. */
async function eventually(what, cond, ms = 5_000) {
  const until = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > until) assert.fail(`timed out waiting for ${what}`);
    await sleep(10);
  }
}

test('sharded: every record of every shard is handed out once, over two consumers', async (t) => {
  const c = await connect(t);
  const stream = await shardedStream(c, 3);
  for (let shard = 0; shard < 3; shard++) await publishTo(c, stream, shard, 100);
  const consume = async () => {
    const g = await group(t, await connect(t), stream);
    const got = [];
    for (;;) {
      const batch = await g.poll({ maxRecords: 32, waitMs: 200 });
      if (batch.length === 0) break;
      assert.ok(batch.length <= 32, `${batch.length} records for maxRecords 32`);
      await g.ackMany(batch);
      got.push(...keys(batch));
    }
    await g.close();
    return got;
  };
  const [a, b] = await Promise.all([consume(), consume()]);
  const all = [...a, ...b];
  assert.equal(new Set(all).size, all.length, 'a record was handed out twice');
  const want = [];
  for (let s = 0; s < 3; s++) for (let o = 0; o < 100; o++) want.push(`${s}:${o}`);
  assert.deepEqual(sorted(all), sorted(want));

  const g = await group(t, c, stream);
  assert.equal(g.shards, 3);
  assert.equal(g.group, 'workers');
  assert.equal(await g.lag(), 0n);
  for (const info of await g.describe()) assert.deepEqual([info.position, info.inFlight], [100n, 0]);
});

test('sharded: maxRecords is respected, by the sweep and by waits on fewer records than shards', async (t) => {
  const c = await connect(t);
  const stream = await shardedStream(c, 3);
  for (let shard = 0; shard < 3; shard++) await publishTo(c, stream, shard, 4);
  const g = await group(t, c, stream);
  const first = await g.poll({ maxRecords: 5 });
  assert.equal(first.length, 5);
  assert.equal(g.held, 0);
  const second = await g.poll({ maxRecords: 5 });
  assert.equal(second.length, 5);
  const third = await g.poll({ maxRecords: 5 });
  assert.equal(third.length, 2);
  assert.equal(new Set(keys([...first, ...second, ...third])).size, 12);
  await g.ackMany([...first, ...second, ...third]);

  // Four empty shards, one record wanted: one waiting poll out at a time,
  // so the publish to every shard is claimed once, the rest left alone.
  const few = await shardedStream(c, 4);
  const a = await group(t, await connect(t), few);
  const polled = a.poll({ maxRecords: 1, waitMs: 10_000 });
  await sleep(250);
  for (let shard = 0; shard < 4; shard++) await publishTo(c, few, shard, 1);
  const got = await polled;
  assert.equal(got.length, 1);
  assert.equal(a.held, 0);
  const b = await group(t, c, few);
  const rest = await b.poll({ maxRecords: 10 });
  assert.equal(rest.length, 3, `${keys(got)} then ${keys(rest)}`);
  assert.ok(rest.every((r) => r.attempts === 1 && r.shard !== got[0].shard));
  await a.ackMany(got);
  await b.ackMany(rest);
  assert.equal(await b.lag(), 0n);
});

test('sharded: a waiting poll wakes for any shard; what another wait claims is held and handed out first', async (t) => {
  const c = await connect(t);
  const stream = await shardedStream(c, 2);
  // Waits long enough to still be out when the test publishes.
  const g = await group(t, c, stream, 'workers', { waitSliceMs: 5_000 });
  const started = Date.now();
  const polled = g.poll({ maxRecords: 10, waitMs: 20_000 });
  await sleep(200);
  await publishTo(c, stream, 1, 1);
  const first = await polled;
  assert.deepEqual(keys(first), ['1:0']);
  assert.equal(first[0].payload.toString(), 's1-0');
  assert.ok(Date.now() - started < 2_000, `woken after ${Date.now() - started} ms`);

  // The wait on shard 0 is still out: it claims what arrives there.
  assert.equal(g.held, 0);
  await publishTo(c, stream, 0, 1);
  await eventually('the claim ahead', () => g.held === 1);
  // Another consumer finds nothing: the record is held here.
  const other = await group(t, await connect(t), stream);
  assert.deepEqual(await other.poll({ maxRecords: 10 }), []);
  const second = await g.poll({ maxRecords: 10, waitMs: 10_000 });
  assert.deepEqual(keys(second), ['0:0']);
  assert.equal(second[0].attempts, 1);
  assert.equal(second[0].payload.toString(), 's0-0');
  assert.equal(g.held, 0);
  assert.deepEqual(await g.poll({ maxRecords: 10 }), []);
  await g.ackMany([...first, ...second]);
  await g.close();
});

test('sharded: close() hands back what was claimed ahead; another consumer gets it at once', async (t) => {
  const c = await connect(t);
  const stream = await shardedStream(c, 2);
  const a = await group(t, await connect(t), stream, 'workers', { waitSliceMs: 5_000 });
  const polled = a.poll({ maxRecords: 2, waitMs: 20_000 });
  await sleep(200);
  await publishTo(c, stream, 0, 1);
  assert.deepEqual(keys(await polled), ['0:0']);
  await publishTo(c, stream, 1, 1);
  await eventually('the claim ahead', () => a.held === 1);
  const closing = Date.now();
  await a.close();
  assert.ok(Date.now() - closing < 1_000, 'no poll was out: close() did not wait');
  await assert.rejects(a.poll(), felix.DisconnectedError);

  const b = await group(t, c, stream);
  const again = await b.poll({ maxRecords: 10 });
  assert.deepEqual(keys(again), ['1:0']);
  assert.equal(again[0].attempts, 2, 'claimed ahead, then handed back');
  await b.ackMany(again);
  const info = await b.describe();
  assert.equal(info[0].inFlight, 1, 'the record handed out stays claimed');
  assert.equal(info[1].inFlight, 0);
});

test('sharded: an abandoned poll keeps its claims; close() waits for the polls still out', async (t) => {
  const c = await connect(t);
  const stream = await shardedStream(c, 2);
  for (let shard = 0; shard < 2; shard++) await publishTo(c, stream, shard, 5);
  const g = await group(t, c, stream, 'workers', { waitSliceMs: 1_000 });
  // Not awaited: the next poll ends it (it resolves empty) while its first
  // shard poll is still out; what that claims is held, not lost.
  const abandoned = g.poll({ maxRecords: 100 });
  const records = [];
  for (let i = 0; i < 20 && records.length < 10; i++) records.push(...await g.poll({ maxRecords: 100, waitMs: 300 }));
  assert.deepEqual(await abandoned, []);
  assert.ok(records.every((r) => r.attempts === 1));
  assert.equal(records.length, 10);
  assert.equal(new Set(keys(records)).size, 10);
  await g.ackMany(records);

  // Timed out by the caller (with a signal: a Promise.race timeout cannot
  // tell the poll to stop): it hands out nothing, the waits it sent keep
  // waiting, and what they claim before the caller polls again is held
  // for the next poll, not lost.
  const timedOut = g.poll({ maxRecords: 10, waitMs: 20_000, signal: AbortSignal.timeout(100) });
  await assert.rejects(timedOut, (err) => err.name === 'TimeoutError');
  await publishTo(c, stream, 1, 1);
  await eventually('the waits to claim it', () => g.held === 1);
  const got = await g.poll({ maxRecords: 10, waitMs: 5_000 });
  assert.deepEqual(keys(got), ['1:5']);
  assert.equal(got[0].attempts, 1);
  assert.equal(g.held, 0);
  await g.ack(got[0]);

  // Abandoned without a signal and followed at once by the next poll: the
  // next poll ends it and gets what its waits claim.
  const raced = await Promise.race([g.poll({ maxRecords: 10, waitMs: 20_000 }), sleep(100).then(() => 'timeout')]);
  assert.equal(raced, 'timeout');
  const next = g.poll({ maxRecords: 10, waitMs: 5_000 });
  await publishTo(c, stream, 0, 1);
  const got2 = await next;
  assert.deepEqual(keys(got2), ['0:5']);
  assert.equal(got2[0].attempts, 1);
  await g.ack(got2[0]);

  // close() with the waits still out: it waits for them (a slice at most)
  // and then no poll of this group is left to claim what comes next.
  const closing = Date.now();
  await g.close();
  const took = Date.now() - closing;
  assert.ok(took < 2_000, `close() took ${took} ms`);
  await publishTo(c, stream, 0, 1);
  const other = await group(t, await connect(t), stream);
  const last = await other.poll({ maxRecords: 10, waitMs: 2_000 });
  assert.deepEqual(keys(last), ['0:6']);
  assert.equal(last[0].attempts, 1);
  await other.ackMany(last);
});

test('sharded: ack, nack, nackAfter, extend and deadLetter go to each record\'s shard; describe and lag cover every shard', async (t) => {
  const c = await connect(t);
  const stream = await shardedStream(c, 4);
  for (let shard = 0; shard < 4; shard++) await publishTo(c, stream, shard, 1);
  await c.groupCreateStream(stream, 'workers', 'earliest');
  const g = await group(t, c, stream);
  assert.equal(await g.lag(), 4n);
  const got = (await g.poll({ maxRecords: 10 })).sort((x, y) => x.shard - y.shard);
  assert.deepEqual(keys(got), ['0:0', '1:0', '2:0', '3:0']);

  const stands = await g.extend(got[0], 45_000);
  assert.ok(stands > 40_000, `stands ${stands} ms`);
  await g.ack(got[0]);
  await g.nack(got[1]);
  await g.deadLetter(got[2], 'unparseable');
  await g.nackAfter(got[3], 60_000);

  const info = await g.describe();
  assert.deepEqual(info.map((i) => i.group), ['workers', 'workers', 'workers', 'workers']);
  assert.deepEqual([info[0].position, info[0].inFlight], [1n, 0]);
  assert.deepEqual([info[1].position, info[1].owed], [0n, 1]);
  assert.deepEqual([info[2].position, info[2].deadLetters], [1n, 1]);
  assert.deepEqual([info[3].position, info[3].delayed], [0n, 1]);
  assert.equal(await g.lag(), info.reduce((n, i) => n + i.lag, 0n));
  assert.equal(await g.lag(), 2n);
  const [letter] = await c.groupDeadLettersDetailed(stream, 2, 'workers');
  assert.deepEqual([letter.offset, letter.reason, letter.byConsumer], [0n, 'unparseable', true]);
  // The nacked record comes again, from its own shard; the delayed one not yet.
  const again = await g.poll({ maxRecords: 10 });
  assert.deepEqual(keys(again), ['1:0']);
  assert.equal(again[0].attempts, 2);
  await g.ackMany(again);
  await assert.rejects(g.ack({ ...got[0], shard: 4 }), felix.InvalidArgumentError);
  await assert.rejects(g.nack({ offset: 0n, attempts: 1 }), felix.InvalidArgumentError);
});

test('sharded: a named member takes back its claims on every shard', async (t) => {
  const c = await connect(t);
  const stream = await shardedStream(c, 2);
  for (let shard = 0; shard < 2; shard++) await publishTo(c, stream, shard, 3);
  const member = { consumer: 'worker-1', reclaim: true };
  // The first run claims everything and stops answering (its client stays
  // connected, as a hung process's would).
  const old = await group(t, await connect(t), stream, 'workers', member);
  const held = [...await old.poll({ maxRecords: 100 }), ...await old.poll({ maxRecords: 100 })];
  assert.equal(held.length, 6);
  assert.equal(old.held, 0);

  // An anonymous consumer gets nothing: the claims stand.
  const anon = await group(t, c, stream);
  assert.deepEqual(await anon.poll({ maxRecords: 100 }), []);

  // The restarted member, on a new connection, takes all six back.
  const restarted = await group(t, await connect(t), stream, 'workers', member);
  const back = [];
  for (let i = 0; i < 4; i++) back.push(...await restarted.poll({ maxRecords: 100 }));
  assert.deepEqual(sorted(keys(back)), ['0:0', '0:1', '0:2', '1:0', '1:1', '1:2']);
  assert.ok(back.every((r) => r.attempts === 2));
  await assert.rejects(old.nack(held[0]), felix.StaleClaimError, 'the old delivery is void');
  await restarted.ackMany(back);
  assert.equal(await restarted.lag(), 0n);
});

test('sharded: bad arguments are refused', async (t) => {
  const c = await connect(t);
  const stream = await shardedStream(c, 2);
  await assert.rejects(c.shardedGroup(freshStream('nope'), 'workers'), felix.NotFoundError);
  await assert.rejects(c.shardedGroup(stream, 'workers', { consumer: '' }), felix.InvalidArgumentError);
  await assert.rejects(c.shardedGroup(stream, 'workers', { reclaim: true }), felix.InvalidArgumentError);
  await assert.rejects(c.shardedGroup(stream, 'workers', { waitSlice: 10 }), felix.InvalidArgumentError);
  await assert.rejects(c.shardedGroup(stream, ''), felix.InvalidArgumentError);
  const g = await group(t, c, stream);
  await assert.rejects(g.poll({ maxRecords: 0 }), felix.InvalidArgumentError);
  await assert.rejects(g.poll({ wait: 10 }), felix.InvalidArgumentError);
  await assert.rejects(g.poll({ waitMs: -1 }), felix.InvalidArgumentError);
});
