'use strict';

/**
 * `Subscription`: follow one shard record by record.
 * @module felix-client/subscription
 */

const { ProtocolError } = require('./errors');

/** An empty answer faster than this means the broker did not wait: pause before asking again. */
const TOO_FAST_MS = 20;
const EMPTY_PAUSE_MS = 50;

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
 * offset order and long-polling at the tail. Made by `Client.subscribe`;
 * use it with `for await`. It never ends by itself: `close()` it, or
 * `break` out of the loop. A failed read rejects the iteration (ending the
 * loop); `position` says where to resubscribe from.
 */
class Subscription {
  /**
   * @param {import('./client').Client} client
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
  }

  /** Stop: the iteration ends after the record it is on (a read already sent still finishes). */
  close() {
    this.closed = true;
    this.buffered = [];
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

  /** The next record, waiting at the tail for one. */
  async next() {
    while (this.buffered.length === 0) {
      if (this.closed) return { done: true, value: undefined };
      await this.fill();
    }
    if (this.closed) return { done: true, value: undefined };
    return { done: false, value: this.buffered.shift() };
  }

  async fill() {
    const started = Date.now();
    const from = this.position;
    const batch = checkBatch(
      typeof from === 'bigint' ? from : undefined,
      await this.client.read(this.ref, this.shard, from, this.options),
    );
    this.position = batch.nextOffset;
    this.buffered = batch.records;
    if (batch.records.length === 0 && Date.now() - started < TOO_FAST_MS && this.options.waitMs > 0) {
      await new Promise((resolve) => setTimeout(resolve, EMPTY_PAUSE_MS));
    }
  }
}

module.exports = { Subscription };
