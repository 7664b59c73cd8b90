'use strict';

// ShardedGroup against a scripted stand-in for the client: what a real
// broker will not do on cue (an error beside records, a dropped
// connection) and the shape of the polls it sends. Needs no broker.

const test = require('node:test');
const assert = require('node:assert/strict');
const felix = require('../src');
const { ShardedGroup } = require('../src/sharded');

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
/** Let answers already given be taken in. */
const tick = () => new Promise((resolve) => setImmediate(resolve));

/**
 * A client whose group polls wait to be answered by the test:
 * `polls` lists each `{shard, maxRecords, waitMs, at, answer(records), fail(err)}`;
 * a poll not answered ends empty after its wait (or at once if `autoEmpty`).
 */
function stubClient({ shards = 2, placement, autoEmpty = false } = {}) {
  const polls = [];
  const nacks = [];
  const stub = {
    polls,
    nacks,
    nackError: undefined,
    describeStream: async (ref) => ({ stream: ref, shards, placement: placement ?? Array.from({ length: shards }, (_, i) => i % 2) }),
    groupPoll(ref, shard, group, options) {
      return new Promise((resolve, reject) => {
        let timer;
        const poll = {
          shard,
          ...options,
          at: performance.now(),
          settled: false,
          answer(records) {
            if (poll.settled) throw new Error(`poll of shard ${shard} already answered`);
            poll.settled = true;
            clearTimeout(timer);
            resolve(records);
          },
          fail(err) {
            poll.settled = true;
            clearTimeout(timer);
            reject(err);
          },
        };
        polls.push(poll);
        if (autoEmpty) poll.answer([]);
        else timer = setTimeout(() => poll.answer([]), options.waitMs);
      });
    },
    async groupNack(ref, shard, group, record) {
      nacks.push(`${shard}:${record.offset}`);
      const err = stub.nackError?.(record);
      if (err) throw err;
    },
  };
  return stub;
}

const rec = (offset) => ({ offset: BigInt(offset), attempts: 1, timestampMs: 0, headers: [], payload: Buffer.from('x') });
const keys = (records) => records.map((r) => `${r.shard}:${r.offset}`);
const open = (client, options) => ShardedGroup.open(client, 't/n/s', 'g', options);
/** The next poll the stub receives (after `after` polls). */
async function nthPoll(stub, n) {
  while (stub.polls.length <= n) await sleep(1);
  return stub.polls[n];
}

test('sharded unit: an error beside records waits for the next poll with none', async () => {
  const stub = stubClient();
  const g = await open(stub);
  const polled = g.poll({ maxRecords: 4 });
  (await nthPoll(stub, 0)).answer([rec(0)]); // shard 0: one record
  (await nthPoll(stub, 1)).fail(new felix.UnavailableError('shard 1 stopped'));
  assert.deepEqual(keys(await polled), ['0:0'], 'the records first');
  await assert.rejects(g.poll({ maxRecords: 4 }), felix.UnavailableError, 'then the error');
  // Once given, the error is gone: the next poll sweeps again.
  const again = g.poll({ maxRecords: 4 });
  (await nthPoll(stub, 2)).answer([]);
  (await nthPoll(stub, 3)).answer([]);
  assert.deepEqual(await again, []);
  await g.close();
});

test('sharded unit: an error with nothing at hand ends the poll', async () => {
  const stub = stubClient();
  const g = await open(stub);
  const polled = g.poll({ maxRecords: 4 });
  (await nthPoll(stub, 0)).fail(new felix.BusyError('busy'));
  await assert.rejects(polled, felix.BusyError);
  await g.close();
});

test('sharded unit: waiting polls ask for maxRecords in all, each at most a slice', async () => {
  const stub = stubClient({ shards: 3 });
  const g = await open(stub, { waitSliceMs: 5_000 });
  const polled = g.poll({ maxRecords: 8, waitMs: 20_000 });
  for (let i = 0; i < 3; i++) (await nthPoll(stub, i)).answer([]); // the sweep
  const waits = [];
  for (let i = 3; i < 6; i++) waits.push(await nthPoll(stub, i));
  assert.deepEqual(waits.map((p) => [p.shard, p.maxRecords, p.waitMs]), [[0, 3, 5_000], [1, 3, 5_000], [2, 2, 5_000]]);
  waits[1].answer([rec(7)]);
  assert.deepEqual(keys(await polled), ['1:7']);
  // The other two keep waiting; what they claim is held for the next poll.
  waits[2].answer([rec(1), rec(2)]);
  await tick();
  assert.equal(g.held, 2);
  assert.equal(stub.polls.length, 6);
  const next = await g.poll({ maxRecords: 1 });
  assert.deepEqual(keys(next), ['2:1'], 'held records first, no more than asked');
  assert.equal(g.held, 1);
  assert.equal(stub.polls.length, 6, 'nothing sent while records were held');
  waits[0].answer([rec(3)]);
  // close(): every held record is nacked, at once.
  await g.close();
  assert.deepEqual(stub.nacks.sort(), ['0:3', '2:2']);
});

test('sharded unit: fewer records than shards wait one at a time, in turn, 100 ms each', async () => {
  const stub = stubClient({ shards: 4 });
  const g = await open(stub);
  const polled = g.poll({ maxRecords: 1, waitMs: 450 });
  for (let i = 0; i < 4; i++) (await nthPoll(stub, i)).answer([]);
  assert.deepEqual(await polled, []);
  const waits = stub.polls.slice(4);
  assert.ok(waits.length >= 3 && waits.length <= 5, `${waits.length} waits`);
  assert.ok(waits.every((p) => p.maxRecords === 1 && p.waitMs <= 100));
  for (let i = 1; i < waits.length; i++) {
    assert.notEqual(waits[i].shard, waits[i - 1].shard, 'the shards take turns');
    assert.ok(waits[i].at - waits[i - 1].at >= 90, 'one at a time');
  }
  await g.close();
});

test('sharded unit: a wait the broker ends at once is not sent again before its slice ends', async () => {
  const stub = stubClient({ shards: 2, autoEmpty: true });
  const g = await open(stub, { waitSliceMs: 200 });
  const started = performance.now();
  assert.deepEqual(await g.poll({ maxRecords: 10, waitMs: 700 }), []);
  assert.ok(performance.now() - started >= 690);
  // A sweep of two, then a wait on each every 200 ms: about 10, not one per turn of the loop.
  assert.ok(stub.polls.length >= 6 && stub.polls.length <= 12, `${stub.polls.length} polls`);
  await g.close();
});

test('sharded unit: a new poll ends one still running; an AbortSignal ends it on the spot', async () => {
  const stub = stubClient();
  const g = await open(stub);
  const first = g.poll({ maxRecords: 10, waitMs: 20_000 });
  const sweep0 = await nthPoll(stub, 0);
  const second = g.poll({ maxRecords: 10, waitMs: 20_000 });
  assert.deepEqual(await first, [], 'the earlier poll hands out nothing');
  sweep0.answer([rec(4)]);
  assert.deepEqual(keys(await second), ['0:4'], 'its claims go to the next');

  const controller = new AbortController();
  const third = g.poll({ maxRecords: 10, waitMs: 20_000, signal: controller.signal });
  await sleep(20);
  controller.abort(new Error('stop'));
  await assert.rejects(third, /stop/);
  await assert.rejects(g.poll({ signal: AbortSignal.abort() }), (err) => err.name === 'AbortError');
  // The polls it sent still count: what they claim is held.
  for (const p of stub.polls) if (!p.settled) p.answer([rec(9)]);
  await tick();
  assert.ok(g.held >= 1);
  await g.close();
  assert.ok(stub.nacks.length >= 1);
});

test('sharded unit: close() waits for the polls out, ends the running poll, ignores stale claims', async () => {
  const stub = stubClient();
  const g = await open(stub, { waitSliceMs: 5_000 });
  const polled = g.poll({ maxRecords: 4, waitMs: 20_000 });
  (await nthPoll(stub, 0)).answer([]);
  (await nthPoll(stub, 1)).answer([]);
  const w0 = await nthPoll(stub, 2);
  const w1 = await nthPoll(stub, 3);
  stub.nackError = (r) => (r.offset === 1n ? new felix.StaleClaimError('lapsed') : undefined);
  let closed = false;
  const closing = g.close().then(() => { closed = true; });
  assert.deepEqual(await polled, [], 'the running poll ends empty');
  w0.answer([rec(1)]);
  await sleep(20);
  assert.equal(closed, false, 'still waiting for the poll on shard 1');
  w1.answer([rec(2)]);
  await closing;
  assert.deepEqual(stub.nacks.sort(), ['0:1', '1:2']);
  assert.equal(g.close(), g.close(), 'close() again: the same promise');
  await assert.rejects(g.poll(), felix.DisconnectedError);

  // A nack refused for another reason is close()'s error; every record is still tried.
  const stub2 = stubClient();
  const g2 = await open(stub2, { waitSliceMs: 5_000 });
  const p2 = g2.poll({ maxRecords: 4, waitMs: 20_000 });
  (await nthPoll(stub2, 0)).answer([]);
  (await nthPoll(stub2, 1)).answer([]);
  (await nthPoll(stub2, 2)).answer([rec(4)]);
  assert.deepEqual(keys(await p2), ['0:4']);
  (await nthPoll(stub2, 3)).answer([rec(5), rec(6)]); // claimed ahead
  await tick();
  assert.equal(g2.held, 2);
  stub2.nackError = (r) => (r.offset === 5n ? new felix.UnavailableError('down') : undefined);
  await assert.rejects(g2.close(), felix.UnavailableError);
  assert.deepEqual(stub2.nacks.sort(), ['1:5', '1:6']);
});

test('sharded unit: a dropped connection during close() drops nothing held: close() hands it back', async () => {
  // Shards 0 and 2 on core 0, shard 1 on core 1.
  const stub = stubClient({ shards: 3, placement: [0, 1, 0] });
  const g = await open(stub, { consumer: 'w', reclaim: true, waitSliceMs: 5_000 });
  const polled = g.poll({ maxRecords: 3, waitMs: 20_000 });
  for (let i = 0; i < 3; i++) (await nthPoll(stub, i)).answer([]);
  const waits = [await nthPoll(stub, 3), await nthPoll(stub, 4), await nthPoll(stub, 5)];
  waits[1].answer([rec(1)]);
  assert.deepEqual(keys(await polled), ['1:1']);
  waits[0].answer([rec(0)]);
  await tick();
  assert.equal(g.held, 1);
  const closing = g.close();
  // Core 0 drops while close() waits for shard 2's poll.
  waits[2].fail(new felix.DisconnectedError('core 0 dropped'));
  await assert.rejects(closing, felix.DisconnectedError, 'the poll\'s error is close()\'s');
  assert.deepEqual(stub.nacks, ['0:0'], 'the held record of core 0 is handed back, not dropped');
  assert.equal(g.held, 0);
});

test('sharded unit: a dropped connection drops held records of that core for a reclaiming member', async () => {
  // Shards 0 and 2 on core 0, shard 1 on core 1.
  const stub = stubClient({ shards: 3, placement: [0, 1, 0] });
  const g = await open(stub, { consumer: 'w', reclaim: true, waitSliceMs: 5_000 });
  const polled = g.poll({ maxRecords: 3, waitMs: 20_000 });
  for (let i = 0; i < 3; i++) (await nthPoll(stub, i)).answer([]);
  const waits = [await nthPoll(stub, 3), await nthPoll(stub, 4), await nthPoll(stub, 5)];
  assert.ok(waits.every((p) => p.consumer === 'w' && p.reclaim === true));
  waits[1].answer([rec(1)]);
  assert.deepEqual(keys(await polled), ['1:1']);
  waits[0].answer([rec(0)]);
  await tick();
  assert.equal(g.held, 1);
  // Shard 2's connection (core 0) drops: the reclaim on the new one hands
  // shard 0's record out again, so it is not held here as well.
  waits[2].fail(new felix.DisconnectedError('core 0 dropped'));
  await tick();
  assert.equal(g.held, 0, 'shard 0 is on the core that dropped');
  await assert.rejects(g.poll(), felix.DisconnectedError, 'then the error, with nothing at hand');
  await g.close();
});

test('sharded unit: records carry their shard and go to it', async () => {
  const calls = [];
  const stub = stubClient({ shards: 2 });
  for (const name of ['groupAck', 'groupNackAfter', 'groupExtend', 'groupDeadLetter']) {
    stub[name] = async (ref, shard, group, ...rest) => { calls.push([name, shard, ...rest.map(String)]); return 1; };
  }
  const g = await open(stub);
  const a = { ...rec(3), shard: 1 };
  const b = { ...rec(4), shard: 0 };
  await g.ack(a);
  await g.ackMany([a, b, { ...rec(5), shard: 1 }]);
  await g.nackAfter(b, 500);
  await g.extend(a, 1_000);
  await g.deadLetter(b, 'bad');
  assert.deepEqual(calls.map((c) => c.slice(0, 3)), [
    ['groupAck', 1, '3'], ['groupAck', 0, '4'], ['groupAck', 1, '3,5'],
    ['groupNackAfter', 0, '[object Object]'], ['groupExtend', 1, '[object Object]'], ['groupDeadLetter', 0, '[object Object]'],
  ]);
  await assert.rejects(g.ack({ ...a, shard: 2 }), felix.InvalidArgumentError);
  await g.close();
});

test('sharded unit: a poll timed out by its signal hands out nothing; what its waits claim after is held for the next', async () => {
  const stub = stubClient({ shards: 2 });
  const g = await open(stub, { waitSliceMs: 5_000 });
  const controller = new AbortController();
  const timedOut = g.poll({ maxRecords: 4, waitMs: 20_000, signal: controller.signal });
  (await nthPoll(stub, 0)).answer([]);
  (await nthPoll(stub, 1)).answer([]);
  const w0 = await nthPoll(stub, 2);
  const w1 = await nthPoll(stub, 3);
  // An answer already on its way as the caller gives up is not handed out either.
  w0.answer([rec(1)]);
  controller.abort(new Error('gave up'));
  await assert.rejects(timedOut, /gave up/);
  // The waits answer before the caller polls again: nothing is lost.
  w1.answer([rec(2), rec(3)]);
  await tick();
  assert.equal(g.held, 3);
  assert.deepEqual(keys(await g.poll({ maxRecords: 2 })), ['0:1', '1:2']);
  assert.deepEqual(keys(await g.poll({ maxRecords: 2 })), ['1:3']);
  assert.equal(g.held, 0);
  assert.equal(stub.polls.length, 4, 'nothing sent while records were held');
  await g.close();
  assert.deepEqual(stub.nacks, []);
});

test('sharded unit: an earlier poll\'s signal aborting ends only that poll, not the one running now', async () => {
  const stub = stubClient({ shards: 2 });
  const g = await open(stub, { waitSliceMs: 5_000 });
  const controller = new AbortController();
  const first = g.poll({ maxRecords: 4, waitMs: 20_000, signal: controller.signal });
  const sweep0 = await nthPoll(stub, 0);
  const second = g.poll({ maxRecords: 4, waitMs: 20_000 });
  controller.abort(new Error('first gave up')); // while the first is still winding down
  await assert.rejects(first, /first gave up/);
  sweep0.answer([rec(7)]);
  assert.deepEqual(keys(await second), ['0:7'], 'the second poll still runs');
  await g.close();
});

test('sharded unit: an error another shard answers during the sweep ends the poll at once', async () => {
  const stub = stubClient({ shards: 2 });
  const g = await open(stub, { waitSliceMs: 5_000 });
  const first = g.poll({ maxRecords: 4, waitMs: 20_000 });
  (await nthPoll(stub, 0)).answer([]);
  (await nthPoll(stub, 1)).answer([]);
  const w0 = await nthPoll(stub, 2);
  const w1 = await nthPoll(stub, 3);
  w0.answer([rec(1)]);
  assert.deepEqual(keys(await first), ['0:1']);
  // The next sweep starts at shard 1 (its wait still out: skipped) and polls shard 0.
  const second = g.poll({ maxRecords: 4 });
  const sweep = await nthPoll(stub, 4);
  assert.equal(sweep.shard, 0);
  w1.fail(new felix.UnavailableError('shard 1 stopped'));
  await assert.rejects(second, felix.UnavailableError);
  assert.equal(sweep.settled, false, 'thrown before the sweep\'s shard answered');
  await g.close();
});

test('sharded unit: a failure taking an answer in is the next poll\'s error; records before it are held', async () => {
  const stub = stubClient({ shards: 2 });
  const g = await open(stub);
  const polled = g.poll({ maxRecords: 4 });
  (await nthPoll(stub, 0)).answer([rec(1), null, rec(2)]); // null: not a record
  (await nthPoll(stub, 1)).answer([]);
  assert.deepEqual(keys(await polled), ['0:1']);
  await assert.rejects(g.poll({ maxRecords: 4 }), TypeError);

  // A batch too large to spread into push()'s arguments is taken in whole.
  const big = Array.from({ length: 300_000 }, (_, i) => rec(i));
  const many = g.poll({ maxRecords: 300_000 });
  (await nthPoll(stub, 2)).answer(big);
  assert.equal((await many).length, 300_000);
  assert.equal(stub.polls.length, 3, 'the first shard had enough');
  await g.close();
});

test('sharded unit: a record handed out again while held (a reclaim) is held once, as the later delivery', async () => {
  const stub = stubClient({ shards: 2 });
  const g = await open(stub, { consumer: 'w', reclaim: true, waitSliceMs: 5_000 });
  const polled = g.poll({ maxRecords: 4, waitMs: 20_000 });
  (await nthPoll(stub, 0)).answer([]);
  (await nthPoll(stub, 1)).answer([]);
  const w0 = await nthPoll(stub, 2);
  const w1 = await nthPoll(stub, 3);
  w0.answer([rec(9)]);
  assert.deepEqual(keys(await polled), ['0:9']);
  const again = { ...rec(3), attempts: 2 };
  w1.answer([rec(3), rec(4), again, rec(3)]);
  await tick();
  assert.equal(g.held, 2);
  const got = await g.poll({ maxRecords: 10 });
  assert.deepEqual(keys(got), ['1:3', '1:4']);
  assert.equal(got[0].attempts, 2, 'the later delivery');
  await g.close();
});
