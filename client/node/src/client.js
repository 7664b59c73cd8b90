'use strict';

/**
 * `Client`: one connection per broker core, placement, and every call.
 * @module felix-client/client
 */

const args = require('./args');
const wire = require('./wire');
const { shardForKey } = require('./crc32c');
const { Connection, timerDelay } = require('./connection');
const streamGroups = require('./stream_groups');
const { Subscription } = require('./subscription');
const { ShardedGroup } = require('./sharded');
const {
  AlreadyExistsError,
  ConnectionError,
  DisconnectedError,
  FelixError,
  InvalidArgumentError,
  InvalidRequestError,
  NotFoundError,
  ProtocolError,
  UnsupportedError,
  WrongCoreError,
} = require('./errors');
const { version } = require('../package.json');

const { FEATURES, OP } = wire;

const DEFAULTS = Object.freeze({
  token: undefined,
  ackOnCommit: false,
  requestTimeoutMs: 30_000,
  connectTimeoutMs: 5_000,
  maxFrameBytes: 64 * 1024 * 1024,
  reconnectBackoffMs: 100,
  reconnectBackoffMaxMs: 5_000,
  clientName: `felix-client-node/${version}`,
});

const FEATURE_NAMES = Object.fromEntries(Object.entries(FEATURES).map(([n, bit]) => [bit, `FEATURE_${n}`]));

/** Split `host:port` (`[v6]:port` for IPv6). */
function parseAddr(addr) {
  const m = typeof addr === 'string' ? /^(?:\[([^\]]+)\]|([^:]+)):(\d+)$/.exec(addr) : null;
  const port = m ? Number(m[3]) : NaN;
  if (!m || port < 1 || port > 65535) {
    throw new InvalidArgumentError(`broker address must be "host:port", not ${JSON.stringify(addr)}`);
  }
  return { host: m[1] ?? m[2], port };
}

/** The options, checked, with defaults filled in; an unknown key (a typo) is refused. */
function clientOptions(options = {}) {
  if (options === null || typeof options !== 'object') {
    throw new InvalidArgumentError(`options must be an object, not ${String(options)}`);
  }
  for (const key of Object.keys(options)) {
    if (!Object.hasOwn(DEFAULTS, key)) {
      throw new InvalidArgumentError(`unknown option ${JSON.stringify(key)}; the options are ${Object.keys(DEFAULTS).join(', ')}`);
    }
  }
  const o = { ...DEFAULTS };
  for (const [key, value] of Object.entries(options)) if (value !== undefined) o[key] = value;
  for (const key of ['requestTimeoutMs', 'connectTimeoutMs', 'reconnectBackoffMs', 'reconnectBackoffMaxMs']) {
    args.millis(o[key], key);
  }
  args.u32(o.maxFrameBytes, 'maxFrameBytes', 64 * 1024);
  if (o.token !== undefined) args.name(o.token, 'token');
  args.name(o.clientName, 'clientName');
  return Object.freeze(o);
}

const pathOf = (ref) => `${ref.tenant}/${ref.namespace}/${ref.stream}`;

/** Every request a client sends, built from checked arguments. */
const requests = {
  createStream: (ref, shards, retentionBytes, retentionMs, incarnation) => ({
    name: 'create_stream',
    opcode: OP.CREATE_STREAM,
    features: incarnation === undefined ? 0 : FEATURES.STREAM_INCARNATION,
    body: (w) => {
      wire.putStreamRef(w, ref);
      w.u32(shards);
      w.opt(retentionBytes, w.u64);
      w.opt(retentionMs, w.u64);
      // A trailing field: written only when set.
      if (incarnation !== undefined) w.u64(incarnation);
    },
  }),
  streamOnly: (name, opcode, ref) => ({ name, opcode, body: (w) => wire.putStreamRef(w, ref) }),
  shardOnly: (name, opcode, ref, shard, features = 0) => ({
    name,
    opcode,
    features,
    body: (w) => {
      wire.putStreamRef(w, ref);
      w.u32(shard);
    },
  }),
  listStreams: (tenant) => ({ name: 'list_streams', opcode: OP.LIST_STREAMS, body: (w) => w.opt(tenant, w.str) }),
  /** An empty body. */
  describeCluster: () => ({ name: 'describe_cluster', opcode: OP.DESCRIBE_CLUSTER, features: FEATURES.CLUSTER_INFO, body: () => {} }),
  publish: (ref, target, ack, records) => ({
    name: 'publish',
    opcode: OP.PUBLISH,
    features: ack === wire.ACK.DEFAULT ? 0 : FEATURES.PUBLISH_ACK_MODE,
    sizeHint: 64 + records.reduce((n, r) => n + recordBytes(r) + 32 + 6 * r.headers.length, 0),
    body: (w) => {
      wire.putStreamRef(w, ref);
      if (target.key === undefined) {
        w.u8(0);
        w.u32(target.shard);
      } else {
        w.u8(1);
        w.blob(target.key);
      }
      w.u8(ack);
      w.u32(records.length);
      for (const r of records) wire.putRecordIn(w, r);
    },
  }),
  read: (ref, shard, from, maxRecords, maxBytes, waitMs) => ({
    name: 'read',
    opcode: OP.READ,
    body: (w) => {
      wire.putStreamRef(w, ref);
      w.u32(shard);
      wire.putStartPosition(w, from);
      w.u32(maxRecords);
      w.u32(maxBytes);
      w.u32(waitMs);
    },
  }),
  /** A group request: the GroupKey, then `rest`. */
  group: (name, opcode, features, key, rest = () => {}) => ({
    name,
    opcode,
    features: FEATURES.GROUPS | features,
    body: (w) => {
      wire.putGroupKey(w, key);
      rest(w);
    },
  }),
};

/** Payload, key and header bytes of a record: what the broker's record limit counts. */
function recordBytes(r) {
  return r.payload.length + (r.key?.length ?? 0)
    + r.headers.reduce((n, [k, v]) => n + Buffer.byteLength(k) + v.length, 0);
}

/** Fail on an answer of the wrong type (the broker answered with something else). */
function expect(msg, type, call) {
  if (msg.type !== type) throw new ProtocolError(`broker answered ${call} with ${msg.type}`);
  return msg;
}

function published(msg) {
  expect(msg, 'published', 'publish');
  return {
    shard: msg.shard,
    baseOffset: msg.baseOffset,
    count: msg.count,
    lastOffset: msg.baseOffset + BigInt(Math.max(msg.count - 1, 0)),
  };
}

/**
 * A dead-letter page must move forward: letters ascending, at or above
 * `from`, below `next`, and not empty while more are promised.
 */
function checkDeadLetterPage(from, page) {
  let prev;
  for (const d of page.letters) {
    if (d.offset < from || (prev !== undefined && d.offset <= prev)) {
      throw new ProtocolError(`dead-letter page from ${from} lists offset ${d.offset} out of order`);
    }
    prev = d.offset;
  }
  if (page.next !== undefined && prev === undefined) {
    throw new ProtocolError(`empty dead-letter page from ${from} promised more from ${page.next}`);
  }
  if (page.next !== undefined && page.next <= prev) {
    throw new ProtocolError(`dead-letter page from ${from} ends at ${prev} but says next ${page.next}`);
  }
  return page;
}

/**
 * A connection to one Felix broker.
 *
 * The client keeps one connection per broker core and sends each request
 * about a shard to the core that owns it (learned from `describeStream` and
 * cached); a `wrong_core` answer refreshes the placement and retries once on
 * the core the broker named. Requests are pipelined and answered out of
 * order, so a long poll never holds up an ack. A request in flight on a
 * connection that drops rejects with `DisconnectedError` and is not resent;
 * the next call reconnects, waiting a growing backoff after failed attempts.
 * A broker that comes back with fewer cores refuses a HELLO naming a core it
 * no longer runs: the client then learns the core count from a HELLO naming
 * none, moves its home core if that one is gone, drops cached placements
 * and sends the call to the shard's core now (as the Rust client).
 */
class Client {
  /**
   * Connect to `addr` and say HELLO. Use `Client.connect` rather than this.
   * @param {{host: string, port: number}} addr
   * @param {object} options checked options
   * @param {Connection} first
   * @private
   */
  constructor(addr, options, first) {
    this.addr = addr;
    this.options = options;
    /** @type {Map<number, {conn?: Connection, opening?: Promise<Connection>, backoffMs: number, retryAt: number}>} */
    this.slots = new Map();
    /** @type {Map<string, {shards: number, cores: number[]}>} */
    this.placements = new Map();
    /** Sleeps before reconnecting, cut short by `close()`. */
    this.sleeps = new Set();
    /** Aborts connection attempts in progress when the client closes. */
    this.abort = new AbortController();
    this.closed = false;
    this.learnHello(first.hello);
    this.home = first.hello.core;
    this.slot(first.hello.core).conn = first;
  }

  /**
   * Resolve the broker's address, open a first connection and say HELLO.
   * Rejects if the broker does not answer within `connectTimeoutMs` or
   * refuses HELLO (a bad token: `UnauthorizedError`).
   * @param {string} addr `"host:port"`
   * @param {import('../index').ClientOptions} [options]
   * @returns {Promise<Client>}
   */
  static async connect(addr, options) {
    return connectClient(addr, clientOptions(options));
  }

  /** Feature bits negotiated with the broker (`FEATURES.*`), from the latest HELLO. @returns {number} */
  get features() {
    return this.hello.features;
  }

  /** How many cores (shard owners) the broker runs. @returns {number} */
  get cores() {
    return this.hello.cores;
  }

  /** The broker's name and version, as given in HELLO. @returns {string} */
  get broker() {
    return this.hello.broker;
  }

  /** The largest frame the broker accepts, from the latest HELLO. @returns {number} */
  get maxFrameBytes() {
    return this.hello.maxFrameBytes;
  }

  /** The core requests not about one shard go to (moves if the broker comes back without it). @returns {number} */
  get homeCore() {
    return this.home;
  }

  /** The cores this client holds a live connection to, in order. @returns {number[]} */
  get connectedCores() {
    return [...this.slots].filter(([, slot]) => slot.conn && !slot.conn.closed).map(([core]) => core).sort((x, y) => x - y);
  }

  /**
   * Bytes of requests waiting for a backed-up socket to drain, over every
   * connection (they go out in order once it does). @returns {number}
   */
  get queuedBytes() {
    let n = 0;
    for (const slot of this.slots.values()) n += slot.conn?.queuedBytes ?? 0;
    return n;
  }

  /** Whether the broker advertised every bit of `feature`. @param {number} feature @returns {boolean} */
  hasFeature(feature) {
    return (this.features & feature) === feature;
  }

  /**
   * Close every connection. Requests in flight reject with
   * `DisconnectedError`; the client cannot be used afterwards. Leaves no
   * timer or socket behind, so the process can exit.
   */
  close() {
    if (this.closed) return;
    this.closed = true;
    // A connect in progress: its socket and timer go, its callers get DisconnectedError.
    this.abort.abort();
    for (const sleep of this.sleeps) sleep.cancel();
    this.sleeps.clear();
    for (const slot of this.slots.values()) slot.conn?.close();
  }

  // ----- connections and routing -------------------------------------------

  learnHello(hello) {
    if (this.hello && this.hello.cores !== hello.cores) this.placements.clear();
    this.hello = hello;
  }

  slot(core) {
    let slot = this.slots.get(core);
    if (!slot) {
      slot = { conn: undefined, opening: undefined, backoffMs: this.options.reconnectBackoffMs, retryAt: 0 };
      this.slots.set(core, slot);
    }
    return slot;
  }

  /** The live connection to `core`, opening one if needed. @returns {Promise<Connection>} */
  conn(core) {
    if (this.closed) return Promise.reject(new DisconnectedError('the client is closed'));
    const slot = this.slot(core);
    if (slot.conn && !slot.conn.closed) return Promise.resolve(slot.conn);
    if (slot.conn) this.retire(slot);
    // Callers arriving during an attempt share it (and its failure).
    slot.opening ??= this.open(core, slot).finally(() => {
      slot.opening = undefined;
    });
    return slot.opening;
  }

  /** Forget a closed connection; one that never proved healthy counts as a failed attempt. */
  retire(slot) {
    if (slot.conn.proved) {
      slot.backoffMs = this.options.reconnectBackoffMs;
    } else {
      this.backOff(slot);
    }
    slot.conn = undefined;
  }

  backOff(slot) {
    slot.retryAt = Date.now() + slot.backoffMs;
    slot.backoffMs = Math.min(slot.backoffMs * 2, this.options.reconnectBackoffMaxMs);
  }

  connectOptions(wantCore) {
    return { ...this.addr, ...connectOptions(this.options), wantCore, signal: this.abort.signal };
  }

  async open(core, slot) {
    await this.sleepUntil(slot.retryAt);
    let conn;
    try {
      conn = await Connection.open(this.connectOptions(core));
    } catch (err) {
      if (err instanceof InvalidRequestError && core > 0 && !this.closed && await this.learnCores() && core >= this.cores) {
        // The broker refused the core asked for because it came back with
        // fewer cores (learnt from a connection that asks for none; home
        // moved if it was that core, placements dropped). Nothing was sent;
        // callers that route by core try again where the shard is now.
        throw new ConnectionError(`the broker no longer runs core ${core} (it runs ${this.cores}): ${err.message}`);
      }
      this.backOff(slot);
      throw err;
    }
    if (this.closed) {
      conn.close();
      throw new DisconnectedError('the client is closed');
    }
    this.learnHello(conn.hello);
    slot.retryAt = 0;
    slot.conn = conn;
    return conn;
  }

  /**
   * After the broker refused a core: HELLO without asking for one, take its
   * core count (dropping placements if it changed) and move home to the
   * core the connection landed on if home is out of range. The connection
   * is kept for its core if that has none. False if the broker could not
   * be reached.
   */
  async learnCores() {
    let conn;
    try {
      conn = await Connection.open(this.connectOptions(undefined));
    } catch {
      return false;
    }
    if (this.closed) {
      conn.close();
      return false;
    }
    this.learnHello(conn.hello);
    if (this.home >= conn.hello.cores) this.home = conn.hello.core;
    const slot = this.slot(conn.hello.core);
    if (!slot.opening && !(slot.conn && !slot.conn.closed)) {
      slot.conn = conn;
      slot.retryAt = 0;
    } else {
      conn.close();
    }
    return true;
  }

  /**
   * `core`'s connection; if the broker no longer runs that core (so nothing
   * was sent), the connection to the core `again()` picks now.
   * @param {number} core
   * @param {() => number|Promise<number>} again
   */
  async connOrMoved(core, again) {
    try {
      return await this.conn(core);
    } catch (err) {
      if (this.closed || core < this.cores) throw err;
      return this.conn(await again());
    }
  }

  /** Wait until `at` (ms since the epoch); `close()` cuts it short with `DisconnectedError`. */
  sleepUntil(at) {
    const ms = at - Date.now();
    if (ms <= 0) return Promise.resolve();
    return new Promise((resolve, reject) => {
      const sleep = {
        timer: setTimeout(() => {
          this.sleeps.delete(sleep);
          resolve();
        }, timerDelay(ms)),
        cancel: () => {
          clearTimeout(sleep.timer);
          reject(new DisconnectedError('the client is closed'));
        },
      };
      this.sleeps.add(sleep);
    });
  }

  timeout(waitMs = 0) {
    return this.options.requestTimeoutMs + waitMs;
  }

  /** A request not about one shard: the home core serves it (a new home if the broker lost it). */
  async callAny(req) {
    const conn = await this.connOrMoved(this.home, () => this.home);
    return conn.call(req, this.timeout());
  }

  /** Send a request about `shard` to the core that owns it, following one `wrong_core` redirect. */
  async callShard(ref, shard, req, waitMs = 0) {
    const core = await this.coreFor(ref, shard);
    // That core gone (the broker came back with fewer cores): the shard's core now.
    const conn = await this.connOrMoved(core, () => this.coreFor(ref, shard));
    try {
      return await conn.call(req, this.timeout(waitMs));
    } catch (err) {
      if (!(err instanceof WrongCoreError)) throw err;
      return this.redirect(ref, shard, req, err, waitMs);
    }
  }

  /** After `wrong_core`: refresh the placement and send once more, to the core the broker named. */
  async redirect(ref, shard, req, wrongCore, waitMs) {
    // A failed refresh does not mask the core the broker named.
    let fresh;
    try {
      fresh = (await this.placement(ref, true)).cores[shard];
    } catch {
      fresh = undefined;
    }
    const inRange = (c) => c !== undefined && c < this.cores;
    const right = inRange(wrongCore.core) ? wrongCore.core : fresh;
    if (!inRange(right)) throw wrongCore;
    const conn = await this.conn(right);
    return conn.call(req, this.timeout(waitMs));
  }

  /**
   * The core to send a request about `shard` to. An error looking it up is
   * thrown as the request's, which was not sent (so `notApplied`).
   */
  async coreFor(ref, shard) {
    if (this.cores <= 1) return this.home;
    let p;
    try {
      p = await this.placement(ref, false);
      if (p.cores[shard] !== undefined && p.cores[shard] >= this.cores) {
        // Cached before the broker came back with fewer cores.
        p = await this.placement(ref, true);
      }
    } catch (e) {
      if (e instanceof FelixError) e.notApplied = true;
      throw e;
    }
    const core = p.cores[shard];
    // A shard the placement does not know (or a core the broker does not
    // have): let the broker answer, with the right core.
    return core !== undefined && core < this.cores ? core : this.home;
  }

  async placement(ref, refresh) {
    const cached = this.placements.get(pathOf(ref));
    if (cached && !refresh) return cached;
    return this.cachePlacement(await this.describeRef(ref));
  }

  cachePlacement(info) {
    const p = { shards: info.shards, cores: info.placement };
    this.placements.set(pathOf(info.stream), p);
    return p;
  }

  /** Throw `UnsupportedError` (local) unless the broker advertised `bits`. */
  requireFeatures(bits, what) {
    const missing = bits & ~this.features;
    if (missing === 0) return;
    const names = Object.keys(FEATURE_NAMES).filter((b) => missing & b).map((b) => FEATURE_NAMES[b]);
    throw new UnsupportedError(`${what} needs ${names.join(' and ')}, which the broker does not advertise`, { local: true });
  }

  // ----- streams -----------------------------------------------------------

  /**
   * Create a stream of `shards` shards on this broker.
   *
   * `incarnation` (1 to 2^63-1), for a broker of a cluster, names this
   * creation of the stream: every broker must hold the stream as the same
   * one, and `ClusterClient.createStream` chooses it and creates the stream
   * on every broker. Give it here only to create the stream on one broker
   * as the others hold it (their `describeStream().incarnation`). It needs
   * `FEATURES.STREAM_INCARNATION`, refused locally (`UnsupportedError`)
   * without it. Without one, a broker of a cluster keeps the stream as
   * one found by its name alone, as streams were before incarnations.
   * @param {import('../index').StreamArg} stream
   * @param {number} shards at least 1
   * @param {import('../index').CreateStreamOptions} [options] retention absent = the broker's default (no limit)
   * @returns {Promise<import('../index').StreamInfo>}
   */
  async createStream(stream, shards, options = {}) {
    const ref = args.streamRef(stream);
    args.u32(shards, 'shards', 1);
    args.options(options, ['retentionBytes', 'retentionMs', 'incarnation'], 'createStream option');
    const retention = (v, what) => (v === undefined ? undefined : args.u64(v, what));
    const retentionBytes = retention(options.retentionBytes, 'retentionBytes');
    const retentionMs = retention(options.retentionMs, 'retentionMs');
    const incarnation = options.incarnation === undefined ? undefined : args.incarnation(options.incarnation);
    if (incarnation !== undefined) this.requireFeatures(FEATURES.STREAM_INCARNATION, 'a stream incarnation');
    const req = requests.createStream(ref, shards, retentionBytes, retentionMs, incarnation);
    this.placements.delete(pathOf(ref));
    const msg = await this.callAny(req);
    // A broker may answer `ok`: the stream's info is then asked for.
    if (msg.type === 'ok') return this.describeStream(ref);
    const info = expect(msg, 'stream', 'create_stream').info;
    this.cachePlacement(info);
    return info;
  }

  /**
   * A stream's shard count, retention and placement (also refreshes the cached placement).
   * @param {import('../index').StreamArg} stream
   * @returns {Promise<import('../index').StreamInfo>}
   */
  async describeStream(stream) {
    const info = await this.describeRef(args.streamRef(stream));
    this.cachePlacement(info);
    return info;
  }

  async describeRef(ref) {
    try {
      return expect(await this.callAny(requests.streamOnly('describe_stream', OP.DESCRIBE_STREAM, ref)), 'stream', 'describe_stream').info;
    } catch (err) {
      if (err instanceof NotFoundError) this.placements.delete(pathOf(ref));
      throw err;
    }
  }

  /**
   * Every stream, or those of one tenant.
   * @param {string} [tenant]
   * @returns {Promise<import('../index').StreamInfo[]>}
   */
  async listStreams(tenant) {
    if (tenant !== undefined) args.name(tenant, 'tenant');
    const infos = expect(await this.callAny(requests.listStreams(tenant)), 'streams', 'list_streams').infos;
    for (const info of infos) this.cachePlacement(info);
    return infos;
  }

  /**
   * Delete a stream and everything in it.
   * @param {import('../index').StreamArg} stream
   * @returns {Promise<void>}
   */
  async deleteStream(stream) {
    const ref = args.streamRef(stream);
    try {
      expect(await this.callAny(requests.streamOnly('delete_stream', OP.DELETE_STREAM, ref)), 'ok', 'delete_stream');
    } finally {
      this.placements.delete(pathOf(ref));
    }
  }

  /**
   * One shard's offsets, size and owning core.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @returns {Promise<import('../index').ShardInfo>}
   */
  async describeShard(stream, shard) {
    const ref = args.streamRef(stream);
    args.u32(shard, 'shard');
    const msg = await this.callShard(ref, shard, requests.shardOnly('describe_shard', OP.DESCRIBE_SHARD, ref, shard));
    return expect(msg, 'shard', 'describe_shard').info;
  }

  /**
   * This broker's replica of one shard, as it sees it: role, term, the
   * leader it knows (with its client address) and replication indices; on
   * the leader, every other broker's progress. Only a broker in a cluster
   * answers (`FEATURES.REPLICA_INFO`); any of them does, leader or not.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @returns {Promise<import('../index').ReplicaInfo>}
   */
  async describeReplica(stream, shard) {
    this.requireFeatures(FEATURES.REPLICA_INFO, 'describeReplica');
    const ref = args.streamRef(stream);
    args.u32(shard, 'shard');
    const req = requests.shardOnly('describe_replica', OP.DESCRIBE_REPLICA, ref, shard, FEATURES.REPLICA_INFO);
    return expect(await this.callShard(ref, shard, req), 'replica', 'describe_replica').info;
  }

  /**
   * Every broker of the cluster this broker belongs to, with the address
   * clients reach it at (its `server.listen`), in node order, and this
   * broker's own node id. Needs `FEATURES.CLUSTER_INFO`, which only a
   * broker in a cluster advertises (refused locally with
   * `UnsupportedError` elsewhere): from one broker's address a client
   * learns the others (`ClusterClient.connect` does).
   * @returns {Promise<import('../index').ClusterInfo>}
   */
  async describeCluster() {
    this.requireFeatures(FEATURES.CLUSTER_INFO, 'describeCluster');
    return expect(await this.callAny(requests.describeCluster()), 'cluster', 'describe_cluster').info;
  }

  /**
   * Round trip to the home connection.
   * @returns {Promise<number>} milliseconds
   */
  async ping() {
    const start = performance.now();
    expect(await this.callAny({ name: 'ping', opcode: OP.PING, body: () => {} }), 'pong', 'ping');
    return performance.now() - start;
  }

  // ----- publishing --------------------------------------------------------

  ackMode() {
    if (!this.options.ackOnCommit) return wire.ACK.DEFAULT;
    this.requireFeatures(FEATURES.PUBLISH_ACK_MODE, 'ackOnCommit');
    return wire.ACK.DURABLE;
  }

  /** Refuse a batch that cannot fit the broker's frame before encoding it. */
  checkBatch(records) {
    if (records.length > wire.MAX_ITEMS_PER_VEC) {
      throw new InvalidArgumentError(`publish of ${records.length} records: a request carries at most ${wire.MAX_ITEMS_PER_VEC}; split it`);
    }
    const total = records.reduce((n, r) => n + recordBytes(r), 0);
    if (total > this.hello.maxFrameBytes) {
      throw new InvalidArgumentError(
        `publish of ${records.length} records holds ${total} bytes, over the broker's frame limit of ${this.hello.maxFrameBytes} bytes; split it`,
      );
    }
  }

  /**
   * Publish one record to `shard`.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {import('../index').RecordArg} record a payload, or `{payload, key?, headers?, timestampMs?}`
   * @returns {Promise<bigint>} its offset
   */
  async publish(stream, shard, record) {
    return (await this.publishBatch(stream, shard, [record])).baseOffset;
  }

  /**
   * Publish records to `shard` in one request; they get consecutive offsets.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {import('../index').RecordArg[]} records
   * @returns {Promise<import('../index').Published>}
   */
  async publishBatch(stream, shard, records) {
    const ref = args.streamRef(stream);
    args.u32(shard, 'shard');
    const recs = args.records(records);
    this.checkBatch(recs);
    const req = requests.publish(ref, { shard }, this.ackMode(), recs);
    return published(await this.callShard(ref, shard, req));
  }

  /**
   * Publish one record with a routing key: it goes to shard
   * `crc32c(key) % shards` (as the broker routes it), so records with one
   * key keep their order. The key is stored with the record.
   * @param {import('../index').StreamArg} stream
   * @param {Buffer|Uint8Array|string} key
   * @param {import('../index').RecordArg} record
   * @returns {Promise<import('../index').Published>}
   */
  async publishKeyed(stream, key, record) {
    return this.publishKeyedBatch(stream, key, [record]);
  }

  /**
   * Publish records under one routing key in one request (see
   * `publishKeyed`). Each record is stored with that key; a record naming
   * a different key is refused.
   * @param {import('../index').StreamArg} stream
   * @param {Buffer|Uint8Array|string} key
   * @param {import('../index').RecordArg[]} records
   * @returns {Promise<import('../index').Published>}
   */
  async publishKeyedBatch(stream, key, records) {
    const ref = args.streamRef(stream);
    const k = args.bytes(key, 'key');
    const recs = args.records(records).map((r, i) => {
      if (r.key !== undefined && !r.key.equals(k)) {
        throw new InvalidArgumentError(`record ${i} has a key other than the routing key`);
      }
      return { ...r, key: k };
    });
    this.checkBatch(recs);
    const ack = this.ackMode();
    let shards;
    try {
      ({ shards } = await this.placement(ref, false));
    } catch (e) {
      // Not sent (as in `coreFor`).
      if (e instanceof FelixError) e.notApplied = true;
      throw e;
    }
    const req = requests.publish(ref, { key: k }, ack, recs);
    return published(await this.callShard(ref, shardForKey(k, shards), req));
  }

  // ----- reading -----------------------------------------------------------

  /** Largest batch of payload a read asks for: half the frame limit, at least 64 KiB. */
  readMaxBytes() {
    return Math.max(Math.floor(this.options.maxFrameBytes / 2), 64 * 1024);
  }

  /**
   * Read up to `maxRecords` records of `shard` from `from`. With `waitMs`,
   * the broker holds the read up to that long for records to arrive when
   * there are none; an empty batch is not an error. An offset past the
   * tail is refused (`InvalidRequestError`).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {import('../index').StartPosition} from
   * @param {{maxRecords?: number, waitMs?: number}} [options] defaults: 100 records, no wait
   * @returns {Promise<import('../index').ReadBatch>}
   */
  async read(stream, shard, from, options = {}) {
    const ref = args.streamRef(stream);
    args.u32(shard, 'shard');
    const start = args.startPosition(from, 'from');
    args.options(options, ['maxRecords', 'waitMs'], 'read option');
    const maxRecords = args.u32(options.maxRecords ?? 100, 'maxRecords', 1);
    const waitMs = args.millisU32(options.waitMs ?? 0, 'waitMs');
    const req = requests.read(ref, shard, start, maxRecords, this.readMaxBytes(), waitMs);
    const msg = expect(await this.callShard(ref, shard, req, waitMs), 'records', 'read');
    return { records: msg.records, nextOffset: msg.nextOffset, startOffset: msg.startOffset, endOffset: msg.endOffset };
  }

  /**
   * Follow `shard` from `from`, long-polling at the tail: an async iterable
   * of records in offset order.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {import('../index').StartPosition} from
   * @param {{maxRecords?: number, waitMs?: number}} [options] defaults: 500 records a read, 10 s wait
   * @returns {Subscription}
   */
  subscribe(stream, shard, from, options = {}) {
    return Subscription.follow(this, stream, shard, from, options);
  }

  // ----- consumer groups: consuming ------------------------------------------

  /** A GroupKey from checked arguments. */
  groupKey(stream, shard, group) {
    return { stream: args.streamRef(stream), shard: args.u32(shard, 'shard'), group: args.name(group, 'group') };
  }

  async groupCall(key, req, waitMs = 0) {
    return this.callShard(key.stream, key.shard, req, waitMs);
  }

  async groupOk(key, req) {
    expect(await this.groupCall(key, req), 'ok', req.name);
  }

  /**
   * Claim up to `maxRecords` records for the group (owed ones first). An
   * empty array means nothing was available.
   *
   * `consumer` polls as a named member; with `reclaim`, the first such poll
   * on a new connection takes back what that name held before. A
   * `visibilityMs` (how long these claims stand) needs
   * `FEATURES.GROUP_CLAIM_CONTROL` and is refused locally without it.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').GroupPollOptions} [options] defaults: 16 records, no wait
   * @returns {Promise<import('../index').GroupRecord[]>}
   */
  async groupPoll(stream, shard, group, options = {}) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS, 'a group poll');
    args.options(options, ['maxRecords', 'waitMs', 'consumer', 'reclaim', 'visibilityMs'], 'groupPoll option');
    const maxRecords = args.u32(options.maxRecords ?? 16, 'maxRecords', 1);
    const waitMs = args.millisU32(options.waitMs ?? 0, 'waitMs');
    const member = this.member(options);
    let visibilityMs;
    let features = 0;
    if (options.visibilityMs !== undefined) {
      this.requireFeatures(FEATURES.GROUP_CLAIM_CONTROL, 'a poll visibility');
      visibilityMs = args.positiveMillisU64(options.visibilityMs, 'visibilityMs');
      features = FEATURES.GROUP_CLAIM_CONTROL;
    }
    const req = requests.group('group_poll', OP.GROUP_POLL, features, key, (w) => {
      w.u32(maxRecords);
      w.u32(waitMs);
      w.opt(member, (m) => {
        w.str(m.name);
        w.bool(m.reclaim);
      });
      w.opt(visibilityMs, w.u64);
    });
    const { records } = expect(await this.groupCall(key, req, waitMs), 'group_records', 'group_poll');
    if (!this.hasFeature(FEATURES.GROUP_SKIPPED)) for (const r of records) r.skippedBefore = undefined;
    return records;
  }

  /** The poll's member, from `consumer` and `reclaim`. */
  member(options) {
    if (options.consumer === undefined) {
      if (options.reclaim) throw new InvalidArgumentError('reclaim needs a consumer name');
      return undefined;
    }
    return { name: args.memberName(options.consumer), reclaim: options.reclaim === true };
  }

  /**
   * Finish records: the group will not hand them out again. An empty
   * array sends nothing.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').OffsetArg|import('../index').OffsetArg[]} offsets one offset or several
   * @returns {Promise<void>}
   */
  async groupAck(stream, shard, group, offsets) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS, 'groupAck');
    // Offsets, or the records a poll handed out.
    const list = (Array.isArray(offsets) ? offsets : [offsets]).map((o, i) =>
      o !== null && typeof o === 'object' ? args.offset(o.offset, `offsets[${i}].offset`) : args.offset(o, `offsets[${i}]`),
    );
    if (list.length === 0) return;
    if (list.length > wire.MAX_ITEMS_PER_VEC) {
      throw new InvalidArgumentError(`an ack carries at most ${wire.MAX_ITEMS_PER_VEC} offsets; split it`);
    }
    await this.groupOk(key, requests.group('group_ack', OP.GROUP_ACK, 0, key, (w) => {
      w.u32(list.length);
      for (const o of list) w.u64(o);
    }));
  }

  /**
   * Hand a claimed record back, to be owed to the group again: now, or
   * once `delayMs` has passed (a delay needs `FEATURES.GROUP_CLAIM_CONTROL`).
   * A `reason` is listed if this uses up the record's last attempt.
   * Refused with `StaleClaimError` once the record went out again.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').Claim} record the delivered record (offset and attempts)
   * @param {{delayMs?: number, reason?: string}} [options]
   * @returns {Promise<void>}
   */
  async groupNack(stream, shard, group, record, options = {}) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS, 'groupNack');
    const c = args.claim(record);
    args.options(options, ['delayMs', 'reason'], 'groupNack option');
    const reason = args.reason(options.reason);
    const delay = args.millis(options.delayMs ?? 0, 'delayMs');
    let delayMs;
    if (delay > 0) {
      this.requireFeatures(FEATURES.GROUP_CLAIM_CONTROL, 'a nack delay');
      delayMs = args.positiveMillisU64(delay, 'delayMs');
    }
    const features = delayMs === undefined ? 0 : FEATURES.GROUP_CLAIM_CONTROL;
    await this.groupOk(key, requests.group('group_nack', OP.GROUP_NACK, features, key, (w) => {
      w.u64(c.offset);
      w.u32(c.attempts);
      w.opt(delayMs, w.u64);
      w.opt(reason, w.str);
    }));
  }

  /**
   * Hand a claimed record back to be owed again only once `delayMs` has
   * passed (`groupNack` with a delay).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').Claim} record
   * @param {number} delayMs
   * @param {{reason?: string}} [options]
   * @returns {Promise<void>}
   */
  async groupNackAfter(stream, shard, group, record, delayMs, options = {}) {
    args.millis(delayMs, 'delayMs');
    args.options(options, ['reason'], 'groupNackAfter option');
    return this.groupNack(stream, shard, group, record, { ...options, delayMs });
  }

  /**
   * Let the claim on a record this consumer holds stand for `byMs` from now
   * (a `byMs` shorter than what is left shortens it). Needs
   * `FEATURES.GROUP_CLAIM_CONTROL`. Refused with `StaleClaimError` once the
   * claim lapsed and the record went out again.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').Claim} record
   * @param {number} byMs more than zero
   * @returns {Promise<number>} how long the claim now stands, in ms from the answer
   */
  async groupExtend(stream, shard, group, record, byMs) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS | FEATURES.GROUP_CLAIM_CONTROL, 'groupExtend');
    const c = args.claim(record);
    const extendMs = args.positiveMillisU64(byMs, 'byMs');
    const req = requests.group('group_extend', OP.GROUP_EXTEND, FEATURES.GROUP_CLAIM_CONTROL, key, (w) => {
      w.u64(c.offset);
      w.u32(c.attempts);
      w.u64(extendMs);
    });
    return expect(await this.groupCall(key, req), 'extended', 'group_extend').standsMs;
  }

  /**
   * Give up on a claimed record: list it as a dead letter of the group
   * (with an optional reason) and finish it. Needs `FEATURES.GROUP_CLAIM_CONTROL`.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').Claim} record
   * @param {string} [reason] kept by the list (the broker keeps up to 1 KiB)
   * @returns {Promise<void>}
   */
  async groupDeadLetter(stream, shard, group, record, reason) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS | FEATURES.GROUP_CLAIM_CONTROL, 'groupDeadLetter');
    const c = args.claim(record);
    const why = args.reason(reason);
    await this.groupOk(key, requests.group('group_dead_letter', OP.GROUP_DEAD_LETTER, FEATURES.GROUP_CLAIM_CONTROL, key, (w) => {
      w.u64(c.offset);
      w.u32(c.attempts);
      w.opt(why, w.str);
    }));
  }

  /**
   * Offsets of the group's dead letters, in order (see `groupDeadLettersDetailed`).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @returns {Promise<bigint[]>}
   */
  async groupDeadLetters(stream, shard, group) {
    return (await this.groupDeadLettersDetailed(stream, shard, group)).map((d) => d.offset);
  }

  /**
   * The group's dead letters with attempts, time, reason and who gave up,
   * in offset order: the whole list, fetched a page at a time from a
   * broker with `FEATURES.GROUP_DEAD_LETTER_PAGES`, in one answer otherwise.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @returns {Promise<import('../index').DeadLetterInfo[]>}
   */
  async groupDeadLettersDetailed(stream, shard, group) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS, 'groupDeadLetters');
    if (this.hasFeature(FEATURES.GROUP_DEAD_LETTER_PAGES)) {
      const all = [];
      let from = 0n;
      for (;;) {
        const page = await this.groupDeadLettersPage(stream, shard, group, from, 0xffffffff);
        all.push(...page.letters);
        if (page.next === undefined) return all;
        from = page.next;
      }
    }
    const msg = await this.groupCall(key, requests.group('group_dead_letters', OP.GROUP_DEAD_LETTERS, 0, key));
    return expect(msg, 'dead_letters', 'group_dead_letters').letters;
  }

  /**
   * One page of the group's dead letters: those at offset `from` and above,
   * in offset order, at most `max` (the broker caps it further). `next` is
   * the `from` of the following page, undefined at the end. Needs
   * `FEATURES.GROUP_DEAD_LETTER_PAGES`.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').OffsetArg} from
   * @param {number} max
   * @returns {Promise<import('../index').DeadLetterPage>}
   */
  async groupDeadLettersPage(stream, shard, group, from, max) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS | FEATURES.GROUP_DEAD_LETTER_PAGES, 'groupDeadLettersPage');
    const start = args.offset(from, 'from');
    args.u32(max, 'max');
    const req = requests.group('group_dead_letters_page', OP.GROUP_DEAD_LETTERS_PAGE, FEATURES.GROUP_DEAD_LETTER_PAGES, key, (w) => {
      w.u64(start);
      w.u32(max);
    });
    const msg = expect(await this.groupCall(key, req), 'dead_letter_page', 'group_dead_letters_page');
    return checkDeadLetterPage(start, { letters: msg.letters, next: msg.next });
  }

  /**
   * Put a dead letter back: its attempts reset and it is owed again.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').OffsetArg} offset
   * @returns {Promise<void>}
   */
  async groupRedrive(stream, shard, group, offset) {
    await this.deadLetterOp('group_redrive', OP.GROUP_REDRIVE, stream, shard, group, offset);
  }

  /**
   * Stop tracking a dead letter. The record stays in the log.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').OffsetArg} offset
   * @returns {Promise<void>}
   */
  async groupDiscard(stream, shard, group, offset) {
    await this.deadLetterOp('group_discard', OP.GROUP_DISCARD, stream, shard, group, offset);
  }

  async deadLetterOp(name, opcode, stream, shard, group, offset) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS, name);
    const o = args.offset(offset);
    await this.groupOk(key, requests.group(name, opcode, 0, key, (w) => w.u64(o)));
  }

  // ----- consumer groups: administration --------------------------------------

  /**
   * Create the group at `start`. A group that already exists is left alone
   * and this succeeds, so it is safe on every start of a consumer. Needs
   * `FEATURES.GROUP_ADMIN`.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').StartPosition} start
   * @returns {Promise<void>}
   */
  async groupCreate(stream, shard, group, start = 'earliest') {
    try {
      await this.groupPosition('group_create', OP.GROUP_CREATE, stream, shard, group, start);
    } catch (err) {
      if (!(err instanceof AlreadyExistsError)) throw err;
    }
  }

  /**
   * Move an existing group to `start`, backwards to replay or forwards to
   * skip. Voids every standing claim. Needs `FEATURES.GROUP_ADMIN`.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').StartPosition} start
   * @returns {Promise<void>}
   */
  async groupSeek(stream, shard, group, start) {
    await this.groupPosition('group_seek', OP.GROUP_SEEK, stream, shard, group, start);
  }

  async groupPosition(name, opcode, stream, shard, group, start) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS | FEATURES.GROUP_ADMIN, name);
    const at = args.startPosition(start);
    const msg = await this.groupCall(key, requests.group(name, opcode, FEATURES.GROUP_ADMIN, key, (w) => wire.putStartPosition(w, at)));
    // `ok`, or the group as it now stands (as the Rust client accepts).
    if (msg.type !== 'group') expect(msg, 'ok', name);
  }

  /**
   * Where the group stands: position, lag, in flight, owed, delayed and
   * dead-letter counts. Needs `FEATURES.GROUP_ADMIN`.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @returns {Promise<import('../index').GroupInfo>}
   */
  async groupDescribe(stream, shard, group) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS | FEATURES.GROUP_ADMIN, 'groupDescribe');
    const msg = await this.groupCall(key, requests.group('group_describe', OP.GROUP_DESCRIBE, FEATURES.GROUP_ADMIN, key));
    return expect(msg, 'group', 'group_describe').info;
  }

  /**
   * Remove the group's position and dead letters. Needs `FEATURES.GROUP_ADMIN`.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @returns {Promise<void>}
   */
  async groupDelete(stream, shard, group) {
    const key = this.groupKey(stream, shard, group);
    this.requireFeatures(FEATURES.GROUPS | FEATURES.GROUP_ADMIN, 'groupDelete');
    await this.groupOk(key, requests.group('group_delete', OP.GROUP_DELETE, FEATURES.GROUP_ADMIN, key));
  }

  /**
   * Names of the groups on one shard.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @returns {Promise<string[]>}
   */
  async listGroups(stream, shard) {
    const ref = args.streamRef(stream);
    args.u32(shard, 'shard');
    this.requireFeatures(FEATURES.GROUPS, 'listGroups');
    const req = requests.shardOnly('list_groups', OP.LIST_GROUPS, ref, shard, FEATURES.GROUPS);
    return expect(await this.callShard(ref, shard, req), 'groups', 'list_groups').names;
  }

  // ----- consumer groups: a whole stream ----------------------------------------

  /**
   * One consumer of `group` on every shard of the stream, polling them as
   * one queue (asks the broker how many shards the stream has). See
   * `ShardedGroup`.
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @param {import('../index').ShardedGroupOptions} [options]
   * @returns {Promise<ShardedGroup>}
   */
  async shardedGroup(stream, group, options = {}) {
    return ShardedGroup.open(this, stream, group, options);
  }

  /**
   * `groupCreate` on every shard of the stream, one call per shard
   * (`'latest'` is each shard's own tail when its call lands).
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @param {import('../index').StartPosition} start
   * @returns {Promise<void>}
   */
  async groupCreateStream(stream, group, start = 'earliest') {
    return streamGroups.groupCreateStream(this, stream, group, start);
  }

  /**
   * `groupSeek` on every shard of the stream.
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @param {import('../index').StartPosition} start
   * @returns {Promise<void>}
   */
  async groupSeekStream(stream, group, start) {
    return streamGroups.groupSeekStream(this, stream, group, start);
  }

  /**
   * `groupDescribe` of every shard, in shard order.
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @returns {Promise<import('../index').GroupInfo[]>}
   */
  async groupDescribeStream(stream, group) {
    return streamGroups.groupDescribeStream(this, stream, group);
  }

  /**
   * `groupDelete` on every shard of the stream.
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @returns {Promise<void>}
   */
  async groupDeleteStream(stream, group) {
    return streamGroups.groupDeleteStream(this, stream, group);
  }
}

/**
 * `Client.connect` with options already checked; aborting `signal` ends
 * the attempt (`DisconnectedError`).
 * @param {string} addr
 * @param {object} options from `clientOptions`
 * @param {AbortSignal} [signal]
 * @returns {Promise<Client>}
 */
async function connectClient(addr, options, signal) {
  const where = parseAddr(addr);
  const first = await Connection.open({ ...where, ...connectOptions(options), wantCore: undefined, signal });
  return new Client(where, options, first);
}

/** What `Connection.open` needs from the client options. */
function connectOptions(o) {
  return {
    token: o.token,
    clientName: o.clientName,
    connectTimeoutMs: o.connectTimeoutMs,
    maxFrameBytes: o.maxFrameBytes,
  };
}

module.exports = { Client, parseAddr, clientOptions, connectClient, pathOf };
