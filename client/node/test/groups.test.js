'use strict';

// Consumer groups against a real broker (FELIX_ADDR) started with
// FELIX_GROUP_MAX_ATTEMPTS=3.

const test = require('node:test');
const assert = require('node:assert/strict');
const felix = require('../src');
const { connect, freshStream, sleep } = require('../test-support/helpers');

const MAX_ATTEMPTS = 3;

/** A client and a fresh one-shard stream holding `count` records. */
async function queue(t, count = 1) {
  const client = await connect(t);
  const stream = freshStream('q');
  await client.createStream(stream, 1);
  for (let i = 0; i < count; i++) await client.publish(stream, 0, `job-${i}`);
  return { client, stream };
}

test('each record is claimed once, acked, and carries skippedBefore', async (t) => {
  const { client, stream } = await queue(t, 3);
  const first = await client.groupPoll(stream, 0, 'g', { maxRecords: 2 });
  assert.deepEqual(first.map((r) => [r.offset, r.attempts]), [[0n, 1], [1n, 1]]);
  assert.ok(client.hasFeature(felix.FEATURES.GROUP_SKIPPED));
  for (const r of first) assert.equal(typeof r.skippedBefore, 'bigint');
  const second = await client.groupPoll(stream, 0, 'g', { maxRecords: 10 });
  assert.deepEqual(second.map((r) => r.offset), [2n], 'claimed records are not handed out again');
  // Offsets, or the records themselves.
  await client.groupAck(stream, 0, 'g', [first[0], 1]);
  await client.groupAck(stream, 0, 'g', second[0]);
  assert.deepEqual(await client.groupPoll(stream, 0, 'g'), []);
  const info = await client.groupDescribe(stream, 0, 'g');
  assert.equal(info.position, 3n);
  assert.equal(info.inFlight, 0);
  await assert.rejects(client.groupAck(stream, 0, 'g', 99n), felix.InvalidRequestError);
});

test('a lapsed claim is redelivered with attempts 2, and the old delivery is stale', async (t) => {
  const { client, stream } = await queue(t);
  const [old] = await client.groupPoll(stream, 0, 'g', { visibilityMs: 200 });
  assert.equal(old.attempts, 1);
  await sleep(350);
  const [again] = await client.groupPoll(stream, 0, 'g', { visibilityMs: 10_000 });
  assert.equal(again.offset, old.offset);
  assert.equal(again.attempts, 2);
  await assert.rejects(client.groupExtend(stream, 0, 'g', old, 1_000), (err) => err instanceof felix.StaleClaimError && err.code === 'stale_claim');
  await assert.rejects(client.groupNack(stream, 0, 'g', old), felix.StaleClaimError);
  await client.groupAck(stream, 0, 'g', again.offset);
});

test('a nack hands the record back at once; groupNackAfter only after the delay', async (t) => {
  const { client, stream } = await queue(t);
  const [r1] = await client.groupPoll(stream, 0, 'g');
  await client.groupNack(stream, 0, 'g', r1);
  const [r2] = await client.groupPoll(stream, 0, 'g');
  assert.equal(r2.attempts, 2);
  const nacked = Date.now();
  await client.groupNackAfter(stream, 0, 'g', r2, 400);
  assert.deepEqual(await client.groupPoll(stream, 0, 'g'), [], 'not owed during the delay');
  assert.equal((await client.groupDescribe(stream, 0, 'g')).delayed, 1);
  const [r3] = await client.groupPoll(stream, 0, 'g', { waitMs: 3_000 });
  assert.ok(Date.now() - nacked >= 350, 'redelivered after the delay');
  assert.equal(r3.attempts, 3);
});

test('an extended claim outlasts its visibility', async (t) => {
  const { client, stream } = await queue(t);
  const [r] = await client.groupPoll(stream, 0, 'g', { visibilityMs: 300 });
  const stands = await client.groupExtend(stream, 0, 'g', r, 5_000);
  assert.ok(stands > 4_000 && stands <= 5_000, `stands ${stands} ms`);
  await sleep(500);
  assert.deepEqual(await client.groupPoll(stream, 0, 'g'), [], 'still claimed');
  await client.groupAck(stream, 0, 'g', r.offset);
});

test('out of attempts: dead-lettered, listed, redriven and discarded', async (t) => {
  const { client, stream } = await queue(t, 2);
  for (let attempt = 1; attempt <= MAX_ATTEMPTS; attempt++) {
    const [r] = await client.groupPoll(stream, 0, 'g', { maxRecords: 1 });
    assert.deepEqual([r.offset, r.attempts], [0n, attempt]);
    await client.groupNack(stream, 0, 'g', r, { reason: `failed ${attempt}` });
  }
  const [next] = await client.groupPoll(stream, 0, 'g');
  assert.equal(next.offset, 1n, 'the group moved past the dead letter');
  assert.deepEqual(await client.groupDeadLetters(stream, 0, 'g'), [0n]);
  const [letter] = await client.groupDeadLettersDetailed(stream, 0, 'g');
  assert.equal(letter.byConsumer, false);
  assert.equal(letter.attempts, MAX_ATTEMPTS);
  assert.equal(letter.reason, `failed ${MAX_ATTEMPTS}`);
  const page = await client.groupDeadLettersPage(stream, 0, 'g', 0n, 10);
  assert.deepEqual(page.letters.map((d) => d.offset), [0n]);
  assert.equal(page.next, undefined);
  assert.equal((await client.groupDescribe(stream, 0, 'g')).deadLetters, 1);

  await client.groupRedrive(stream, 0, 'g', 0n);
  const [redriven] = await client.groupPoll(stream, 0, 'g', { maxRecords: 1 });
  assert.deepEqual([redriven.offset, redriven.attempts], [0n, 1]);
  assert.deepEqual(await client.groupDeadLetters(stream, 0, 'g'), []);

  await client.groupDeadLetter(stream, 0, 'g', redriven);
  assert.deepEqual(await client.groupDeadLetters(stream, 0, 'g'), [0n]);
  await client.groupDiscard(stream, 0, 'g', 0n);
  assert.deepEqual(await client.groupDeadLetters(stream, 0, 'g'), []);
  await assert.rejects(client.groupRedrive(stream, 0, 'g', 0n), felix.NotFoundError, 'no longer a dead letter');
});

test('a consumer dead letter keeps its reason', async (t) => {
  const { client, stream } = await queue(t);
  const [r] = await client.groupPoll(stream, 0, 'g');
  await client.groupDeadLetter(stream, 0, 'g', r, 'unparseable');
  const [letter] = await client.groupDeadLettersDetailed(stream, 0, 'g');
  assert.deepEqual([letter.offset, letter.reason, letter.byConsumer], [0n, 'unparseable', true]);
  assert.equal(typeof letter.atMs, 'number');
  await assert.rejects(client.groupDeadLetter(stream, 0, 'g', r), felix.InvalidRequestError, 'already finished');
});

test('dead-letter pages: several pages, each from the last one\'s next', async (t) => {
  const { client, stream } = await queue(t, 3);
  const records = await client.groupPoll(stream, 0, 'g', { maxRecords: 3 });
  for (const r of records) await client.groupDeadLetter(stream, 0, 'g', r, `bad ${r.offset}`);
  const pages = [];
  let from = 0n;
  for (;;) {
    const page = await client.groupDeadLettersPage(stream, 0, 'g', from, 1);
    pages.push(page.letters.map((d) => d.offset));
    if (page.next === undefined) break;
    from = page.next;
  }
  assert.deepEqual(pages, [[0n], [1n], [2n]]);
  assert.deepEqual(await client.groupDeadLetters(stream, 0, 'g'), [0n, 1n, 2n]);
});

test('create, seek, describe and delete a group', async (t) => {
  const { client, stream } = await queue(t, 5);
  await client.groupCreate(stream, 0, 'g', 'latest');
  await client.groupCreate(stream, 0, 'g', 'earliest'); // exists: left alone
  let info = await client.groupDescribe(stream, 0, 'g');
  assert.deepEqual([info.position, info.lag, info.endOffset], [5n, 0n, 5n]);
  await client.publishBatch(stream, 0, ['a', 'b']);
  info = await client.groupDescribe(stream, 0, 'g');
  assert.equal(info.lag, 2n);
  const [r] = await client.groupPoll(stream, 0, 'g', { maxRecords: 1 });
  assert.equal(r.offset, 5n);
  info = await client.groupDescribe(stream, 0, 'g');
  assert.equal(info.inFlight, 1);
  assert.equal(typeof info.oldestInFlightAgeMs, 'number');

  await client.groupSeek(stream, 0, 'g', 2);
  info = await client.groupDescribe(stream, 0, 'g');
  assert.deepEqual([info.position, info.lag], [2n, 5n]);
  await assert.rejects(client.groupAck(stream, 0, 'g', 5n), felix.StaleClaimError, 'the seek voided the claim');
  await assert.rejects(client.groupSeek(stream, 0, 'g', 100n), felix.InvalidRequestError);
  await client.groupSeek(stream, 0, 'g', 'earliest');
  assert.equal((await client.groupDescribe(stream, 0, 'g')).position, 0n);

  assert.deepEqual(await client.listGroups(stream, 0), ['g']);
  await client.groupDelete(stream, 0, 'g');
  assert.deepEqual(await client.listGroups(stream, 0), []);
  await assert.rejects(client.groupDescribe(stream, 0, 'g'), felix.NotFoundError);
});

test('the *Stream variants act on every shard', async (t) => {
  const client = await connect(t);
  const stream = freshStream('q');
  await client.createStream(stream, 3);
  for (let shard = 0; shard < 3; shard++) await client.publish(stream, shard, 'x');
  await client.groupCreateStream(stream, 'g', 'earliest');
  const infos = await client.groupDescribeStream(stream, 'g');
  assert.deepEqual(infos.map((i) => i.lag), [1n, 1n, 1n]);
  await assert.rejects(client.groupSeekStream(stream, 'g', 0), felix.InvalidArgumentError);
  await client.groupSeekStream(stream, 'g', 'latest');
  assert.deepEqual((await client.groupDescribeStream(stream, 'g')).map((i) => i.lag), [0n, 0n, 0n]);
  await client.groupDeleteStream(stream, 'g');
  for (let shard = 0; shard < 3; shard++) assert.deepEqual(await client.listGroups(stream, shard), []);
});

test('the *Stream variants reach shards the group has not polled', async (t) => {
  const client = await connect(t);
  const stream = freshStream('q');
  await client.createStream(stream, 3);
  for (let shard = 0; shard < 3; shard++) await client.publishBatch(stream, shard, ['a', 'b']);
  // Polled (and finished) on shard 1 only.
  const got = await client.groupPoll(stream, 1, 'g', { maxRecords: 10 });
  await client.groupAck(stream, 1, 'g', got);
  const infos = await client.groupDescribeStream(stream, 'g');
  assert.deepEqual(infos.map((i) => [i.position, i.lag]), [[0n, 2n], [2n, 0n], [0n, 2n]]);
  await client.groupSeekStream(stream, 'g', 'latest');
  for (let shard = 0; shard < 3; shard++) assert.equal((await client.groupDescribe(stream, shard, 'g')).position, 2n);
  await client.groupDelete(stream, 0, 'g');
  await client.groupDeleteStream(stream, 'g');
  for (let shard = 0; shard < 3; shard++) assert.deepEqual(await client.listGroups(stream, shard), []);
  for (const call of [
    () => client.groupDeleteStream(stream, 'g'),
    () => client.groupSeekStream(stream, 'g', 'earliest'),
    () => client.groupDescribeStream(stream, 'g'),
  ]) {
    await assert.rejects(call(), (err) => err instanceof felix.NotFoundError && /does not exist on any shard/.test(err.message));
  }
  assert.deepEqual(await client.listGroups(stream, 0), [], 'the seek created nothing');
});

test('a named consumer reclaims its records from a new connection', async (t) => {
  const { client, stream } = await queue(t, 2);
  const held = await client.groupPoll(stream, 0, 'g', { consumer: 'worker-1', maxRecords: 2 });
  assert.equal(held.length, 2);
  const other = await connect(t);
  assert.deepEqual(await other.groupPoll(stream, 0, 'g'), [], 'claimed records go to nobody else');
  const restarted = await connect(t);
  const back = await restarted.groupPoll(stream, 0, 'g', { consumer: 'worker-1', reclaim: true, maxRecords: 10 });
  assert.deepEqual(back.map((r) => [r.offset, r.attempts]), [[0n, 2], [1n, 2]]);
  await assert.rejects(client.groupNack(stream, 0, 'g', held[1]), felix.StaleClaimError, 'the old delivery is void');
  await restarted.groupAck(stream, 0, 'g', back.map((r) => r.offset));
});
