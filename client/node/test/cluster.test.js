'use strict';

// ClusterClient against a cluster of three brokers of this file's own
// (FELIX_TEST_BROKER): describeCluster, and a cluster client that learns
// the others from one broker's address (through that broker's death);
// creates on every broker as one incarnation (a broker down for one passed
// over, named, and joining when the create is run again),
// publishes and groups that ride out a `kill -9` of a shard's leader,
// not_leader answers followed, deletes everywhere, and a ShardedGroup over
// the cluster, also across a `kill -9` of a shard's leader. A test that
// kills a broker starts it again before it ends.

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const felix = require('../src');
const { startCluster } = require('../test-support/cluster');

const {
  AlreadyExistsError, Client, ClusterClient, FEATURES, InvalidArgumentError, NotFoundError, NotLeaderError, StaleClaimError,
  UnavailableError,
} = felix;

/** @type {Awaited<ReturnType<typeof startCluster>>} */
let cluster;
/** @type {ClusterClient} */
let cc;

test.before(async () => {
  cluster = await startCluster();
  cc = await ClusterClient.connect(cluster.addrs);
});

test.after(async () => {
  cc?.close();
  await cluster?.stop();
});

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * `kill -9` node `i`; should the test fail before it starts the node
 * again, the node is started after it, so the next test has the whole
 * cluster.
 */
async function kill9(t, i) {
  t.after(async () => {
    if (!cluster.running(i)) await cluster.restart(i);
  });
  await cluster.kill9(i);
}

/** A fresh stream path, unique per call. */
function freshStream(prefix) {
  return `node/cluster/${prefix}-${crypto.randomBytes(6).toString('hex')}`;
}

/** A plain client of one broker, closed after the test. */
async function direct(t, addr) {
  const client = await Client.connect(addr);
  t.after(() => client.close());
  return client;
}

/** Wait until `cond()` holds, polling every 50 ms; fail with `what()` after `ms`. */
async function eventually(what, cond, ms = 20_000) {
  const until = Date.now() + ms;
  for (;;) {
    if (await cond()) return;
    if (Date.now() > until) assert.fail(`timed out after ${ms} ms waiting for ${typeof what === 'function' ? what() : what}`);
    await sleep(50);
  }
}

/** Every record of `shard` as `reader` (a Client or the ClusterClient) has it: offset → payload. */
async function readAll(reader, stream, shard) {
  const out = new Map();
  let from = 'earliest';
  for (;;) {
    const batch = await reader.read(stream, shard, from, { maxRecords: 1000 });
    for (const r of batch.records) out.set(r.offset, r.payload.toString());
    if (batch.records.length === 0 || batch.nextOffset >= batch.endOffset) return out;
    from = batch.nextOffset;
  }
}

const sameMap = (a, b) => a.size === b.size && [...a].every(([k, v]) => b.get(k) === v);
const show = (m) => JSON.stringify([...m].map(([k, v]) => `${k}:${v}`));

/** Publish `batches` batches of 5 to `shard` through a cluster client (`cc` by default); record what was acknowledged. */
async function publishSome(stream, shard, first, batches, acked, via = cc) {
  for (let b = first; b < first + batches; b++) {
    const payloads = Array.from({ length: 5 }, (_, k) => `s${shard}-r${b * 5 + k}`);
    const p = await via.publishBatch(stream, shard, payloads);
    assert.equal(p.shard, shard);
    assert.equal(p.count, 5);
    payloads.forEach((payload, k) => acked.set(p.baseOffset + BigInt(k), payload));
  }
}

/** The leader of `shard` as every broker reports its replica; all three must answer. */
async function leaderByReplicas(stream, shard) {
  let leader;
  await eventually(`a leader of ${stream} shard ${shard} that every broker names`, async () => {
    const answers = await cc.describeReplicas(stream, shard);
    assert.deepEqual(answers.map((a) => a.broker), cluster.addrs, 'every broker, in order');
    const leaders = answers.filter((a) => a.replica?.role === 'leader');
    if (answers.some((a) => a.error) || leaders.length !== 1) return false;
    leader = leaders[0].broker;
    return answers.every((a) => a.replica.leaderAddr === leader);
  }, 10_000);
  assert.equal(cc.leaderOf(stream, shard), leader, 'describeReplicas remembers the leader');
  return leader;
}

/** Wait (up to 20 s) until the broker at `back`, which was down, holds what the leader of `shard` holds. */
async function catchesUp(t, back, stream, shard) {
  const b = await direct(t, back);
  const leader = await direct(t, await leaderByReplicas(stream, shard));
  let got;
  let want;
  await eventually(() => `${back} to catch up on shard ${shard}: it holds ${show(got)}, the leader ${show(want)}`, async () => {
    want = await readAll(leader, stream, shard);
    got = await readAll(b, stream, shard);
    return sameMap(got, want);
  });
}

test('create: every broker holds the stream as one incarnation; again is fine; another shard count is refused', async (t) => {
  const stream = freshStream('create');
  const info = await cc.createStream(stream, 2);
  assert.equal(info.shards, 2);
  assert.equal(typeof info.incarnation, 'bigint', 'a cluster stream has an incarnation');
  assert.ok(info.incarnation > 0n && info.incarnation < 1n << 63n);
  const clients = await Promise.all(cluster.addrs.map((a) => direct(t, a)));
  const incarnations = async () => Promise.all(clients.map(async (c) => (await c.describeStream(stream)).incarnation));
  assert.deepEqual(await incarnations(), [info.incarnation, info.incarnation, info.incarnation]);
  for (const c of clients) assert.equal((await c.describeStream(stream)).shards, 2);

  // Created again (a create run twice, or interrupted): left as it is.
  const again = await cc.createStream(stream, 2);
  assert.equal(again.incarnation, info.incarnation);
  assert.deepEqual(await incarnations(), [info.incarnation, info.incarnation, info.incarnation]);

  // Another shard count: refused, naming a broker that holds it.
  await assert.rejects(cc.createStream(stream, 3), (err) => err instanceof AlreadyExistsError
    && err.message.includes(`exists on ${cluster.addrs[0]} with 2 shards, not 3`));

  // A broker that lacks it (a create cut short there) gets the others' incarnation.
  await clients[2].deleteStream(stream);
  await assert.rejects(clients[2].describeStream(stream), NotFoundError);
  await cc.createStream(stream, 2);
  assert.deepEqual(await incarnations(), [info.incarnation, info.incarnation, info.incarnation]);

  // Held by one broker of three: perhaps a stream the others deleted; refused, naming it.
  await clients[0].deleteStream(stream);
  await clients[1].deleteStream(stream);
  await assert.rejects(cc.createStream(stream, 2), (err) => err instanceof AlreadyExistsError
    && err.message.includes(`held by only 1 of the 3 brokers (${cluster.addrs[2]})`));
  await assert.rejects(clients[0].describeStream(stream), NotFoundError, 'nothing was created');

  // The cluster client chooses incarnations; a plain client checks the one it is given.
  await assert.rejects(cc.createStream(stream, 2, { incarnation: 5n }), InvalidArgumentError);
  await assert.rejects(clients[0].createStream(stream, 2, { incarnation: 0 }), InvalidArgumentError);
  await cc.deleteStream(stream);
});

test('create with a broker down: made on the other two, the error names it; run again once it is back, it joins', async (t) => {
  const stream = freshStream('create-down');
  const [one, two, three] = cluster.addrs;
  await kill9(t, 3);
  await assert.rejects(cc.createStream(stream, 2), (err) => err instanceof UnavailableError
    && err.message.startsWith(`${stream} was created on the other brokers, not on ${three} (`)
    && err.message.endsWith(': run the same create again once it is back'));
  const incarnationOn = async (addr) => (await (await direct(t, addr)).describeStream(stream)).incarnation;
  const [i1, i2] = [await incarnationOn(one), await incarnationOn(two)];
  assert.equal(typeof i1, 'bigint');
  assert.equal(i2, i1, 'the other two hold it as one incarnation');

  await cluster.restart(3);
  const again = await cc.createStream(stream, 2);
  assert.equal(again.incarnation, i1);
  assert.equal(await incarnationOn(three), i1, 'the third holds the same incarnation');
  await cc.deleteStream(stream);
});

test('publishes to every shard are held by every broker, in order, at the offsets acknowledged', async (t) => {
  const stream = freshStream('publish');
  await cc.createStream(stream, 3);
  const acked = [new Map(), new Map(), new Map()];
  for (let shard = 0; shard < 3; shard++) await publishSome(stream, shard, 0, 4, acked[shard]);
  // By key: the shard the broker routes it to, through that shard's leader.
  const p = await cc.publishKeyed(stream, 'user-42', 'keyed');
  assert.equal(p.shard, felix.shardForKey('user-42', 3));
  acked[p.shard].set(p.baseOffset, 'keyed');

  for (let shard = 0; shard < 3; shard++) {
    assert.ok(cluster.addrs.includes(cc.leaderOf(stream, shard)), `a leader of shard ${shard} is known`);
    const offsets = [...acked[shard].keys()];
    assert.deepEqual(offsets, [...offsets].sort((a, b) => (a < b ? -1 : 1)), 'offsets ascend in publish order');
    // Through the cluster client, and from each broker's own replica.
    assert.ok(sameMap(await readAll(cc, stream, shard), acked[shard]));
    for (const addr of cluster.addrs) {
      const c = await direct(t, addr);
      let got;
      await eventually(() => `${addr} to hold shard ${shard} as acknowledged: ${show(got)} vs ${show(acked[shard])}`, async () => {
        got = await readAll(c, stream, shard);
        return sameMap(got, acked[shard]);
      }, 10_000);
    }
  }
  await cc.deleteStream(stream);
});

test('failover: publishing carries on through a kill -9 of the leader; nothing acknowledged is lost; the broker comes back', async (t) => {
  const stream = freshStream('failover');
  await cc.createStream(stream, 2);
  const acked = [new Map(), new Map()];
  for (let shard = 0; shard < 2; shard++) await publishSome(stream, shard, 0, 2, acked[shard]);
  const leader = await leaderByReplicas(stream, 0);
  const dead = cluster.nodeOf(leader);

  // Publish to both shards, all along, until told to stop.
  let stop = false;
  let batches = 0;
  const sent = new Set();
  const publisher = (async () => {
    for (let b = 2; !stop; b++) {
      for (let shard = 0; shard < 2; shard++) {
        const payloads = Array.from({ length: 5 }, (_, k) => `s${shard}-r${b * 5 + k}`);
        for (const x of payloads) sent.add(x);
        const p = await cc.publishBatch(stream, shard, payloads);
        assert.equal(p.count, 5);
        payloads.forEach((payload, k) => acked[shard].set(p.baseOffset + BigInt(k), payload));
      }
      batches++;
    }
  })();
  // Its failure is thrown where it is awaited, not as an unhandled rejection meanwhile.
  publisher.catch(() => {});
  const waitBatches = async (n, what) => {
    const until = batches + n;
    await eventually(what, async () => {
      // A failed publisher fails the test at once, with its error.
      await Promise.race([publisher, sleep(0)]);
      return batches >= until;
    });
  };
  try {
    await waitBatches(5, 'publishes before the kill');
    await kill9(t, dead);
    await waitBatches(10, 'publishes to carry on after the kill');
  } finally {
    stop = true;
    await publisher;
  }
  const newLeader = cc.leaderOf(stream, 0);
  assert.ok(newLeader && newLeader !== leader, `another broker leads shard 0 now (${newLeader}, was ${leader})`);

  // Every acknowledged record, at its offset, on the new leader; anything
  // else there is a record sent and acknowledged again (at least once).
  const nl = await direct(t, newLeader);
  for (let shard = 0; shard < 2; shard++) {
    const got = await readAll(nl, stream, shard);
    for (const [offset, payload] of acked[shard]) {
      assert.equal(got.get(offset), payload, `shard ${shard} offset ${offset} was acknowledged`);
    }
    for (const [offset, payload] of got) {
      assert.ok(acked[shard].get(offset) === payload || sent.has(payload), `shard ${shard} offset ${offset} holds ${payload}, never sent`);
    }
  }

  // The killed broker comes back and catches up.
  await cluster.restart(dead);
  for (let shard = 0; shard < 2; shard++) await catchesUp(t, leader, stream, shard);
  await cc.deleteStream(stream);
});

test('a group across a failover: every record is delivered at least once and none is lost', async (t) => {
  const stream = freshStream('group');
  const g = 'workers';
  await cc.createStream(stream, 1);
  const published = new Set();
  for (let b = 0; b < 4; b++) {
    const p = await cc.publishBatch(stream, 0, Array.from({ length: 10 }, (_, k) => `r${b * 10 + k}`));
    for (let k = 0n; k < 10n; k++) published.add(p.baseOffset + k);
  }
  await cc.groupCreate(stream, 0, g, 'earliest');
  const delivered = new Map();
  const acked = new Set();
  const consume = async (options) => {
    const batch = await cc.groupPoll(stream, 0, g, options);
    for (const r of batch) delivered.set(r.offset, (delivered.get(r.offset) ?? 0) + 1);
    try {
      await cc.groupAck(stream, 0, g, batch.map((r) => r.offset));
      for (const r of batch) acked.add(r.offset);
    } catch (err) {
      // A claim that lapsed and went out again: delivered once more later.
      if (!(err instanceof StaleClaimError)) throw err;
    }
    return batch.length;
  };
  // (The leader's generation start takes an offset that a poll settles
  // without delivering: a poll can come back with one fewer.)
  for (let i = 0; i < 2; i++) assert.ok(await consume({ maxRecords: 10 }) >= 9);
  const before = await cc.groupDescribe(stream, 0, g);
  assert.equal(before.inFlight, 0);

  const leader = await leaderByReplicas(stream, 0);
  const dead = cluster.nodeOf(leader);
  await kill9(t, dead);
  // The durable position survives on the new leader (acks are committed on a majority).
  const after = await cc.groupDescribe(stream, 0, g);
  assert.notEqual(cc.leaderOf(stream, 0), leader, 'another broker leads');
  assert.equal(after.position, before.position, 'the durable position survived');

  // Short claims, so a claim whose poll answer was lost comes back soon.
  await eventually(() => `every record acked: ${[...published].filter((o) => !acked.has(o)).join(',')} left`, async () => {
    await consume({ maxRecords: 10, waitMs: 200, visibilityMs: 2_000 });
    return [...published].every((o) => acked.has(o));
  }, 30_000);
  for (const o of published) assert.ok(delivered.get(o) >= 1, `offset ${o} delivered`);
  assert.deepEqual([...delivered.keys()].filter((o) => !published.has(o)), [], 'only published records are delivered');

  // At the end: a poll settles the new leader's generation start, and the position reaches the tail.
  let info;
  await eventually(() => `the group at the tail: ${JSON.stringify(info, (k, v) => (typeof v === 'bigint' ? `${v}` : v))}`, async () => {
    assert.equal(await consume({ maxRecords: 10 }), 0, 'nothing more to deliver');
    info = await cc.groupDescribe(stream, 0, g);
    return info.lag === 0n && info.position === info.endOffset && info.inFlight === 0;
  }, 10_000);

  await cluster.restart(dead);
  await catchesUp(t, leader, stream, 0);
  await cc.deleteStream(stream);
});

test('a not_leader answer is followed to the leader it names', async (t) => {
  const stream = freshStream('follow');
  await cc.createStream(stream, 1);
  await cc.publish(stream, 0, 'first');
  const leader = await leaderByReplicas(stream, 0);
  const followers = cluster.addrs.filter((a) => a !== leader);

  await cc.groupCreate(stream, 0, 'g', 'earliest');

  // A follower refuses, naming the leader.
  const f = await direct(t, followers[0]);
  await assert.rejects(f.publish(stream, 0, 'to a follower'), (err) => err instanceof NotLeaderError && err.leader === leader);
  await assert.rejects(f.groupDescribe(stream, 0, 'g'), (err) => err instanceof NotLeaderError && err.leader === leader);

  // A cluster client given only a follower reaches the leader only by
  // following the answer.
  // (One address needs no array.)
  const viaFollower = await ClusterClient.connect(followers[0]);
  t.after(() => viaFollower.close());
  assert.equal(viaFollower.leaderOf(stream, 0), undefined);
  const offset = await viaFollower.publish(stream, 0, 'second');
  assert.equal(viaFollower.leaderOf(stream, 0), leader);
  // One that asks the followers first, for a group call.

  const viaFollower2 = await ClusterClient.connect([...followers, leader]);
  t.after(() => viaFollower2.close());
  await viaFollower2.groupCreate(stream, 0, 'g', 'earliest');
  assert.equal(viaFollower2.leaderOf(stream, 0), leader, 'a group call too');
  const records = await viaFollower2.groupPoll(stream, 0, 'g', { maxRecords: 10 });
  assert.deepEqual(records.map((r) => r.payload.toString()), ['first', 'second']);
  assert.equal(records[1].offset, offset);
  await cc.deleteStream(stream);
});

test('a broker names every broker of its cluster; a cluster client given one address finds the others and outlives it', async (t) => {
  // Node 2, a follower of some shards, the leader of others.
  const seed = cluster.addrs[1];
  const plain = await direct(t, seed);
  assert.ok(plain.hasFeature(FEATURES.CLUSTER_INFO), 'a broker in a cluster advertises CLUSTER_INFO');
  const info = await plain.describeCluster();
  assert.equal(info.node, 2n, "the answering broker's own id");
  assert.deepEqual(info.members, cluster.addrs.map((addr, i) => ({ node: BigInt(i + 1), addr })), 'every broker, in node order');

  const one = await ClusterClient.connect([seed]);
  t.after(() => one.close());
  assert.deepEqual(one.members, cluster.addrs);
  assert.equal(one.brokers[0], seed, 'the broker given comes first');
  assert.deepEqual([...one.brokers].sort(), [...cluster.addrs].sort());
  assert.equal(one.brokers.length, 3);

  // Created on all three, as one incarnation.
  const stream = freshStream('one-address');
  const made = await one.createStream(stream, 2);
  assert.equal(typeof made.incarnation, 'bigint');
  const incarnations = await Promise.all(cluster.addrs.map(async (a) => (await (await direct(t, a)).describeStream(stream)).incarnation));
  assert.deepEqual(incarnations, [made.incarnation, made.incarnation, made.incarnation], 'one incarnation on every broker');

  const acked = [new Map(), new Map()];
  for (let shard = 0; shard < 2; shard++) await publishSome(stream, shard, 0, 4, acked[shard], one);
  // A stream whose leader this client has never been told of.
  const unled = freshStream('one-address-unled');
  await cc.createStream(unled, 1);
  // The broker it was given dies: the others carry on, and every
  // acknowledged record is on each shard's leader.
  await kill9(t, 2);
  for (let shard = 0; shard < 2; shard++) await publishSome(stream, shard, 4, 4, acked[shard], one);
  // Its first try is the dead broker it was given; then those it learned.
  assert.equal(one.leaderOf(unled, 0), undefined);
  const offset = await one.publish(unled, 0, 'after the seed died');
  assert.ok(cluster.addrs.includes(one.leaderOf(unled, 0)) && one.leaderOf(unled, 0) !== seed, `led by ${one.leaderOf(unled, 0)}`);
  assert.equal((await one.read(unled, 0, offset, { maxRecords: 1 })).records[0].payload.toString(), 'after the seed died');
  for (let shard = 0; shard < 2; shard++) {
    const leader = one.leaderOf(stream, shard);
    assert.ok(leader && leader !== seed, `shard ${shard} is led by a live broker (${leader})`);
    const got = await readAll(await direct(t, leader), stream, shard);
    for (const [offset, payload] of acked[shard]) assert.equal(got.get(offset), payload, `shard ${shard} offset ${offset}`);
  }

  await cluster.restart(2);
  for (let shard = 0; shard < 2; shard++) await catchesUp(t, seed, stream, shard);
  await catchesUp(t, seed, unled, 0);
  await one.deleteStream(stream);
  await one.deleteStream(unled);
});

test('deleteStream deletes the stream on every broker', async (t) => {
  const stream = freshStream('delete');
  await cc.createStream(stream, 2);
  await cc.publish(stream, 1, 'x');
  assert.ok(cc.leaderOf(stream, 1));
  await cc.deleteStream(stream);
  for (const addr of cluster.addrs) {
    await assert.rejects((await direct(t, addr)).describeStream(stream), NotFoundError, `gone from ${addr}`);
  }
  assert.equal(cc.leaderOf(stream, 1), undefined, 'its leaders are forgotten');
  await assert.rejects(cc.describeStream(stream), NotFoundError);
  // Gone everywhere already: fine.
  await cc.deleteStream(stream);
});

test('a ShardedGroup over the cluster consumes every shard, each on its leader', async (t) => {
  const stream = freshStream('sharded');
  await cc.createStream(stream, 3);
  const want = new Set();
  for (let shard = 0; shard < 3; shard++) {
    const p = await cc.publishBatch(stream, shard, Array.from({ length: 10 }, (_, i) => `s${shard}-${i}`));
    for (let k = 0n; k < 10n; k++) want.add(`${shard}:${p.baseOffset + k}`);
  }
  const group = await cc.shardedGroup(stream, 'workers');
  t.after(() => group.close().catch(() => {}));
  assert.equal(group.shards, 3);
  const got = [];
  await eventually(() => `all 30 records (got ${got.length})`, async () => {
    const batch = await group.poll({ maxRecords: 16, waitMs: 500 });
    await group.ackMany(batch);
    got.push(...batch.map((r) => `${r.shard}:${r.offset}`));
    return got.length >= want.size;
  }, 20_000);
  assert.deepEqual(got.sort(), [...want].sort(), 'each record once, from every shard');
  assert.equal(await group.lag(), 0n);
  const infos = await group.describe();
  assert.deepEqual(infos.map((i) => i.inFlight), [0, 0, 0]);
  await group.close();
  for (let shard = 0; shard < 3; shard++) assert.ok(cluster.addrs.includes(cc.leaderOf(stream, shard)));
  await cc.deleteStream(stream);
});

test('a ShardedGroup across a kill -9 of a shard\'s leader: every record delivered at least once, none lost', async (t) => {
  const stream = freshStream('sharded-failover');
  const g = 'workers';
  const shards = 3;
  await cc.createStream(stream, shards);
  /** `shard:offset` → payload, as acknowledged; every payload sent (a publish sent again can store one twice). */
  const published = new Map();
  const sent = new Set();
  const publish = async (round) => {
    for (let shard = 0; shard < shards; shard++) {
      const batch = Array.from({ length: 10 }, (_, i) => `s${shard}-r${round * 10 + i}`);
      for (const x of batch) sent.add(x);
      const p = await cc.publishBatch(stream, shard, batch);
      assert.equal(p.shard, shard);
      batch.forEach((payload, k) => published.set(`${shard}:${p.baseOffset + BigInt(k)}`, payload));
    }
  };
  await publish(0);
  await cc.groupCreateStream(stream, g, 'earliest');
  // Short claims, so a claim the lost leader handed out (or whose answer
  // was lost) is owed again soon.
  const group = await cc.shardedGroup(stream, g, { visibilityMs: 2_000 });
  t.after(() => group.close().catch(() => {}));

  /** By `shard:offset`: times delivered, the payload delivered, and what an ack was accepted for. */
  const delivered = new Map();
  const payloads = new Map();
  const acked = new Set();
  const take = async (maxRecords) => {
    const batch = await group.poll({ maxRecords, waitMs: 300 });
    for (const r of batch) {
      const key = `${r.shard}:${r.offset}`;
      delivered.set(key, (delivered.get(key) ?? 0) + 1);
      payloads.set(key, r.payload.toString());
    }
    return batch;
  };
  const consume = async (maxRecords) => {
    const batch = await take(maxRecords);
    const byShard = new Map();
    for (const r of batch) {
      if (!byShard.has(r.shard)) byShard.set(r.shard, []);
      byShard.get(r.shard).push(r);
    }
    // One ack per shard (a shard's ack is taken whole or refused whole),
    // so what was acked is known.
    await Promise.all([...byShard.values()].map(async (records) => {
      try {
        await group.ackMany(records);
        for (const r of records) acked.add(`${r.shard}:${r.offset}`);
      } catch (err) {
        // A claim the failover voided, or that lapsed and went out again:
        // delivered once more later.
        if (!(err instanceof StaleClaimError)) throw err;
      }
    }));
    return batch.length;
  };

  // Part of the records, with their shards' leaders known.
  await eventually(() => `a first part consumed (${acked.size} acked)`, async () => {
    await consume(4);
    return acked.size >= 12;
  });
  assert.ok(acked.size < published.size, 'only part consumed before the kill');
  // And some claimed, never to be acked (a consumer that died with them):
  // owed again once the failover voids their claims or they lapse.
  const abandoned = (await take(6)).map((r) => `${r.shard}:${r.offset}`);
  assert.ok(abandoned.length > 0, 'records claimed and left');
  const leader = await leaderByReplicas(stream, 0);
  const dead = cluster.nodeOf(leader);
  await kill9(t, dead);

  // More, to every shard, shard 0 through its new leader.
  await publish(1);
  assert.notEqual(cc.leaderOf(stream, 0), leader, 'another broker leads shard 0');

  const left = () => [...published.keys()].filter((k) => !acked.has(k));
  await eventually(() => `every record acked: ${left().join(',')} left`, async () => {
    await consume(8);
    return left().length === 0;
  }, 40_000);

  // Drained: a poll settles each new leader's generation start; a record
  // a publish sent again stored twice is delivered and acked too.
  let infos;
  const showInfos = () => JSON.stringify(infos, (k, v) => (typeof v === 'bigint' ? `${v}` : v));
  await eventually(() => `the group at the tail of every shard: ${showInfos()}`, async () => {
    await consume(16);
    infos = await group.describe();
    return group.held === 0 && infos.every((i) => i.lag === 0n && i.position === i.endOffset && i.inFlight === 0);
  }, 20_000);
  assert.equal(await group.lag(), 0n);

  for (const key of published.keys()) assert.ok(delivered.get(key) >= 1, `${key} delivered`);
  for (const key of abandoned) assert.ok(delivered.get(key) >= 2, `${key}, claimed and left, delivered again`);
  for (const [key, payload] of payloads) {
    const want = published.get(key);
    assert.ok(want === undefined ? sent.has(payload) : want === payload, `${key} delivered ${payload}, never published there`);
  }
  await group.close();

  // The killed broker comes back and catches up on every shard.
  await cluster.restart(dead);
  for (let shard = 0; shard < shards; shard++) await catchesUp(t, leader, stream, shard);
  await cc.deleteStream(stream);
});
