'use strict';

/**
 * `Subscription`: follow one shard record by record.
 * @module felix-client/subscription
 */

const args = require('./args');
const { ProtocolError } = require('./errors');
const { timerDelay } = require('./connection');

/** An empty answer faster than this means the broker did not wait: pause before asking again. */
const TOO_FAST_MS = 20;
const EMPTY_PAUSE_MS = 50;
/** Least pause after a failed read before reading again. */
const ERROR_PAUSE_MS = 100;

/**
 * A read's answer must move forward from where it was asked to start:
 * records ascending at or above it, and the next position past them.
 * @param {bigint|undefined} from undefined for 'earliest'/'latest'
 */
function checkBatch(from, batch) {
  let prev;
  for (const r of batch.records) {
    if ((from !== undefined && r.offset < from) || (prev !== undefined && r.offset <= prev)) {
      throw new ProtocolError(`read answer out of order: record ${r.offset} after ${prev}, asked from ${from}`);
    }
    prev = r.offset;
  }
  if ((prev !== undefined && batch.nextOffset <= prev) || (from !== undefined && batch.nextOffset < from)) {
    throw new ProtocolError(`read answer's next offset ${batch.nextOffset} does not move past its records`);
  }
  return batch;
}

/**
 * Follows one shard from a starting position, yielding every record in
 * offset order and long-polling at the tail. Made by `subscribe` (of a
 * `Client`, or of a `ClusterClient`, which reads from the shard's leader);
 * use it with `for await`. It never ends by itself: `close()` it, or
 * `break` out of the loop.
 *
 * A failed read (as the Rust client's subscription) rejects that `next()`
 * with the error, which ends a `for await` loop; the subscription stays
 * usable, and the next `next()` (a new `for await` over the same
 * subscription) reads again from the same position after a short pause
 * (the client's `reconnectBackoffMs`, at least 100 ms), so a loop that
 * catches and carries on rides out a broker restart. Stop on errors you
 * consider permanent (such as `NotFoundError`). An empty answer that came
 * back at once (the broker did not wait) is followed by a 50 ms pause, so
 * a `waitMs` of 0 does not spin.
 */
class Subscription {
  /**
   * A subscription reading through `client` (a `Client`, or a
   * `ClusterClient`), its arguments checked: what `subscribe` returns.
   * @param {import('./client').Client|import('./cluster').ClusterClient} client
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {import('../index').StartPosition} from
   * @param {{maxRecords?: number, waitMs?: number}} [options] defaults: 500 records a read, 10 s wait
   * @returns {Subscription}
   * @private
   */
  static follow(client, stream, shard, from, options = {}) {
    const ref = args.streamRef(stream);
    args.u32(shard, 'shard');
    args.options(options, ['maxRecords', 'waitMs'], 'subscribe option');
    return new Subscription(client, ref, shard, args.startPosition(from, 'from'), {
      maxRecords: args.u32(options.maxRecords ?? 500, 'maxRecords', 1),
      waitMs: args.millisU32(options.waitMs ?? 10_000, 'waitMs'),
    });
  }

  /**
   * @param {import('./client').Client|import('./cluster').ClusterClient} client its `read` and `options.reconnectBackoffMs` are used
   * @param {{tenant: string, namespace: string, stream: string}} ref
   * @param {number} shard
   * @param {'earliest'|'latest'|bigint} from
   * @param {{maxRecords: number, waitMs: number}} options
   */
  constructor(client, ref, shard, from, options) {
    this.client = client;
    this.ref = ref;
    this.shard = shard;
    /** Where the next read starts: `'earliest'`, `'latest'` or an offset. */
    this.position = from;
    this.options = options;
    this.buffered = [];
    this.closed = false;
    /** Offsets retention removed before this subscription read them. */
    this.skipped = 0n;
    /** When the next read may be sent (ms since the epoch): after a fast empty answer or an error. */
    this.pauseUntil = 0;
    /** The pause in progress, so `close()` can cut it short. */
    this.pause = undefined;
  }

  /**
   * How many offsets retention removed before this subscription read them:
   * a reader that falls further behind than the stream's retention jumps to
   * the oldest record the shard still holds, and this says how far.
   * @returns {bigint}
   */
  get skippedByRetention() {
    return this.skipped;
  }

  /** Stop: the iteration ends after the record it is on (a read already sent still finishes). */
  close() {
    this.closed = true;
    this.buffered = [];
    this.pause?.wake();
  }

  /** @returns {AsyncIterator<import('../index').Record>} */
  [Symbol.asyncIterator]() {
    return {
      next: () => this.next(),
      return: async () => {
        this.close();
        return { done: true, value: undefined };
      },
    };
  }

  /** The next record, waiting at the tail for one; rejects with a failed read's error. */
  async next() {
    while (this.buffered.length === 0) {
      if (this.closed) return { done: true, value: undefined };
      await this.sleep();
      if (this.closed) return { done: true, value: undefined };
      await this.fill();
    }
    if (this.closed) return { done: true, value: undefined };
    return { done: false, value: this.buffered.shift() };
  }

  /** Wait out a pause set by the last read; `close()` ends it early. */
  sleep() {
    const ms = this.pauseUntil - Date.now();
    if (ms <= 0) return undefined;
    return new Promise((resolve) => {
      const timer = setTimeout(() => this.pause?.wake(), timerDelay(ms));
      this.pause = {
        wake: () => {
          clearTimeout(timer);
          this.pause = undefined;
          resolve();
        },
      };
    });
  }

  async fill() {
    const started = Date.now();
    const from = this.position;
    const asked = typeof from === 'bigint' ? from : undefined;
    let batch;
    try {
      batch = checkBatch(asked, await this.client.read(this.ref, this.shard, from, this.options));
    } catch (err) {
      // Read again from the same position, after a pause.
      this.pauseUntil = Date.now() + Math.max(this.client.options.reconnectBackoffMs, ERROR_PAUSE_MS);
      throw err;
    }
    if (asked !== undefined && batch.startOffset > asked) this.skipped += batch.startOffset - asked;
    this.position = batch.nextOffset;
    this.buffered = batch.records;
    if (batch.records.length === 0 && Date.now() - started < TOO_FAST_MS) {
      this.pauseUntil = Date.now() + EMPTY_PAUSE_MS;
    }
  }
}

module.exports = { Subscription };
