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

/**
 * Where a `ShardedGroup` sends each shard's calls: a `Client` (to the core
 * that owns the shard) or a `ClusterClient` (to the broker that leads it,
 * as the Rust client's `ShardedGroup::on_cluster`). Both have these
 * methods, with the same arguments.
 * @typedef {Pick<import('./client').Client,
 *   'describeStream'|'groupPoll'|'groupAck'|'groupNack'|'groupNackAfter'|'groupExtend'|'groupDeadLetter'|'groupDescribe'>} ShardTarget
 */

/** An AbortSignal's reason as an error to reject with. */
function abortReason(signal) {
  return signal.reason ?? new DOMException('The operation was aborted', 'AbortError');
}

/**
 * One consumer of a group on every shard of a stream. Made by
 * `client.shardedGroup(stream, group, options)`, or by
 * `cluster.shardedGroup(...)` on a `ClusterClient`, which sends each
 * shard's calls to the broker that leads it.
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
 * Custody: every shard poll's answer is held here first, and records leave
 * only as the value of a `poll()` that resolves with them (taken from what
 * is held in the same step as it resolves) or as `close()`'s nacks. A poll
 * that cannot give them to its caller gives none: one ended by a newer
 * `poll()` or by `close()` resolves `[]`, one whose `signal` aborted
 * rejects with the signal's reason, and what their shard polls claimed,
 * before or after, stays held for the next `poll()` or `close()`. So to give
 * up on a poll, pass a `signal` (`AbortSignal.timeout(ms)`), never a
 * `Promise.race` timeout: a poll cannot know its caller stopped listening,
 * and one raced and left running resolves with what its waits bring before
 * the next `poll()`, to nobody (those claims then lapse back to the group
 * when their visibility ends).
 *
 * `close()` waits for the polls still out (about a wait slice; at most
 * 5 s more) and hands back (nacks) everything held, so another consumer
 * gets it at once, with the attempt counted. It does not close the client.
 */
class ShardedGroup {
  /** @type {ShardTarget} */
  #client;
  #ref;
  #group;
  #shards;
  /**
   * The broker core of each shard, when the polls began: shards on one core
   * share a connection. Empty over a cluster: each shard is on its own
   * leader's connection, and no placement says which shards share one.
   */
  #placement;
  #pollOptions;
  #waitSliceMs;
  /** Where the next sweep (and the next rotating wait) starts. */
  #next = 0;
  /** @type {import('../index').ShardedRecord[]} Claimed, not yet handed out; handed out before anything else. */
  #ready = [];
  /** An error answered while records were at hand (or no poll was running), for the next poll with none. */
  #deferred = undefined;
  /** Shards with a poll out (at most one each). */
  #waiting;
  #out = 0;
  /** No new waiting poll goes to a shard before this (its last one's slice). */
  #quietUntil;
  /** Wakers of whoever waits for an answer (the running poll, or close). */
  #wakers = new Set();
  /** The running poll: `{ended: boolean}`. */
  #run = undefined;
  #closed = false;
  /** During close: errors of polls answering. */
  #closeErrors = undefined;
  /** After close gave up waiting: records that arrive are handed back at once. */
  #handedBack = false;
  #closing = undefined;

  /**
   * Use `client.shardedGroup(...)`, which asks the broker for the shard count.
   * @param {ShardTarget} client
   * @param {{tenant: string, namespace: string, stream: string}} ref
   * @param {string} group
   * @param {{shards: number, placement: number[]}} info the stream's shards, and the core of each when shards on one core share a connection
   * @param {import('../index').ShardedGroupOptions} options checked
   * @private
   */
  constructor(client, ref, group, info, options) {
    this.#client = client;
    this.#ref = ref;
    this.#group = group;
    this.#shards = info.shards;
    this.#placement = info.placement;
    this.#pollOptions = {
      consumer: options.consumer,
      reclaim: options.reclaim,
      visibilityMs: options.visibilityMs,
    };
    this.#waitSliceMs = options.waitSliceMs;
    this.#waiting = new Array(info.shards).fill(false);
    this.#quietUntil = new Array(info.shards).fill(0);
  }

  /**
   * @param {ShardTarget} client where each shard's calls go
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @param {import('../index').ShardedGroupOptions} [options]
   * @param {{byCore?: boolean}} [target] `byCore: false` when shards do not
   *   share connections by their core (a cluster's: each on its leader's)
   * @returns {Promise<ShardedGroup>}
   * @private
   */
  static async open(client, stream, group, options = {}, { byCore = true } = {}) {
    const ref = args.streamRef(stream);
    args.name(group, 'group');
    args.options(options, OPTION_KEYS, 'shardedGroup option');
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
    const placement = byCore ? (info.placement ?? []) : [];
    return new ShardedGroup(client, ref, group, { shards: info.shards, placement }, o);
  }

  /** The stream's shard count. @returns {number} */
  get shards() {
    return this.#shards;
  }

  /** The group's name. @returns {string} */
  get group() {
    return this.#group;
  }

  /** The stream, as `{tenant, namespace, stream}`. */
  get stream() {
    return { ...this.#ref };
  }

  /**
   * Records claimed by shard polls and not yet handed out by `poll()`
   * (answers still on their way not counted). @returns {number}
   */
  get held() {
    return this.#ready.length;
  }

  /**
   * Claim up to `maxRecords` records from any of the stream's shards,
   * waiting up to `waitMs` for one when none is available. An empty array
   * means nothing was (or this poll was ended by a newer `poll()` or by
   * `close()`). `signal` aborts it, rejecting with the signal's reason;
   * an aborted or ended poll hands out nothing, and what it claimed stays
   * held for the next. Time a poll out with `waitMs` or `signal`, not
   * with `Promise.race`.
   * @param {import('../index').ShardedPollOptions} [options] defaults: 16 records, no wait
   * @returns {Promise<import('../index').ShardedRecord[]>}
   */
  async poll(options = {}) {
    args.options(options, POLL_OPTION_KEYS, 'poll option');
    const max = args.u32(options.maxRecords ?? 16, 'maxRecords', 1);
    const waitMs = args.millis(options.waitMs ?? 0, 'waitMs');
    const { signal } = options;
    if (signal !== undefined && !(signal instanceof AbortSignal)) {
      throw new InvalidArgumentError('signal must be an AbortSignal');
    }
    if (this.#closed) throw new DisconnectedError('the sharded group is closed');
    signal?.throwIfAborted();
    // One poll at a time: an earlier one still running (abandoned by its
    // caller) ends now and hands out nothing; its claims stay held.
    this.#endRun();
    const run = { ended: false };
    this.#run = run;
    // Only this poll: a signal aborting once a newer poll runs ends nothing.
    const onAbort = () => {
      if (this.#run === run) this.#endRun();
    };
    signal?.addEventListener('abort', onAbort);
    try {
      await this.#pollRun(run, max, waitMs);
      // From here to the return nothing else runs: records leave `ready`
      // only as this poll's value, and only while its caller still wants it.
      if (run.ended || signal?.aborted) {
        if (signal?.aborted) throw abortReason(signal);
        return [];
      }
      if (this.#ready.length > 0) return this.#ready.splice(0, max);
      const err = this.#deferred;
      this.#deferred = undefined;
      if (err !== undefined) throw err;
      return [];
    } finally {
      signal?.removeEventListener('abort', onAbort);
      if (this.#run === run) this.#run = undefined;
    }
  }

  /** End the running poll, if any; it resolves empty at its next step. */
  #endRun() {
    if (!this.#run) return;
    this.#run.ended = true;
    this.#run = undefined;
    this.#wake();
  }

  /**
   * Claim and wait until there is something to give (records held, or an
   * error with none), the poll's wait is over, or the poll is ended. Hands
   * out nothing: every shard poll's answer goes to `ready` (or `deferred`)
   * as it arrives, whoever is waiting, and `poll()` takes from there.
   */
  async #pollRun(run, max, waitMs) {
    const deadline = now() + waitMs;
    if (this.#ready.length > 0 || this.#deferred !== undefined) return;
    const somethingToGive = () => this.#ready.length > 0 || this.#deferred !== undefined;

    const start = this.#next;
    this.#next = (this.#next + 1) % this.#shards;
    for (let i = 0; i < this.#shards; i++) {
      const shard = (start + i) % this.#shards;
      // A waiting poll is already out there and gets what arrives.
      if (this.#waiting[shard]) continue;
      const want = max - this.#ready.length;
      if (want <= 0) break;
      this.#spawnPoll(shard, want, 0);
      while (this.#waiting[shard]) {
        await this.#changed(undefined);
        if (run.ended) return;
        // An error with nothing at hand is the caller's at once, whichever
        // shard answered it (as the Rust client); beside records it waits.
        if (this.#ready.length === 0 && this.#deferred !== undefined) return;
      }
    }
    if (this.#ready.length > 0 || waitMs === 0) return;

    // Nothing anywhere: wait.
    for (;;) {
      const t = now();
      if (deadline - t < 1) return;
      const freeAt = this.#spreadWaits(max, deadline - t, t);
      await this.#changed(freeAt === undefined ? deadline : Math.min(freeAt, deadline));
      if (run.ended || somethingToGive()) return;
    }
  }

  /**
   * Send waiting polls for up to `max` records in all, so that what they
   * claim after the first answer never exceeds it. With at least as many
   * records as shards, every shard waits for its part, a wait slice at a
   * time; with fewer, one record each on as many shards as records, in
   * turn, a short slice at a time. A shard whose last wait's slice is not
   * over yet waits its turn; returns the earliest such turn.
   */
  #spreadWaits(max, remaining, t) {
    const n = this.#shards;
    const free = (s) => !this.#waiting[s] && this.#quietUntil[s] <= t;
    if (max >= n) {
      const base = Math.floor(max / n);
      const extra = max % n;
      const slice = Math.min(remaining, this.#waitSliceMs);
      for (let shard = 0; shard < n; shard++) {
        if (free(shard)) this.#spawnWait(shard, base + (shard < extra ? 1 : 0), slice, t);
      }
    } else {
      const slice = Math.min(remaining, SHORT_WAIT_SLICE_MS);
      for (let out = this.#out; out < max; out++) {
        let idle;
        for (let i = 0; i < n; i++) {
          const s = (this.#next + i) % n;
          if (free(s)) {
            idle = s;
            break;
          }
        }
        if (idle === undefined) break;
        this.#next = (idle + 1) % n;
        this.#spawnWait(idle, 1, slice, t);
      }
    }
    let earliest;
    for (let s = 0; s < n; s++) {
      const q = this.#quietUntil[s];
      if (!this.#waiting[s] && q > t && (earliest === undefined || q < earliest)) earliest = q;
    }
    return earliest;
  }

  #spawnWait(shard, maxRecords, sliceMs, t) {
    this.#quietUntil[shard] = t + sliceMs;
    this.#spawnPoll(shard, maxRecords, Math.max(1, Math.ceil(sliceMs)));
  }

  /** Send one shard's poll; its answer is taken in whenever it comes. */
  #spawnPoll(shard, maxRecords, waitMs) {
    this.#waiting[shard] = true;
    this.#out++;
    let answer;
    try {
      answer = Promise.resolve(this.#client.groupPoll(this.#ref, shard, this.#group, { maxRecords, waitMs, ...this.#pollOptions }));
    } catch (err) {
      answer = Promise.reject(err);
    }
    answer.then(
      (records) => this.#take(shard, records, undefined),
      (err) => this.#take(shard, undefined, err),
    );
  }

  /**
   * Take in one shard poll's answer: records join `ready`, an error waits
   * in `deferred` (or, during close, in `closeErrors`). Never throws: a
   * failure taking the answer in is deferred as the answer's error, and
   * the records taken in before it stay held.
   */
  #take(shard, records, err) {
    this.#waiting[shard] = false;
    this.#out--;
    try {
      if (
        err !== undefined &&
        (err instanceof DisconnectedError || err instanceof ConnectionError) &&
        this.#pollOptions.reclaim &&
        !this.#closed
      ) {
        // The connection of the shard's core dropped. A member that
        // reclaims takes back, on its first poll of each shard over the
        // new connection, what the old one held, so records held here from
        // that core's shards would come out twice: let the reclaim hand
        // them out. Not once closing: close() hands back what is held.
        // (Over a cluster, with no placement: the shard's own.)
        const lost = this.#placement[shard];
        this.#ready = this.#ready.filter((r) => !(r.shard === shard || (lost !== undefined && this.#placement[r.shard] === lost)));
      }
      if (records !== undefined) {
        if (this.#handedBack) {
          // close() stopped waiting for this poll: hand its records back now.
          for (const r of records) this.#nackQuietly(Object.assign(r, { shard }));
        } else {
          this.#hold(shard, records);
        }
      }
    } catch (e) {
      err ??= e;
    }
    if (err !== undefined && !this.#handedBack) {
      if (this.#closeErrors) this.#closeErrors.push(err);
      else this.#deferred ??= err;
    }
    this.#wake();
  }

  /**
   * Add one shard's records to `ready`, one (shard, offset) once: a record
   * already held (a reconnect and reclaim can hand it out again) keeps the
   * delivery with the most attempts, the latest.
   */
  #hold(shard, records) {
    const at = new Map();
    for (let i = 0; i < this.#ready.length; i++) {
      const r = this.#ready[i];
      if (r.shard === shard) at.set(r.offset, i);
    }
    for (const record of records) {
      const r = Object.assign(record, { shard });
      const i = at.get(r.offset);
      if (i === undefined) {
        at.set(r.offset, this.#ready.length);
        this.#ready.push(r);
      } else if (r.attempts > this.#ready[i].attempts) {
        this.#ready[i] = r;
      }
    }
  }

  #nackQuietly(record) {
    Promise.resolve()
      .then(() => this.#client.groupNack(this.#ref, record.shard, this.#group, record))
      .catch(() => {});
  }

  #wake() {
    for (const waker of [...this.#wakers]) waker();
  }

  /** Resolve at the next answer, `endRun`, or `until` (a `now()` time; undefined: no limit). */
  #changed(until) {
    return new Promise((resolve) => {
      let timer;
      const waker = () => {
        clearTimeout(timer);
        this.#wakers.delete(waker);
        resolve();
      };
      if (until !== undefined) timer = setTimeout(waker, timerDelay(Math.ceil(until - now())));
      this.#wakers.add(waker);
    });
  }

  /** A record's shard, checked against the stream's. */
  #shardOf(record) {
    if (record === null || typeof record !== 'object') {
      throw new InvalidArgumentError('expected a record delivered by this ShardedGroup ({shard, offset, attempts})');
    }
    const { shard } = record;
    if (!Number.isInteger(shard) || shard < 0 || shard >= this.#shards) {
      throw new InvalidArgumentError(`record.shard must be a shard of the stream (0 to ${this.#shards - 1}), not ${String(shard)}`);
    }
    return shard;
  }

  /**
   * Finish a record (on its shard).
   * @param {import('../index').ShardedRecord} record
   * @returns {Promise<void>}
   */
  async ack(record) {
    return this.#client.groupAck(this.#ref, this.#shardOf(record), this.#group, record.offset);
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
      const shard = this.#shardOf(r);
      let list = byShard.get(shard);
      if (!list) byShard.set(shard, (list = []));
      list.push(r.offset);
    }
    const acks = [];
    for (const shard of [...byShard.keys()].sort((a, b) => a - b)) {
      const offsets = byShard.get(shard);
      for (let i = 0; i < offsets.length; i += wire.MAX_ITEMS_PER_VEC) {
        acks.push(this.#client.groupAck(this.#ref, shard, this.#group, offsets.slice(i, i + wire.MAX_ITEMS_PER_VEC)));
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
    return this.#client.groupNack(this.#ref, this.#shardOf(record), this.#group, record, options);
  }

  /**
   * Hand a record back, owed again once `delayMs` has passed.
   * @param {import('../index').ShardedRecord} record
   * @param {number} delayMs
   * @param {{reason?: string}} [options]
   * @returns {Promise<void>}
   */
  async nackAfter(record, delayMs, options = {}) {
    return this.#client.groupNackAfter(this.#ref, this.#shardOf(record), this.#group, record, delayMs, options);
  }

  /**
   * Let the claim on a record stand for `byMs` from now (which can shorten
   * it).
   * @param {import('../index').ShardedRecord} record
   * @param {number} byMs
   * @returns {Promise<number>} how long the claim now stands, in ms
   */
  async extend(record, byMs) {
    return this.#client.groupExtend(this.#ref, this.#shardOf(record), this.#group, record, byMs);
  }

  /**
   * Give up on a record: list it as a dead letter of its shard's group
   * (with an optional reason) and finish it.
   * @param {import('../index').ShardedRecord} record
   * @param {string} [reason]
   * @returns {Promise<void>}
   */
  async deadLetter(record, reason) {
    return this.#client.groupDeadLetter(this.#ref, this.#shardOf(record), this.#group, record, reason);
  }

  /**
   * The group on every shard, in shard order.
   * @returns {Promise<import('../index').GroupInfo[]>}
   */
  async describe() {
    // A shard not polled yet is described as its first poll will make it.
    return this.#client.groupDescribeStream(this.#ref, this.#group);
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
   * the first other error met (a shard poll's answer included); every
   * record is still tried. Calling it again returns the same promise. The
   * client stays open.
   * @returns {Promise<void>}
   */
  close() {
    if (!this.#closing) {
      this.#closed = true;
      this.#endRun();
      this.#closing = this.#handBack();
    }
    return this.#closing;
  }

  async #handBack() {
    this.#closeErrors = [];
    this.#deferred = undefined;
    const deadline = now() + this.#waitSliceMs + CLOSE_GRACE_MS;
    while (this.#out > 0 && now() < deadline) await this.#changed(deadline);
    this.#handedBack = true;
    const errors = this.#closeErrors;
    const records = this.#ready.splice(0);
    const nacks = await Promise.allSettled(records.map(async (r) => this.#client.groupNack(this.#ref, r.shard, this.#group, r)));
    for (const n of nacks) {
      // StaleClaim: the claim lapsed and the record already went back.
      if (n.status === 'rejected' && !(n.reason instanceof StaleClaimError)) errors.push(n.reason);
    }
    if (errors.length > 0) throw errors[0];
  }
}

module.exports = { ShardedGroup, DEFAULT_WAIT_SLICE_MS, SHORT_WAIT_SLICE_MS, CLOSE_GRACE_MS };
