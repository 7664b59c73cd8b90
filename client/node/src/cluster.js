'use strict';

/**
 * `ClusterClient`: one client for a cluster of brokers, sending each
 * shard's calls to the broker that leads it, as the Rust client's
 * `ClusterClient` (`client/src/cluster.rs`).
 * @module felix-client/cluster
 */

const crypto = require('node:crypto');
const args = require('./args');
const { clientOptions, connectClient, parseAddr, pathOf } = require('./client');
const { timerDelay } = require('./connection');
const { shardForKey } = require('./crc32c');
const { ShardedGroup } = require('./sharded');
const streamGroups = require('./stream_groups');
const { Subscription } = require('./subscription');
const { FEATURES, MAX_INCARNATION } = require('./wire');
const {
  AlreadyExistsError,
  ConnectionError,
  DisconnectedError,
  InvalidArgumentError,
  NotFoundError,
  NotLeaderError,
  ProtocolError,
  TimeoutError,
  UnavailableError,
  UnsupportedError,
} = require('./errors');

/** How many times a call tries before giving up (following a leader, or waiting out an election, takes a few). */
const ATTEMPTS = 40;
const BACKOFF_FIRST_MS = 25;
const BACKOFF_MAX_MS = 500;

/** How a call may be tried again. */
const Retry = Object.freeze({
  /**
   * Only where nothing was applied: `not_leader` (an election, a new
   * leader catching up), a broker that could not be reached, an
   * `unavailable` the broker marks as not applied (it was stopping).
   */
  REFUSED: 'refused',
  /**
   * Also after a lost answer (a timeout, a dropped connection) or an
   * `unavailable` (whose outcome may be unknown): for calls that may run
   * twice (publishes at least once, polls, acks, creates, describes).
   */
  LOST: 'lost',
  /** As `LOST`, for a read: any replica answers one, so the broker that did is not remembered as the leader. */
  READ: 'read',
});

/**
 * Worth trying another broker (or the same one again) for.
 * @param {unknown} err
 * @param {string} retry a `Retry`
 */
function retryable(err, retry) {
  if (err instanceof NotLeaderError || err instanceof ConnectionError) return true;
  // `unavailable` can mean the outcome is unknown (a commit that timed
  // out): tried again only where doing it twice is harmless, or where the
  // broker says it did nothing (it was stopping).
  if (err instanceof UnavailableError && err.notApplied) return true;
  if (err instanceof DisconnectedError || err instanceof TimeoutError || err instanceof UnavailableError) {
    return retry !== Retry.REFUSED;
  }
  return false;
}

/** The connection a call went over failed: its client is not kept. */
function lostConnection(err) {
  return err instanceof ConnectionError || err instanceof DisconnectedError || err instanceof TimeoutError;
}

const closedError = () => new DisconnectedError('the cluster client is closed');

/**
 * A failed connection to the broker at `addr`, naming it, since a cluster
 * call may try several (a refused or unreachable address is named already).
 */
function connectError(addr, err) {
  if (!(err instanceof ConnectionError) || err.message.startsWith('cannot connect to ')) return err;
  return new ConnectionError(`cannot connect to ${addr}: ${err.message}`, { cause: err });
}

/**
 * An incarnation as `felix stream describe` shows it: `0x` and 16 hex
 * digits, or `none`.
 * @param {bigint|undefined} incarnation
 * @returns {string}
 */
function showIncarnation(incarnation) {
  return incarnation === undefined ? 'none' : `0x${incarnation.toString(16).padStart(16, '0')}`;
}

/** A new stream incarnation: random, from 1 to 2^63-1 (what a broker stores). */
function newIncarnation() {
  const i = crypto.randomBytes(8).readBigUInt64LE() & MAX_INCARNATION;
  return i === 0n ? 1n : i;
}

/**
 * The incarnation a stream `name` of `shards` shards is created with on
 * the brokers that lack it, given `held`: those of the `brokers` brokers
 * asked (reachable or not) that hold it, and their description of it.
 * Theirs, when more than half of the brokers hold it and they agree
 * (undefined for a stream created without one); a new one when no broker
 * holds it.
 *
 * Every broker must hold the same incarnation: a shard's replicas are
 * found by it, and a broker holding an older stream of the same name (down
 * while it was deleted and created again) must not vote in the new one's
 * elections. Nor may a copy that only a minority holds be spread to the
 * others: it may be a stream the others deleted while those brokers were
 * down, whose log would win the elections. `AlreadyExistsError`, naming
 * the brokers, when one holds it with another shard count, the holders
 * disagree, or too few hold it: delete it on the brokers named, then
 * create it again.
 * @param {string} name the stream's path, for messages
 * @param {number} shards
 * @param {number} brokers how many brokers were asked
 * @param {Array<{broker: string, info: import('../index').StreamInfo}>} held
 * @returns {bigint|undefined}
 * @throws {AlreadyExistsError}
 */
function incarnationToCreate(name, shards, brokers, held) {
  const otherCount = held.find((h) => h.info.shards !== shards);
  if (otherCount) {
    throw new AlreadyExistsError(`${name} exists on ${otherCount.broker} with ${otherCount.info.shards} shards, not ${shards}`);
  }
  if (held.length === 0) return newIncarnation();
  const [first] = held;
  const other = held.find((h) => h.info.incarnation !== first.info.incarnation);
  if (other) {
    throw new AlreadyExistsError(
      `${name} is not the same stream everywhere: ${first.broker} holds incarnation ${showIncarnation(first.info.incarnation)} ` +
        `and ${other.broker} ${showIncarnation(other.info.incarnation)} (one was deleted and created again while a broker ` +
        'was down); delete it on the brokers whose copy should go, then create it again',
    );
  }
  if (held.length * 2 <= brokers) {
    throw new AlreadyExistsError(
      `${name} is held by only ${held.length} of the ${brokers} brokers (${held.map((h) => h.broker).join(', ')}): ` +
        'a create cut short, or a stream the others deleted while these were down; ' +
        `delete it on ${held.length === 1 ? 'that broker' : 'those brokers'}, then create it again`,
    );
  }
  return first.info.incarnation;
}

/**
 * Whether a create of `name` may go ahead with some of the cluster's
 * `total` brokers not reached (`unreached`, each named for the message):
 * only when more than half answered (`answered`, of which `held` hold the
 * stream already), and when whether the holders are a majority does not
 * turn on the brokers that did not answer. Throws `UnavailableError`
 * saying why, and that nothing was created, otherwise; returns when every
 * broker answered.
 * @param {string} name the stream's path, for messages
 * @param {number} total how many brokers the cluster has
 * @param {number} answered how many of them answered
 * @param {number} held how many of those hold the stream
 * @param {readonly string[]} unreached the brokers that did not answer
 * @throws {UnavailableError}
 */
function enoughAnswered(name, total, answered, held, unreached) {
  if (unreached.length === 0) return;
  // A stream on fewer than a majority could elect no leader.
  if (answered * 2 <= total) {
    throw new UnavailableError(
      `only ${answered} of the ${total} brokers answered (${unreached.join(', ')} did not): nothing created; ` +
        'run the same create again once more of them are back',
    );
  }
  // Whether the holders are a majority turns on brokers not asked.
  if (held * 2 <= total && held > 0) {
    throw new UnavailableError(
      `${name} is on ${held} of the ${total} brokers, and ${unreached.join(', ')} did not answer: nothing ` +
        'created; run the same create again once they are back',
    );
  }
}

/**
 * Refuse (`UnsupportedError`, local) unless the broker `client` can create
 * a stream as `incarnation`: a broker that does not keep incarnations (an
 * older build) would put its replicas in a group of their own.
 * @param {import('./client').Client} client
 * @param {string} broker its address, for the message
 * @param {bigint|undefined} incarnation
 */
function keepsIncarnations(client, broker, incarnation) {
  if (incarnation !== undefined && !client.hasFeature(FEATURES.STREAM_INCARNATION)) {
    throw new UnsupportedError(
      `${broker} does not keep stream incarnations (FEATURE_STREAM_INCARNATION): an older build? ` +
        'Upgrade every broker of the cluster first',
      { local: true },
    );
  }
}

/**
 * Create a stream on one broker of a cluster as `incarnation` (see
 * `incarnationToCreate`): `{created: true}` with the broker's answer, or
 * `{created: false}` with its description when it was there already as
 * the same stream (created meanwhile by another run). Refused
 * (`UnsupportedError`) when `incarnation` is set and the broker does not
 * keep incarnations, and `AlreadyExistsError` when what it holds is
 * another stream.
 * @param {import('./client').Client} client
 * @param {string} broker
 * @param {import('../index').StreamRef} ref
 * @param {number} shards
 * @param {{retentionBytes?: import('../index').OffsetArg, retentionMs?: import('../index').OffsetArg}} retention
 * @param {bigint|undefined} incarnation
 * @returns {Promise<{created: boolean, info: import('../index').StreamInfo}>}
 */
async function createOnBroker(client, broker, ref, shards, retention, incarnation) {
  keepsIncarnations(client, broker, incarnation);
  try {
    return { created: true, info: await client.createStream(ref, shards, { ...retention, incarnation }) };
  } catch (err) {
    if (!(err instanceof AlreadyExistsError)) throw err;
    const info = await client.describeStream(ref);
    if (info.shards === shards && info.incarnation === incarnation) return { created: false, info };
    throw new AlreadyExistsError(
      `${pathOf(ref)} was created on ${broker} meanwhile as another stream (${info.shards} shards, ` +
        `incarnation ${showIncarnation(info.incarnation)}); delete it there, then create it again`,
    );
  }
}

/**
 * The brokers of the cluster as the broker of `client` names them
 * (`Client.describeCluster`: their client addresses, in node order, each
 * once), or `given` when that broker cannot say (it does not advertise
 * `FEATURES.CLUSTER_INFO`: an older build, or a broker in no cluster).
 * An answer naming no broker, or an address that is not `host:port`, is a
 * `ProtocolError`.
 * @param {import('./client').Client} client
 * @param {readonly string[]} given
 * @returns {Promise<readonly string[]>}
 */
async function clusterMembers(client, given) {
  if (!client.hasFeature(FEATURES.CLUSTER_INFO)) return given;
  const info = await client.describeCluster();
  const members = [];
  for (const m of info.members) {
    try {
      parseAddr(m.addr);
    } catch {
      throw new ProtocolError(`the broker names node ${m.node} of its cluster at ${JSON.stringify(m.addr)}, not a "host:port" address`);
    }
    if (!members.includes(m.addr)) members.push(m.addr);
  }
  if (members.length === 0) throw new ProtocolError('the broker named no broker of its cluster');
  return members;
}

/**
 * A client of one broker as the cluster client holds it. `calls` counts
 * the calls running on it: a client that failed is retired (the next call
 * connects anew) and closed once the calls still on it are done.
 * @typedef {object} Held
 * @property {string} addr
 * @property {import('./client').Client|undefined} client undefined while connecting
 * @property {Promise<Held>} ready
 * @property {number} calls
 * @property {boolean} retired
 */

/**
 * A client for a cluster of brokers (run with `cluster.nodes`), where
 * every shard is replicated on every broker and served by its elected
 * leader. Connect with `ClusterClient.connect([addresses], options)`.
 *
 * It keeps a `Client` per broker it has talked to and, per shard, the
 * broker that last led it. A per-shard call goes there; a broker that does
 * not lead the shard answers `not_leader` naming the one that does, and
 * the call follows it. While no leader is known (an election after a
 * leader was lost), or a broker cannot be reached, the call tries the
 * others in turn, backing off from 25 ms to 500 ms, 40 attempts in all
 * (about 18 seconds).
 *
 * A publish, read, poll, ack, group create or describe that was sent and
 * whose answer was lost (the broker died, the connection dropped, the
 * request timed out), or that was answered `unavailable`, is sent again,
 * so a record can be written twice: at least once, as the guide says of
 * failovers. The other group calls (nack, extend, dead-letter, redrive,
 * discard, seek, delete) are tried again only where nothing was applied
 * (`not_leader`, a broker not reached); a lost answer is thrown as the
 * error it is, since a seek to `'latest'` or a redrive made twice is not
 * the same as once. Stream creation and deletion go to every broker of the
 * cluster (`members`): the first broker reached at connect names them
 * (`Client.describeCluster`), so one address is enough.
 *
 * The per-shard calls take the same arguments as `Client`'s of the same
 * name, so code can switch between the two; `shardedGroup` consumes a
 * group on every shard, each shard's calls on its leader.
 */
class ClusterClient {
  /**
   * The brokers given at connect, then those of the cluster not among
   * them: where a per-shard call looks for the shard's leader.
   * @type {readonly string[]}
   */
  #brokers;
  /**
   * The cluster's brokers as the first broker reached named them, or the
   * brokers given when it could not say: those a stream is created on,
   * deleted from and described by.
   * @type {readonly string[]}
   */
  #members;
  #options;
  /** @type {Map<string, Held>} The client of each broker, by address (a leader named by a broker included). */
  #clients = new Map();
  /** @type {Set<Held>} Every open client, retired ones with calls still out included: what `close()` closes. */
  #open = new Set();
  /** @type {Map<string, Map<number, string>>} The broker that last led each shard, by stream path. */
  #leaders = new Map();
  /** @type {Map<string, number>} Shard counts, by stream path, for routing by key. */
  #shardCounts = new Map();
  /** Backoff sleeps, cut short by `close()`. */
  #sleeps = new Set();
  /** Aborts connection attempts in progress when the client closes. */
  #abort = new AbortController();
  #closed = false;

  /**
   * Use `ClusterClient.connect`.
   * @param {string[]} brokers checked, each once
   * @param {object} options checked
   * @private
   */
  constructor(brokers, options) {
    this.#brokers = Object.freeze(brokers);
    this.#members = this.#brokers;
    this.#options = options;
  }

  /**
   * Take the cluster's brokers, `members`, as named at connect: the
   * brokers known become the ones given, then the members not among them.
   * @param {readonly string[]} members
   */
  #learn(members) {
    const given = this.#brokers;
    this.#members = Object.freeze([...members]);
    this.#brokers = Object.freeze([...given, ...members.filter((m) => !given.includes(m))]);
  }

  /**
   * Connect to a cluster given one or more of its brokers (their client
   * addresses, `host:port`; each counts once, trimmed). The first broker
   * that answers names every broker of its cluster
   * (`Client.describeCluster`, on a broker that advertises
   * `FEATURES.CLUSTER_INFO`), so one address is enough: the client finds
   * the others (`brokers`, `members`), and creates, deletes and describes
   * streams on every broker of the cluster however many were given. A
   * broker that cannot say (an older build) leaves the brokers given as
   * the cluster's: then give every broker, as `createStream` counts them.
   * A broker that answers HELLO but fails to name its cluster is passed
   * over like one that does not answer. The others are connected to when
   * needed. Rejects with the last broker's error when none answers.
   * @param {string[]} brokers
   * @param {import('../index').ClientOptions} [options] for every broker's `Client`
   * @returns {Promise<ClusterClient>}
   */
  static async connect(brokers, options) {
    // One broker's address is enough: it names the others.
    if (typeof brokers === 'string') brokers = [brokers];
    if (!Array.isArray(brokers)) {
      throw new InvalidArgumentError(`a cluster client takes an array of "host:port" addresses, not ${String(brokers)}`);
    }
    // Each once: a broker listed twice must not count twice (a create
    // counts the brokers holding a stream).
    const list = [];
    for (const b of brokers) {
      if (typeof b !== 'string') throw new InvalidArgumentError(`a broker address must be a "host:port" string, not ${String(b)}`);
      const addr = b.trim();
      parseAddr(addr);
      if (!list.includes(addr)) list.push(addr);
    }
    if (list.length === 0) throw new InvalidArgumentError('a cluster client needs at least one broker address');
    const cluster = new ClusterClient(list, clientOptions(options));
    let last;
    for (const addr of list) {
      let held;
      try {
        held = await cluster.#entry(addr);
      } catch (err) {
        last = err;
        continue;
      }
      try {
        cluster.#learn(await cluster.#use(held, (c) => clusterMembers(c, list)));
        return cluster;
      } catch (err) {
        // As a broker that did not answer: its client goes, the next is asked.
        cluster.#retire(held);
        last = err;
      }
    }
    cluster.close();
    throw last;
  }

  /**
   * The brokers given at connect (each once, in order), then those of the
   * cluster the client learned of and was not given: where a per-shard
   * call looks for the shard's leader. @returns {readonly string[]}
   */
  get brokers() {
    return this.#brokers;
  }

  /**
   * The cluster's brokers, as the first broker reached at connect named
   * them (their client addresses, in node order); the brokers given, on a
   * broker that cannot say (no `FEATURES.CLUSTER_INFO`). Streams are
   * created, deleted and described on these. @returns {readonly string[]}
   */
  get members() {
    return this.#members;
  }

  /** The options every broker's `Client` is made with, checked, defaults filled in. */
  get options() {
    return this.#options;
  }

  /**
   * The broker that last led `shard` of the stream (as answers and
   * `describeReplicas` showed), if one is known.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @returns {string|undefined}
   */
  leaderOf(stream, shard) {
    const ref = args.streamRef(stream);
    return this.#leaders.get(pathOf(ref))?.get(args.u32(shard, 'shard'));
  }

  /**
   * Close every broker's client: calls in flight reject with
   * `DisconnectedError`, and so do calls waiting out a backoff. Leaves no
   * timer or socket behind, so the process can exit. The cluster client
   * cannot be used afterwards.
   */
  close() {
    if (this.#closed) return;
    this.#closed = true;
    this.#abort.abort();
    for (const sleep of this.#sleeps) sleep.cancel();
    this.#sleeps.clear();
    for (const held of this.#open) held.client.close();
    this.#open.clear();
    this.#clients.clear();
  }

  // ----- clients of the brokers ----------------------------------------------

  /**
   * The broker's client, connecting if there is none; callers arriving
   * while it connects share the attempt (and its failure).
   * @param {string} addr
   * @returns {Promise<Held>}
   */
  #entry(addr) {
    if (this.#closed) return Promise.reject(closedError());
    const known = this.#clients.get(addr);
    if (known) return known.ready;
    /** @type {Held} */
    const held = { addr, client: undefined, ready: undefined, calls: 0, retired: false };
    held.ready = connectClient(addr, this.#options, this.#abort.signal).then(
      (client) => {
        if (this.#closed) {
          client.close();
          throw closedError();
        }
        held.client = client;
        this.#open.add(held);
        return held;
      },
      (err) => {
        if (this.#clients.get(addr) === held) this.#clients.delete(addr);
        throw connectError(addr, err);
      },
    );
    this.#clients.set(addr, held);
    return held.ready;
  }

  /**
   * Run `call` with a connected broker's client; a failed connection
   * retires the client.
   * @template T
   * @param {Held} held
   * @param {(client: import('./client').Client) => Promise<T>} call
   * @returns {Promise<T>}
   */
  async #use(held, call) {
    held.calls++;
    try {
      return await call(held.client);
    } catch (err) {
      if (lostConnection(err)) this.#retire(held);
      throw err;
    } finally {
      held.calls--;
      if (held.retired && held.calls === 0) this.#closeHeld(held);
    }
  }

  /** `#use` on the broker at `addr`, connecting first if needed. */
  async #with(addr, call) {
    return this.#use(await this.#entry(addr), call);
  }

  /** Forget a broker's client (it failed): the next call connects anew; calls still on it finish first. */
  #retire(held) {
    if (this.#clients.get(held.addr) === held) this.#clients.delete(held.addr);
    if (held.retired) return;
    held.retired = true;
    if (held.calls === 0) this.#closeHeld(held);
  }

  #closeHeld(held) {
    this.#open.delete(held);
    held.client.close();
  }

  /**
   * Wait `ms`; `close()` cuts it short with `DisconnectedError`, and once
   * closed it rejects at once (a call whose request was out when `close()`
   * ran fails with a retryable error after `close()` cancelled the sleeps:
   * a timer started then would hold the call, and the process, up to
   * 500 ms). Resolves to the next backoff.
   */
  #backOff(ms) {
    if (this.#closed) return Promise.reject(closedError());
    return new Promise((resolve, reject) => {
      const sleep = {
        timer: setTimeout(() => {
          this.#sleeps.delete(sleep);
          resolve(Math.min(ms * 2, BACKOFF_MAX_MS));
        }, timerDelay(ms)),
        cancel: () => {
          clearTimeout(sleep.timer);
          reject(closedError());
        },
      };
      this.#sleeps.add(sleep);
    });
  }

  // ----- leaders ---------------------------------------------------------------

  #setLeader(ref, shard, broker) {
    const path = pathOf(ref);
    let shards = this.#leaders.get(path);
    if (!shards) this.#leaders.set(path, (shards = new Map()));
    shards.set(shard, broker);
  }

  /** Forget what is known of a stream (deleted, or created anew). */
  #forget(ref) {
    this.#leaders.delete(pathOf(ref));
    this.#shardCounts.delete(pathOf(ref));
  }

  /**
   * Run `call` against the leader of `shard`, following `not_leader`
   * answers and trying the other brokers while none is known, as `retry`
   * allows.
   * @template T
   * @param {import('../index').StreamRef} ref checked
   * @param {number} shard checked
   * @param {string} retry a `Retry`
   * @param {(client: import('./client').Client) => Promise<T>} call
   * @returns {Promise<T>}
   */
  async #onLeader(ref, shard, retry, call) {
    let next = 0;
    let target = this.#leaders.get(pathOf(ref))?.get(shard) ?? this.#brokers[0];
    let backoff = BACKOFF_FIRST_MS;
    let last;
    let follows = 0;
    for (let attempt = 0; attempt < ATTEMPTS; attempt++) {
      if (this.#closed) throw closedError();
      let held;
      let failure;
      try {
        held = await this.#entry(target);
      } catch (err) {
        // Not connected: nothing was sent, so any call may try another
        // broker (a leader named by an address this client cannot use
        // included).
        const unreached = err instanceof TimeoutError || err instanceof InvalidArgumentError;
        failure = unreached ? new ConnectionError(`connecting to ${target}: ${err.message}`, { cause: err }) : err;
      }
      if (held) {
        try {
          const value = await this.#use(held, call);
          // Any replica answers a read: one that did is not known to lead.
          if (retry !== Retry.READ) this.#setLeader(ref, shard, target);
          return value;
        } catch (err) {
          // (A connection that failed has retired its client.)
          failure = err;
        }
      }
      // Closed meanwhile (its connection closed under it, most likely):
      // given up at once, not followed nor tried again.
      if (this.#closed) throw closedError();
      if (failure instanceof NotLeaderError && failure.leader !== undefined && failure.leader !== target) {
        // Follow the broker that leads it; brokers naming each other (an
        // election under way) are waited out.
        follows++;
        if (follows > 2) backoff = await this.#backOff(backoff);
        target = failure.leader;
        continue;
      }
      if (retryable(failure, retry)) {
        last = failure;
        // No leader known here: try the next broker after a pause (an
        // election takes a few hundred ms).
        next = (next + 1) % this.#brokers.length;
        target = this.#brokers[next];
        backoff = await this.#backOff(backoff);
        continue;
      }
      if (held && (failure instanceof DisconnectedError || failure instanceof TimeoutError)) {
        // Not tried again (it may have been applied); the next call
        // connects anew and finds the leader.
        this.#leaders.get(pathOf(ref))?.delete(shard);
      }
      throw failure;
    }
    throw last ?? new TimeoutError(`no broker settled as the leader of ${pathOf(ref)} shard ${shard} within ${ATTEMPTS} attempts`);
  }

  /** `#onLeader` with the stream and shard checked. */
  async #shardCall(stream, shard, retry, call) {
    const ref = args.streamRef(stream);
    args.u32(shard, 'shard');
    return this.#onLeader(ref, shard, retry, (client) => call(client, ref));
  }

  /**
   * Run `call` with the `Client` of the broker that leads `shard` of the
   * stream: for any per-shard call of `Client` not wrapped here. A
   * `not_leader` answer is followed, and while no leader is known the
   * other brokers are tried, backing off; a call whose answer was lost,
   * or that was answered `unavailable` (its outcome may be unknown), is not
   * made again but thrown.
   * @template T
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {(client: import('./client').Client) => Promise<T>} call
   * @returns {Promise<T>}
   */
  async withLeader(stream, shard, call) {
    if (typeof call !== 'function') throw new InvalidArgumentError('withLeader needs a function of the leader\'s Client');
    return this.#shardCall(stream, shard, Retry.REFUSED, (client) => call(client));
  }

  // ----- streams -----------------------------------------------------------------

  /**
   * Create a stream on every broker of the cluster (`members`), as one
   * incarnation: first asks every broker whether it holds the stream, then
   * creates it on the others. Where more than half of them hold the
   * stream already (a create interrupted part way, or a broker that was
   * down for it), the others get its incarnation, and those that hold it
   * are left as they are, so running it again is fine.
   * Refused (`AlreadyExistsError`, naming the brokers) where a broker holds
   * it with another shard count, brokers hold different incarnations of
   * it, or half of them or fewer hold it; `UnsupportedError` where a
   * broker does not keep incarnations.
   *
   * A broker that cannot be reached (not connected to, or its answer lost:
   * `ConnectionError`, `TimeoutError`, `DisconnectedError`) is passed
   * over: the stream is made on the others, and the call then throws
   * `UnavailableError` naming it, to be run again once it is back (until
   * then that broker takes no part in the stream). Nothing is made
   * (`enoughAnswered`) when half of the brokers or fewer answer, or when
   * whether the brokers holding the stream are a majority turns on those
   * that did not. A create that fails part way can be run again.
   * @param {import('../index').StreamArg} stream
   * @param {number} shards at least 1
   * @param {{retentionBytes?: import('../index').OffsetArg, retentionMs?: import('../index').OffsetArg}} [options]
   *   absent = the brokers' default (no limit); no `incarnation`: the cluster client chooses it
   * @returns {Promise<import('../index').StreamInfo>} the stream as the first broker holds it
   */
  async createStream(stream, shards, options = {}) {
    const ref = args.streamRef(stream);
    args.u32(shards, 'shards', 1);
    args.options(options, ['retentionBytes', 'retentionMs', 'incarnation'], 'createStream option');
    if (options.incarnation !== undefined) {
      throw new InvalidArgumentError(
        'a cluster client chooses the stream incarnation itself; Client.createStream takes one, for a single broker',
      );
    }
    const retention = { retentionBytes: options.retentionBytes, retentionMs: options.retentionMs };
    for (const [what, v] of Object.entries(retention)) if (v !== undefined) args.u64(v, what);
    const held = [];
    const lacking = [];
    const unreached = [];
    for (const broker of this.#members) {
      try {
        held.push({ broker, info: await this.#with(broker, (c) => c.describeStream(ref)) });
      } catch (err) {
        if (err instanceof NotFoundError) {
          lacking.push(broker);
        } else if (lostConnection(err) && !this.#closed) {
          // Not connected to, or its answer lost: passed over.
          // (Its client, if any, has been retired: the next call connects anew.)
          unreached.push(`${broker} (${err.message})`);
        } else {
          throw err;
        }
      }
    }
    const name = pathOf(ref);
    const total = this.#members.length;
    enoughAnswered(name, total, held.length + lacking.length, held.length, unreached);
    const incarnation = incarnationToCreate(name, shards, total, held);
    for (const broker of lacking) {
      await this.#with(broker, async (c) => keepsIncarnations(c, broker, incarnation));
    }
    const infos = new Map(held.map((h) => [h.broker, h.info]));
    this.#forget(ref);
    for (const broker of lacking) {
      const { info } = await this.#with(broker, (c) => createOnBroker(c, broker, ref, shards, retention, incarnation));
      infos.set(broker, info);
    }
    this.#shardCounts.set(name, shards);
    if (unreached.length > 0) {
      throw new UnavailableError(
        `${name} was created on the other brokers, not on ${unreached.join(', ')}: ` +
          `run the same create again once ${unreached.length === 1 ? 'it is' : 'they are'} back`,
      );
    }
    return infos.get(this.#members[0]);
  }

  /**
   * Delete a stream on every broker of the cluster (`members`; one already
   * gone is fine). Every broker is tried, one that cannot be reached or
   * refuses included; the first such error is thrown after the others
   * were done, naming its broker and the brokers the stream was deleted
   * on, so the call can be run again once that broker is back. Its
   * `notApplied` is true only when no broker deleted anything.
   * @param {import('../index').StreamArg} stream
   * @returns {Promise<void>}
   */
  async deleteStream(stream) {
    const ref = args.streamRef(stream);
    let first;
    let failed;
    const deleted = [];
    for (const broker of this.#members) {
      try {
        await this.#with(broker, (c) => c.deleteStream(ref));
        deleted.push(broker);
      } catch (err) {
        if (!(err instanceof NotFoundError) && first === undefined) {
          first = err;
          failed = broker;
        }
      }
    }
    this.#forget(ref);
    if (first === undefined) return;
    const where = deleted.length === 0 ? 'deleted on no broker' : `deleted on ${deleted.join(', ')}`;
    first.message = `${first.message} (broker ${failed}; ${where})`;
    // The call as a whole did something, whatever this part says.
    if (deleted.length > 0) first.notApplied = false;
    throw first;
  }

  /**
   * Ask each broker of the cluster (`members`) in turn, until one answers
   * `call`; a broker that cannot be reached, or whose answer is worth
   * asking another for (as a read's), passes the question on. Throws the
   * last such error when none answers, and any other error at once.
   */
  async #firstAnswer(call) {
    let last;
    for (const broker of this.#members) {
      let held;
      try {
        held = await this.#entry(broker);
      } catch (err) {
        last = err;
        continue;
      }
      try {
        return await this.#use(held, call);
      } catch (err) {
        if (!retryable(err, Retry.READ)) throw err;
        last = err;
      }
    }
    throw last;
  }

  /**
   * Describe a stream, as the first broker that answers has it (its
   * `placement` is that broker's; `incarnation` is the same on every
   * broker of the cluster).
   * @param {import('../index').StreamArg} stream
   * @returns {Promise<import('../index').StreamInfo>}
   */
  async describeStream(stream) {
    const ref = args.streamRef(stream);
    try {
      const info = await this.#firstAnswer((c) => c.describeStream(ref));
      this.#shardCounts.set(pathOf(ref), info.shards);
      return info;
    } catch (err) {
      if (err instanceof NotFoundError) this.#shardCounts.delete(pathOf(ref));
      throw err;
    }
  }

  /**
   * Every stream, or those of one tenant, as the first broker that answers
   * has them.
   * @param {string} [tenant]
   * @returns {Promise<import('../index').StreamInfo[]>}
   */
  async listStreams(tenant) {
    if (tenant !== undefined) args.name(tenant, 'tenant');
    return this.#firstAnswer((c) => c.listStreams(tenant));
  }

  /**
   * Every broker's replica of `shard`, as each sees it, in the order of
   * `members`: `{broker, replica}`, or `{broker, error}` for a broker that
   * could not be reached or refused. The brokers are asked all at once,
   * so one that does not answer holds up only its own place. The broker
   * that says it leads, in the newest term, is remembered as the shard's
   * leader, so the next call goes there first. See
   * `Client.describeReplica`.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @returns {Promise<import('../index').ReplicaAnswer[]>}
   */
  async describeReplicas(stream, shard) {
    const ref = args.streamRef(stream);
    args.u32(shard, 'shard');
    const answers = await Promise.all(this.#members.map(async (broker) => {
      try {
        return { broker, replica: await this.#with(broker, (c) => c.describeReplica(ref, shard)) };
      } catch (error) {
        return { broker, error };
      }
    }));
    // The newest term's leader, as its own broker reports it.
    let leader;
    for (const a of answers) {
      if (a.replica?.role === 'leader' && (leader === undefined || a.replica.term > leader.replica.term)) leader = a;
    }
    if (leader) this.#setLeader(ref, shard, leader.broker);
    return answers;
  }

  /**
   * One shard's offsets, size and owning core, as the broker that last led
   * it has them (any replica answers; a follower's can be a moment behind).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @returns {Promise<import('../index').ShardInfo>}
   */
  async describeShard(stream, shard) {
    return this.#shardCall(stream, shard, Retry.READ, (c, ref) => c.describeShard(ref, shard));
  }

  // ----- publishing ----------------------------------------------------------------

  /**
   * Publish one record to `shard` through its leader (at least once: see
   * `publishBatch`).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {import('../index').RecordArg} record
   * @returns {Promise<bigint>} its offset
   */
  async publish(stream, shard, record) {
    return (await this.publishBatch(stream, shard, [record])).baseOffset;
  }

  /**
   * Publish records to `shard` in one request through its leader; they
   * get consecutive offsets. Sent again when its answer was lost or
   * `unavailable`, so across a failover the batch can be written twice
   * (the offsets returned are those of the copy acknowledged).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {import('../index').RecordArg[]} records
   * @returns {Promise<import('../index').Published>}
   */
  async publishBatch(stream, shard, records) {
    return this.#shardCall(stream, shard, Retry.LOST, (c, ref) => c.publishBatch(ref, shard, records));
  }

  /**
   * Publish one record with a routing key, through the leader of its
   * shard, `crc32c(key) % shards` (as the broker routes it; see
   * `Client.publishKeyed`). At least once, as `publishBatch`.
   * @param {import('../index').StreamArg} stream
   * @param {Buffer|Uint8Array|string} key
   * @param {import('../index').RecordArg} record
   * @returns {Promise<import('../index').Published>}
   */
  async publishKeyed(stream, key, record) {
    return this.publishKeyedBatch(stream, key, [record]);
  }

  /**
   * Publish records under one routing key in one request through the
   * leader of the key's shard (see `Client.publishKeyedBatch`). The shard
   * count is asked once and kept.
   * @param {import('../index').StreamArg} stream
   * @param {Buffer|Uint8Array|string} key
   * @param {import('../index').RecordArg[]} records
   * @returns {Promise<import('../index').Published>}
   */
  async publishKeyedBatch(stream, key, records) {
    const ref = args.streamRef(stream);
    const k = args.bytes(key, 'key');
    const path = pathOf(ref);
    const shards = this.#shardCounts.get(path) ?? (await this.describeStream(ref)).shards;
    const shard = shardForKey(k, shards);
    const p = await this.#onLeader(ref, shard, Retry.LOST, (c) => c.publishKeyedBatch(ref, k, records));
    // The broker routed it elsewhere: the stream was created again with
    // another shard count. Asked again next time.
    if (p.shard !== shard) this.#shardCounts.delete(path);
    return p;
  }

  // ----- reading -------------------------------------------------------------------

  /**
   * Read up to `maxRecords` records of `shard` from `from`, from the broker
   * that last led it (every replica serves reads of what is committed; a
   * follower's copy can be a moment behind its leader's). See `Client.read`.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {import('../index').StartPosition} from
   * @param {import('../index').ReadOptions} [options] defaults: 100 records, no wait
   * @returns {Promise<import('../index').ReadBatch>}
   */
  async read(stream, shard, from, options = {}) {
    return this.#shardCall(stream, shard, Retry.READ, (c, ref) => c.read(ref, shard, from, options));
  }

  /**
   * Follow `shard` from `from`, long-polling at the tail, each read made
   * as `read` makes it: an async iterable of records in offset order (see
   * `Client.subscribe`).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {import('../index').StartPosition} from
   * @param {import('../index').ReadOptions} [options] defaults: 500 records a read, 10 s wait
   * @returns {Subscription}
   */
  subscribe(stream, shard, from, options = {}) {
    return Subscription.follow(this, stream, shard, from, options);
  }

  // ----- consumer groups: each call on the shard's leader, as Client's of the same name -----

  /**
   * `Client.groupPoll` on the shard's leader. A member that polls with
   * `reclaim` after a failover finds nothing to reclaim: claims were the
   * old leader's memory, and the records are owed to the group again.
   * Sent again when its answer was lost: what the lost answer claimed
   * goes back to the group once its visibility lapses.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').GroupPollOptions} [options]
   * @returns {Promise<import('../index').GroupRecord[]>}
   */
  async groupPoll(stream, shard, group, options = {}) {
    return this.#shardCall(stream, shard, Retry.LOST, (c, ref) => c.groupPoll(ref, shard, group, options));
  }

  /**
   * `Client.groupAck` on the shard's leader (sent again when its answer
   * was lost). An empty array sends nothing.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').OffsetArg|import('../index').OffsetArg[]} offsets
   * @returns {Promise<void>}
   */
  async groupAck(stream, shard, group, offsets) {
    if (Array.isArray(offsets) && offsets.length === 0) {
      args.streamRef(stream);
      args.u32(shard, 'shard');
      args.name(group, 'group');
      return undefined;
    }
    return this.#shardCall(stream, shard, Retry.LOST, (c, ref) => c.groupAck(ref, shard, group, offsets));
  }

  /**
   * `Client.groupNack` on the shard's leader (not sent again after a lost answer).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').Claim} record
   * @param {{delayMs?: number, reason?: string}} [options]
   * @returns {Promise<void>}
   */
  async groupNack(stream, shard, group, record, options = {}) {
    return this.#shardCall(stream, shard, Retry.REFUSED, (c, ref) => c.groupNack(ref, shard, group, record, options));
  }

  /**
   * `Client.groupNackAfter` on the shard's leader (not sent again after a lost answer).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').Claim} record
   * @param {number} delayMs
   * @param {{reason?: string}} [options]
   * @returns {Promise<void>}
   */
  async groupNackAfter(stream, shard, group, record, delayMs, options = {}) {
    return this.#shardCall(stream, shard, Retry.REFUSED, (c, ref) => c.groupNackAfter(ref, shard, group, record, delayMs, options));
  }

  /**
   * `Client.groupExtend` on the shard's leader (not sent again after a lost answer).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').Claim} record
   * @param {number} byMs
   * @returns {Promise<number>} how long the claim now stands, in ms
   */
  async groupExtend(stream, shard, group, record, byMs) {
    return this.#shardCall(stream, shard, Retry.REFUSED, (c, ref) => c.groupExtend(ref, shard, group, record, byMs));
  }

  /**
   * `Client.groupDeadLetter` on the shard's leader (not sent again after a lost answer).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').Claim} record
   * @param {string} [reason]
   * @returns {Promise<void>}
   */
  async groupDeadLetter(stream, shard, group, record, reason) {
    return this.#shardCall(stream, shard, Retry.REFUSED, (c, ref) => c.groupDeadLetter(ref, shard, group, record, reason));
  }

  /**
   * `Client.groupDeadLetters` on the shard's leader (answered only once a
   * majority confirms it still leads).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @returns {Promise<bigint[]>}
   */
  async groupDeadLetters(stream, shard, group) {
    return this.#shardCall(stream, shard, Retry.LOST, (c, ref) => c.groupDeadLetters(ref, shard, group));
  }

  /**
   * `Client.groupDeadLettersDetailed` on the shard's leader (every page
   * from one broker; asked again whole when an answer was lost).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @returns {Promise<import('../index').DeadLetterInfo[]>}
   */
  async groupDeadLettersDetailed(stream, shard, group) {
    return this.#shardCall(stream, shard, Retry.LOST, (c, ref) => c.groupDeadLettersDetailed(ref, shard, group));
  }

  /**
   * `Client.groupDeadLettersPage` on the shard's leader.
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').OffsetArg} from
   * @param {number} max
   * @returns {Promise<import('../index').DeadLetterPage>}
   */
  async groupDeadLettersPage(stream, shard, group, from, max) {
    return this.#shardCall(stream, shard, Retry.LOST, (c, ref) => c.groupDeadLettersPage(ref, shard, group, from, max));
  }

  /**
   * `Client.groupRedrive` on the shard's leader (not sent again after a lost answer).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').OffsetArg} offset
   * @returns {Promise<void>}
   */
  async groupRedrive(stream, shard, group, offset) {
    return this.#shardCall(stream, shard, Retry.REFUSED, (c, ref) => c.groupRedrive(ref, shard, group, offset));
  }

  /**
   * `Client.groupDiscard` on the shard's leader (not sent again after a lost answer).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').OffsetArg} offset
   * @returns {Promise<void>}
   */
  async groupDiscard(stream, shard, group, offset) {
    return this.#shardCall(stream, shard, Retry.REFUSED, (c, ref) => c.groupDiscard(ref, shard, group, offset));
  }

  /**
   * `Client.groupCreate` on the shard's leader (a group that exists is
   * left alone, so it is sent again when its answer was lost).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').StartPosition} start
   * @returns {Promise<void>}
   */
  async groupCreate(stream, shard, group, start = 'earliest') {
    return this.#shardCall(stream, shard, Retry.LOST, (c, ref) => c.groupCreate(ref, shard, group, start));
  }

  /**
   * `Client.groupSeek` on the shard's leader (not sent again after a lost answer).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @param {import('../index').StartPosition} start
   * @returns {Promise<void>}
   */
  async groupSeek(stream, shard, group, start) {
    return this.#shardCall(stream, shard, Retry.REFUSED, (c, ref) => c.groupSeek(ref, shard, group, start));
  }

  /**
   * `Client.groupDescribe` on the shard's leader (answered only once a
   * majority confirms it still leads).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @returns {Promise<import('../index').GroupInfo>}
   */
  async groupDescribe(stream, shard, group) {
    return this.#shardCall(stream, shard, Retry.LOST, (c, ref) => c.groupDescribe(ref, shard, group));
  }

  /**
   * `Client.groupDelete` on the shard's leader (not sent again after a lost answer).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @param {string} group
   * @returns {Promise<void>}
   */
  async groupDelete(stream, shard, group) {
    return this.#shardCall(stream, shard, Retry.REFUSED, (c, ref) => c.groupDelete(ref, shard, group));
  }

  /**
   * `Client.listGroups` on the shard's leader (answered only once a
   * majority confirms it still leads).
   * @param {import('../index').StreamArg} stream
   * @param {number} shard
   * @returns {Promise<string[]>}
   */
  async listGroups(stream, shard) {
    return this.#shardCall(stream, shard, Retry.LOST, (c, ref) => c.listGroups(ref, shard));
  }

  // ----- consumer groups: a whole stream ---------------------------------------------

  /**
   * `groupCreate` on every shard of the stream, each on its leader
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
   * `groupSeek` on every shard of the stream, each on its leader.
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @param {import('../index').StartPosition} start
   * @returns {Promise<void>}
   */
  async groupSeekStream(stream, group, start) {
    return streamGroups.groupSeekStream(this, stream, group, start);
  }

  /**
   * `groupDescribe` of every shard, in shard order, each from its leader.
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @returns {Promise<import('../index').GroupInfo[]>}
   */
  async groupDescribeStream(stream, group) {
    return streamGroups.groupDescribeStream(this, stream, group);
  }

  /**
   * `groupDelete` on every shard of the stream, each on its leader.
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @returns {Promise<void>}
   */
  async groupDeleteStream(stream, group) {
    return streamGroups.groupDeleteStream(this, stream, group);
  }

  /**
   * One consumer of `group` on every shard of the stream, each shard's
   * polls, acks, nacks, extensions and dead letters on the broker that
   * leads it, following a new leader after a failover (see `ShardedGroup`
   * and `Client.shardedGroup`). Claims are the leader's memory: after a
   * failover the records a lost leader had handed out are owed again from
   * the group's durable position, so an ack of one of them may be refused
   * (`StaleClaimError`, once it has gone out again) and a record can
   * arrive twice. A member's `reclaim` takes back only what it held on the
   * leader it polls.
   * @param {import('../index').StreamArg} stream
   * @param {string} group
   * @param {import('../index').ShardedGroupOptions} [options]
   * @returns {Promise<ShardedGroup>}
   */
  async shardedGroup(stream, group, options = {}) {
    return ShardedGroup.open(this, stream, group, options, { byCore: false });
  }
}

module.exports = {
  ClusterClient,
  retryable,
  Retry,
  incarnationToCreate,
  enoughAnswered,
  keepsIncarnations,
  createOnBroker,
  showIncarnation,
  ATTEMPTS,
  BACKOFF_FIRST_MS,
  BACKOFF_MAX_MS,
};
