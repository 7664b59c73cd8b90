'use strict';

/**
 * `ShardedGroup`: one consumer of a consumer group on every shard of a
 * stream, as the Rust client's `ShardedGroup` (`client/src/sharded.rs`).
 * @module felix-client/sharded
 */

const args = require('./args');
const wire = require('./wire');
const { timerDelay } = require('./connection');
const {
  ConnectionError,
  DisconnectedError,
  InvalidArgumentError,
  StaleClaimError,
} = require('./errors');

/** How long a waiting poll lasts before it is sent again, unless `waitSliceMs` says otherwise. */
const DEFAULT_WAIT_SLICE_MS = 1_000;
/** The shortest wait slice. */
const MIN_WAIT_SLICE_MS = 10;
/** With fewer records wanted than shards, how long each of the rotating waiting polls lasts. */
const SHORT_WAIT_SLICE_MS = 100;
/** How long `close()` waits for answers beyond the wait slice. */
const CLOSE_GRACE_MS = 5_000;

const OPTION_KEYS = ['consumer', 'reclaim', 'visibilityMs', 'waitSliceMs'];
const POLL_OPTION_KEYS = ['maxRecords', 'waitMs', 'signal'];

const now = () => performance.now();

/** Refuse a key not in `known` (a typo such as `waitMS`). */
function knownKeys(options, known, what) {
  if (options === null || typeof options !== 'object') {
    throw new InvalidArgumentError(`${what} must be an object, not ${String(options)}`);
  }
  for (const key of Object.keys(options)) {
    if (!known.includes(key)) {
      throw new InvalidArgumentError(`unknown ${what} key ${JSON.stringify(key)}; the keys are ${known.join(', ')}`);
    }
  }
}

/** An AbortSignal's reason as an error to reject with. */
function abortReason(signal) {
  return signal.reason ?? new DOMException('The operation was aborted', 'AbortError');
}

/**
 * One consumer of a group on every shard of a stream. Made by
 * `client.shardedGroup(stream, group, options)`.
 *
 * A group lives on one shard; `ShardedGroup` polls all of a stream's
 * shards as one queue. It assigns nothing: every `ShardedGroup` of a group
 * polls every shard, and the broker's one claim per record divides the
 * work between them.
 *
 * `poll()` first claims what the shards have without waiting, starting
 * from a different shard each time. When none has anything and the poll
 * may wait, it sends waiting polls and answers as soon as one brings
 * records. They ask for `maxRecords` in all: with at least as many records
 * as shards, every shard waits for its part; with fewer, one record each
 * on as many shards as records, taking turns in 100 ms slices. Each lasts
 * at most a wait slice (`waitSliceMs`, 1 s unless set) and is sent again,
 * no sooner, while the poll's own wait lasts.
 *
 * The broker cannot take a sent poll back, so the waiting polls still out
 * when the first answers keep waiting; what they claim is held here and
 * handed out first by the next `poll()` (`held` counts it). Their claims'
 * visibility runs from when they were claimed, so keep polling. An error
 * a shard answers while records are at hand is thrown by the next `poll()`
 * that has none to give.
 *
 * One poll at a time: a `poll()` (or `close()`) made while an earlier poll
 * is still running ends that one at once, resolving it empty; whatever
 * its shard polls claimed stays held for the new one. So a poll abandoned
 * by its caller (a `Promise.race` timeout) loses nothing as long as the
 * next `poll()` or `close()` follows; to end a poll on the spot, pass a
 * `signal`, which rejects it with the signal's reason and keeps its claims.
 *
 * `close()` waits for the polls still out (about a wait slice; at most
 * 5 s more) and hands back (nacks) everything held, so another consumer
 * gets it at once, with the attempt counted. It does not close the client.
 */
class ShardedGroup {
  /**
   * Use `client.shardedGroup(...)`, which asks the broker for the shard count.
   * @param {import('./client').Client} client
   * @param {{tenant: string, namespace: string, stream: string}} ref
   * @param {string} group
   * @param {import('../index').StreamInfo} info the stream's shards and placement
   * @param {import('../index').ShardedGroupOptions} options checked
   * @private
   */
  constructor(client, ref, group, info, options) {
    this.client = client;
    this.ref = ref;
    this.groupName = group;
    this.shardCount = info.shards;
    /** The broker core of each shard, when the polls began: shards on one core share a connection. */
    this.placement = info.placement;
    this.pollOptions = {
      consumer: options.consumer,
      reclaim: options.reclaim,
      visibilityMs: options.visibilityMs,
    };
    this.waitSliceMs = options.waitSliceMs;
    /** Where the next sweep (and the next rotating wait) starts. */
    this.next = 0;
    /** @type {import('../index').ShardedRecord[]} Claimed, not yet handed out; handed out before anything else. */
    this.ready = [];
    /** An error answered while records were at hand (or no poll was running), for the next poll with none. */
    this.deferred = undefined;
    /** Shards with a poll out (at most one each). */
    this.waiting = new Array(info.shards).fill(false);
    this.out = 0;
    /** No new waiting poll goes to a shard before this (its last one's slice). */
    this.quietUntil = new Array(info.shards).fill(0);
    /** Wakers of whoever waits for an answer (the running poll, or close). */
    this.wakers = new Set();
    /** The running poll: `{ended: boolean}`. */
    this.run = undefined;
    this.closed = false;
    /** During close: errors of polls answering. */
    this.closeErrors = undefined;
    /** After close gave up waiting: records that arrive are handed back at once. */
    this.handedBack = false;
    this.closing = undefined;
  }

  /**
   * @param {import('./client').Client} client
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @param {import('../index').ShardedGroupOptions} [options]
   * @returns {Promise<ShardedGroup>}
   * @private
   */
  static async open(client, stream, group, options = {}) {
    const ref = args.streamRef(stream);
    args.name(group, 'group');
    knownKeys(options, OPTION_KEYS, 'shardedGroup option');
    const o = {
      consumer: undefined,
      reclaim: undefined,
      visibilityMs: undefined,
      waitSliceMs: DEFAULT_WAIT_SLICE_MS,
    };
    if (options.consumer !== undefined) o.consumer = args.memberName(options.consumer);
    if (options.reclaim !== undefined && options.reclaim !== false) {
      if (options.reclaim !== true) throw new InvalidArgumentError(`reclaim must be a boolean, not ${String(options.reclaim)}`);
      if (o.consumer === undefined) throw new InvalidArgumentError('reclaim needs a consumer name');
      o.reclaim = true;
    }
    if (options.visibilityMs !== undefined) {
      args.positiveMillisU64(options.visibilityMs, 'visibilityMs');
      o.visibilityMs = options.visibilityMs;
    }
    if (options.waitSliceMs !== undefined) {
      o.waitSliceMs = Math.max(args.millisU32(options.waitSliceMs, 'waitSliceMs'), MIN_WAIT_SLICE_MS);
    }
    const info = await client.describeStream(ref);
    if (info.shards === 0) throw new InvalidArgumentError(`${ref.tenant}/${ref.namespace}/${ref.stream} has no shards`);
    return new ShardedGroup(client, ref, group, info, o);
  }

  /** The stream's shard count. @returns {number} */
  get shards() {
    return this.shardCount;
  }

  /** The group's name. @returns {string} */
  get group() {
    return this.groupName;
  }

  /** The stream, as `{tenant, namespace, stream}`. */
  get stream() {
    return { ...this.ref };
  }

  /**
   * Records claimed by earlier polls' waiting polls and not yet handed out
   * by `poll()`. @returns {number}
   */
  get held() {
    return this.ready.length;
  }

  /**
   * Claim up to `maxRecords` records from any of the stream's shards,
   * waiting up to `waitMs` for one when none is available. An empty array
   * means nothing was (or this poll was ended by a newer `poll()` or by
   * `close()`). `signal` aborts it, rejecting with the signal's reason.
   * @param {import('../index').ShardedPollOptions} [options] defaults: 16 records, no wait
   * @returns {Promise<import('../index').ShardedRecord[]>}
   */
  async poll(options = {}) {
    knownKeys(options, POLL_OPTION_KEYS, 'poll option');
    const max = args.u32(options.maxRecords ?? 16, 'maxRecords', 1);
    const waitMs = args.millis(options.waitMs ?? 0, 'waitMs');
    const { signal } = options;
    if (signal !== undefined && !(signal instanceof AbortSignal)) {
      throw new InvalidArgumentError('signal must be an AbortSignal');
    }
    if (this.closed) throw new DisconnectedError('the sharded group is closed');
    // One poll at a time: an earlier one still running (abandoned by its
    // caller) ends now and hands out nothing; its claims stay held.
    this.endRun();
    signal?.throwIfAborted();
    const run = { ended: false };
    this.run = run;
    const onAbort = () => this.endRun();
    signal?.addEventListener('abort', onAbort);
    try {
      const records = await this.pollRun(run, max, waitMs);
      // Aborted: records already handed out are still returned, never dropped.
      if (records.length === 0 && run.ended && signal?.aborted) throw abortReason(signal);
      return records;
    } finally {
      signal?.removeEventListener('abort', onAbort);
      if (this.run === run) this.run = undefined;
    }
  }

  /** End the running poll, if any; it resolves empty at its next step. */
  endRun() {
    if (!this.run) return;
    this.run.ended = true;
    this.run = undefined;
    this.wake();
  }

  async pollRun(run, max, waitMs) {
    const deadline = now() + waitMs;
    if (this.ready.length > 0) return this.handOut(max);
    this.throwDeferred();

    // Every shard poll's answer goes to `ready` (or `deferred`) as it
    // arrives, whoever is waiting: records are handed out only by the
    // poll running when it returns, never by one that was ended.
    const start = this.next;
    this.next = (this.next + 1) % this.shardCount;
    for (let i = 0; i < this.shardCount; i++) {
      const shard = (start + i) % this.shardCount;
      // A waiting poll is already out there and gets what arrives.
      if (this.waiting[shard]) continue;
      const want = max - this.ready.length;
      if (want <= 0) break;
      this.spawnPoll(shard, want, 0);
      while (this.waiting[shard] && !run.ended) await this.changed(undefined);
      if (run.ended) return [];
      if (this.ready.length === 0) this.throwDeferred();
    }
    if (this.ready.length > 0 || waitMs === 0) return this.handOut(max);

    // Nothing anywhere: wait.
    for (;;) {
      const t = now();
      if (deadline - t < 1) return [];
      const freeAt = this.spreadWaits(max, deadline - t, t);
      await this.changed(freeAt === undefined ? deadline : Math.min(freeAt, deadline));
      if (run.ended) return [];
      if (this.ready.length > 0) return this.handOut(max);
      this.throwDeferred();
    }
  }

  throwDeferred() {
    if (this.deferred === undefined) return;
    const err = this.deferred;
    this.deferred = undefined;
    throw err;
  }

  /**
   * Send waiting polls for up to `max` records in all, so that what they
   * claim after the first answer never exceeds it. With at least as many
   * records as shards, every shard waits for its part, a wait slice at a
   * time; with fewer, one record each on as many shards as records, in
   * turn, a short slice at a time. A shard whose last wait's slice is not
   * over yet waits its turn; returns the earliest such turn.
   */
  spreadWaits(max, remaining, t) {
    const n = this.shardCount;
    const free = (s) => !this.waiting[s] && this.quietUntil[s] <= t;
    if (max >= n) {
      const base = Math.floor(max / n);
      const extra = max % n;
      const slice = Math.min(remaining, this.waitSliceMs);
      for (let shard = 0; shard < n; shard++) {
        if (free(shard)) this.spawnWait(shard, base + (shard < extra ? 1 : 0), slice, t);
      }
    } else {
      const slice = Math.min(remaining, SHORT_WAIT_SLICE_MS);
      for (let out = this.out; out < max; out++) {
        let idle;
        for (let i = 0; i < n; i++) {
          const s = (this.next + i) % n;
          if (free(s)) {
            idle = s;
            break;
          }
        }
        if (idle === undefined) break;
        this.next = (idle + 1) % n;
        this.spawnWait(idle, 1, slice, t);
      }
    }
    let earliest;
    for (let s = 0; s < n; s++) {
      const q = this.quietUntil[s];
      if (!this.waiting[s] && q > t && (earliest === undefined || q < earliest)) earliest = q;
    }
    return earliest;
  }

  spawnWait(shard, maxRecords, sliceMs, t) {
    this.quietUntil[shard] = t + sliceMs;
    this.spawnPoll(shard, maxRecords, Math.max(1, Math.ceil(sliceMs)));
  }

  handOut(max) {
    return this.ready.splice(0, max);
  }

  /** Send one shard's poll; its answer is taken in whenever it comes. */
  spawnPoll(shard, maxRecords, waitMs) {
    this.waiting[shard] = true;
    this.out++;
    this.client.groupPoll(this.ref, shard, this.groupName, { maxRecords, waitMs, ...this.pollOptions }).then(
      (records) => this.take(shard, records, undefined),
      (err) => this.take(shard, undefined, err),
    );
  }

  /** Take in one shard poll's answer: records join `ready`, an error waits in `deferred`. */
  take(shard, records, err) {
    this.waiting[shard] = false;
    this.out--;
    if (err !== undefined && (err instanceof DisconnectedError || err instanceof ConnectionError) && this.pollOptions.reclaim) {
      // The connection of the shard's core dropped. A member that reclaims
      // takes back, on its first poll of each shard over the new
      // connection, what the old one held, so records held here from that
      // core's shards would come out twice: let the reclaim hand them out.
      const lost = this.placement[shard];
      this.ready = this.ready.filter((r) => !(r.shard === shard || (lost !== undefined && this.placement[r.shard] === lost)));
    }
    const got = (records ?? []).map((r) => Object.assign(r, { shard }));
    if (this.handedBack) {
      // close() stopped waiting for this poll: hand its records back now.
      for (const r of got) this.nackQuietly(r);
      return;
    }
    this.ready.push(...got);
    if (err !== undefined) {
      if (this.closeErrors) this.closeErrors.push(err);
      else this.deferred ??= err;
    }
    this.wake();
  }

  nackQuietly(record) {
    this.client.groupNack(this.ref, record.shard, this.groupName, record).catch(() => {});
  }

  wake() {
    for (const waker of [...this.wakers]) waker();
  }

  /** Resolve at the next answer, `endRun`, or `until` (a `now()` time; undefined: no limit). */
  changed(until) {
    return new Promise((resolve) => {
      let timer;
      const waker = () => {
        clearTimeout(timer);
        this.wakers.delete(waker);
        resolve();
      };
      if (until !== undefined) timer = setTimeout(waker, timerDelay(Math.ceil(until - now())));
      this.wakers.add(waker);
    });
  }

  /** A record's shard, checked against the stream's. */
  shardOf(record) {
    if (record === null || typeof record !== 'object') {
      throw new InvalidArgumentError('expected a record delivered by this ShardedGroup ({shard, offset, attempts})');
    }
    const { shard } = record;
    if (!Number.isInteger(shard) || shard < 0 || shard >= this.shardCount) {
      throw new InvalidArgumentError(`record.shard must be a shard of the stream (0 to ${this.shardCount - 1}), not ${String(shard)}`);
    }
    return shard;
  }

  /**
   * Finish a record (on its shard).
   * @param {import('../index').ShardedRecord} record
   * @returns {Promise<void>}
   */
  async ack(record) {
    return this.client.groupAck(this.ref, this.shardOf(record), this.groupName, record.offset);
  }

  /**
   * Finish several records: one request per shard (per 100,000 offsets),
   * all sent before any answer is awaited. On an error every request is
   * still awaited and the first error thrown.
   * @param {import('../index').ShardedRecord[]} records
   * @returns {Promise<void>}
   */
  async ackMany(records) {
    if (!Array.isArray(records)) throw new InvalidArgumentError('ackMany takes an array of records');
    /** @type {Map<number, Array<bigint|number>>} */
    const byShard = new Map();
    for (const r of records) {
      const shard = this.shardOf(r);
      let list = byShard.get(shard);
      if (!list) byShard.set(shard, (list = []));
      list.push(r.offset);
    }
    const acks = [];
    for (const shard of [...byShard.keys()].sort((a, b) => a - b)) {
      const offsets = byShard.get(shard);
      for (let i = 0; i < offsets.length; i += wire.MAX_ITEMS_PER_VEC) {
        acks.push(this.client.groupAck(this.ref, shard, this.groupName, offsets.slice(i, i + wire.MAX_ITEMS_PER_VEC)));
      }
    }
    const results = await Promise.allSettled(acks);
    const failed = results.find((r) => r.status === 'rejected');
    if (failed) throw failed.reason;
  }

  /**
   * Hand a record back to its shard's group: owed again now, or once
   * `delayMs` has passed (needs `FEATURES.GROUP_CLAIM_CONTROL`).
   * @param {import('../index').ShardedRecord} record
   * @param {{delayMs?: number, reason?: string}} [options]
   * @returns {Promise<void>}
   */
  async nack(record, options = {}) {
    return this.client.groupNack(this.ref, this.shardOf(record), this.groupName, record, options);
  }

  /**
   * Hand a record back, owed again once `delayMs` has passed.
   * @param {import('../index').ShardedRecord} record
   * @param {number} delayMs
   * @param {{reason?: string}} [options]
   * @returns {Promise<void>}
   */
  async nackAfter(record, delayMs, options = {}) {
    return this.client.groupNackAfter(this.ref, this.shardOf(record), this.groupName, record, delayMs, options);
  }

  /**
   * Extend the claim on a record by `byMs`.
   * @param {import('../index').ShardedRecord} record
   * @param {number} byMs
   * @returns {Promise<number>} how long the claim now stands, in ms
   */
  async extend(record, byMs) {
    return this.client.groupExtend(this.ref, this.shardOf(record), this.groupName, record, byMs);
  }

  /**
   * Give up on a record: list it as a dead letter of its shard's group
   * (with an optional reason) and finish it.
   * @param {import('../index').ShardedRecord} record
   * @param {string} [reason]
   * @returns {Promise<void>}
   */
  async deadLetter(record, reason) {
    return this.client.groupDeadLetter(this.ref, this.shardOf(record), this.groupName, record, reason);
  }

  /**
   * The group on every shard, in shard order.
   * @returns {Promise<import('../index').GroupInfo[]>}
   */
  async describe() {
    const infos = [];
    for (let shard = 0; shard < this.shardCount; shard++) {
      infos.push(this.client.groupDescribe(this.ref, shard, this.groupName));
    }
    return Promise.all(infos);
  }

  /**
   * Records published to the stream and not yet finished by the group,
   * over every shard.
   * @returns {Promise<bigint>}
   */
  async lag() {
    return (await this.describe()).reduce((sum, info) => sum + info.lag, 0n);
  }

  /**
   * End the running poll (it resolves empty), wait for the shard polls
   * still out (about a wait slice; at most that plus 5 s, after which
   * what they claim is handed back as it arrives, or lapses back to the
   * group) and hand back (nack) every record held, all nacks at once. A
   * claim that already lapsed (`StaleClaimError`) is not an error. Throws
   * the first other error met; every record is still tried. Calling it
   * again returns the same promise. The client stays open.
   * @returns {Promise<void>}
   */
  close() {
    if (!this.closing) {
      this.closed = true;
      this.endRun();
      this.closing = this.handBack();
    }
    return this.closing;
  }

  async handBack() {
    this.closeErrors = [];
    this.deferred = undefined;
    const deadline = now() + this.waitSliceMs + CLOSE_GRACE_MS;
    while (this.out > 0 && now() < deadline) await this.changed(deadline);
    this.handedBack = true;
    const errors = this.closeErrors;
    const records = this.ready.splice(0);
    const nacks = await Promise.allSettled(records.map((r) => this.client.groupNack(this.ref, r.shard, this.groupName, r)));
    for (const n of nacks) {
      // StaleClaim: the claim lapsed and the record already went back.
      if (n.status === 'rejected' && !(n.reason instanceof StaleClaimError)) errors.push(n.reason);
    }
    if (errors.length > 0) throw errors[0];
  }
}

module.exports = { ShardedGroup, DEFAULT_WAIT_SLICE_MS, SHORT_WAIT_SLICE_MS, CLOSE_GRACE_MS };
