// Public types of felix-client (hand-written; see src/ for the JSDoc).

/// <reference types="node" />

/** A stream as "tenant/namespace/stream" or its three parts. */
export type StreamArg = string | StreamRef;
/** An offset: a bigint, or a non-negative safe integer number. */
export type OffsetArg = bigint | number;
/** Where a read or a group starts. */
export type StartPosition = 'earliest' | 'latest' | OffsetArg;
/** A payload alone, or a record with a key, headers and a timestamp. */
export type RecordArg = Buffer | Uint8Array | string | RecordIn;
/** What nack/extend/dead-letter need of a delivered record. */
export type Claim = Pick<GroupRecord, 'offset' | 'attempts'>;

export interface StreamRef { tenant: string; namespace: string; stream: string; }

export interface RecordIn {
  payload: Buffer | Uint8Array | string;
  key?: Buffer | Uint8Array | string;
  /** `[[name, value], ...]` (order kept, names may repeat) or `{name: value}`. */
  headers?: Array<[string, Buffer | Uint8Array | string]> | { [name: string]: Buffer | Uint8Array | string };
  /** Unix ms; absent = the broker's clock. */
  timestampMs?: number | bigint;
}

export interface ClientOptions {
  /** Sent in HELLO; a broker with a tokens file requires one it lists. */
  token?: string;
  /** Publishes are answered once durable (needs FEATURES.PUBLISH_ACK_MODE). Default false. */
  ackOnCommit?: boolean;
  /** Limit on an answer; a long poll gets its wait on top. Default 30,000. */
  requestTimeoutMs?: number;
  /** Limit on connecting and HELLO. Default 5,000. */
  connectTimeoutMs?: number;
  /** Largest frame accepted from the broker. Default 64 MiB. */
  maxFrameBytes?: number;
  /** First reconnect delay after a failed attempt; doubles up to reconnectBackoffMaxMs. Default 100. */
  reconnectBackoffMs?: number;
  /** Default 5,000. */
  reconnectBackoffMaxMs?: number;
  /** Shows in the broker's logs. */
  clientName?: string;
}

export interface StreamInfo {
  stream: StreamRef;
  shards: number;
  /** u64 on the wire: a bigint, exact past 2^53. */
  retentionBytes?: bigint;
  /** u64 on the wire: a bigint, exact past 2^53. */
  retentionMs?: bigint;
  /** Owning core, one per shard. */
  placement: number[];
  /**
   * On a broker of a cluster (FEATURES.STREAM_INCARNATION): which creation
   * of the stream this is, the same on every broker; absent for a stream
   * created without one. Only `describeStream` and `createStream` report it.
   */
  incarnation?: bigint;
}

export interface CreateStreamOptions {
  /** Absent = the broker's default (no limit). */
  retentionBytes?: OffsetArg;
  /** Absent = the broker's default (no limit). */
  retentionMs?: OffsetArg;
  /**
   * 1 to 2^63-1: create the stream on this broker of a cluster as this
   * incarnation (needs FEATURES.STREAM_INCARNATION, refused locally
   * without it). ClusterClient.createStream chooses it; it takes none.
   */
  incarnation?: OffsetArg;
}

export interface ShardInfo {
  stream: StreamRef;
  shard: number;
  core: number;
  startOffset: bigint;
  endOffset: bigint;
  bytes: number;
  segments: number;
  /** Why the shard stopped taking writes, if it did. */
  stopped?: string;
}

/** One broker's replica of a shard, as that broker sees it (a broker in a cluster). Indices count replication entries, not offsets. */
export interface ReplicaInfo {
  stream: StreamRef;
  shard: number;
  /** The answering broker's node id. */
  node: bigint;
  role: 'leader' | 'elected' | 'follower' | 'electing' | 'stopped';
  term: bigint;
  /** The leader's node id and client address, as this broker knows them. */
  leader?: bigint;
  leaderAddr?: string;
  commit: bigint;
  applied: bigint;
  lastIndex: bigint;
  compacted: bigint;
  /** Why the replica stopped, if it did. */
  stopped?: string;
  /** On the leader, every other broker's progress; empty elsewhere. */
  peers: { node: bigint; matched: bigint }[];
}

/** One broker of a cluster, as `describeCluster` names it. */
export interface ClusterMember {
  /** Its node id. */
  node: bigint;
  /** Where clients reach it (its `server.listen`), `host:port`. */
  addr: string;
}

/** A broker's answer to `describeCluster` (a broker in a cluster, FEATURES.CLUSTER_INFO). */
export interface ClusterInfo {
  /** The answering broker's node id. */
  node: bigint;
  /** Every broker of the cluster, the answering one included, in node order. */
  members: ClusterMember[];
}

export interface Published {
  shard: number;
  baseOffset: bigint;
  count: number;
  lastOffset: bigint;
}

export interface Record {
  offset: bigint;
  timestampMs: number;
  key?: Buffer;
  headers: Array<[string, Buffer]>;
  payload: Buffer;
}

export interface ReadBatch {
  records: Record[];
  /** Where the following read starts. */
  nextOffset: bigint;
  startOffset: bigint;
  endOffset: bigint;
}

export interface GroupRecord extends Record {
  /** Deliveries so far, this one included. */
  attempts: number;
  /** Offsets directly below settled without delivery; undefined unless FEATURES.GROUP_SKIPPED was negotiated. */
  skippedBefore?: bigint;
}

export interface GroupPollOptions {
  /** Default 16. */
  maxRecords?: number;
  /** How long the broker may wait for a record. Default 0. */
  waitMs?: number;
  /** Poll as this named member (1 to 128 bytes). */
  consumer?: string;
  /** Take back what `consumer` held on older connections. */
  reclaim?: boolean;
  /** How long these claims stand (needs FEATURES.GROUP_CLAIM_CONTROL). */
  visibilityMs?: number;
}

export interface DeadLetterInfo {
  offset: bigint;
  attempts: number;
  atMs: number;
  reason?: string;
  /** True: a consumer dead-lettered it; false: the broker gave up. */
  byConsumer: boolean;
}

export interface DeadLetterPage { letters: DeadLetterInfo[]; next?: bigint; }

export interface GroupInfo {
  group: string;
  position: bigint;
  endOffset: bigint;
  startOffset: bigint;
  /** endOffset - max(position, startOffset): records the group has yet to finish. */
  lag: bigint;
  inFlight: number;
  owed: number;
  delayed: number;
  deadLetters: number;
  oldestInFlightAgeMs?: number;
  oldestOwedAgeMs?: number;
  lastActiveMs?: number;
}

export interface ReadOptions { maxRecords?: number; waitMs?: number; }

/** A record claimed through a ShardedGroup: a GroupRecord and the shard it came from. */
export interface ShardedRecord extends GroupRecord {
  shard: number;
}

export interface ShardedGroupOptions {
  /** Poll every shard as this named member (1 to 128 bytes). */
  consumer?: string;
  /** Take back, shard by shard, what `consumer` held on older connections. */
  reclaim?: boolean;
  /** How long these claims stand (needs FEATURES.GROUP_CLAIM_CONTROL, checked on each poll). */
  visibilityMs?: number;
  /** How long each waiting poll lasts before it is sent again. Default 1,000, at least 10. */
  waitSliceMs?: number;
}

export interface ShardedPollOptions {
  /** Default 16. */
  maxRecords?: number;
  /** How long to wait for a record when none is available. Default 0. */
  waitMs?: number;
  /**
   * Ends the poll on the spot, rejecting with the signal's reason; it hands
   * out nothing and what its shard polls claim stays held for the next poll.
   * The safe way to time a poll out: never race it with `Promise.race`.
   */
  signal?: AbortSignal;
}

/**
 * One consumer of a group on every shard of a stream (`client.shardedGroup`,
 * or `cluster.shardedGroup` on a ClusterClient: each shard's calls on its leader).
 * Records leave it only as the value of a poll() that resolves with them (or
 * as close()'s nacks): everything its shard polls claim is held first. One
 * poll at a time: a new poll() or close() ends one still running, which
 * resolves empty; its claims stay held for the next. Time a poll out with
 * `waitMs` or `signal`, not `Promise.race`: a raced poll left running
 * resolves with what it claims to nobody.
 */
export class ShardedGroup {
  /** The stream's shard count. */
  readonly shards: number;
  readonly group: string;
  readonly stream: StreamRef;
  /** Records claimed by shard polls and not yet handed out; the next poll hands them out first. */
  readonly held: number;
  poll(options?: ShardedPollOptions): Promise<ShardedRecord[]>;
  ack(record: ShardedRecord): Promise<void>;
  /** One request per shard, all sent at once; the first error is thrown after every one is answered. */
  ackMany(records: ShardedRecord[]): Promise<void>;
  nack(record: ShardedRecord, options?: { delayMs?: number; reason?: string }): Promise<void>;
  nackAfter(record: ShardedRecord, delayMs: number, options?: { reason?: string }): Promise<void>;
  /** Resolves to how long the claim now stands, in ms. */
  extend(record: ShardedRecord, byMs: number): Promise<number>;
  deadLetter(record: ShardedRecord, reason?: string): Promise<void>;
  /** The group on every shard, in shard order. */
  describe(): Promise<GroupInfo[]>;
  /** The sum of every shard's lag. */
  lag(): Promise<bigint>;
  /** Waits for the polls out (a wait slice, at most 5 s more) and nacks everything held. Leaves the client open. */
  close(): Promise<void>;
}

/**
 * Follows one shard. A failed read rejects `next()` (ending a `for await`);
 * the next `next()` reads again from the same position after a pause.
 */
export class Subscription implements AsyncIterable<Record> {
  /** Where the next read starts. */
  readonly position: 'earliest' | 'latest' | bigint;
  /** Offsets retention removed before this subscription read them. */
  readonly skippedByRetention: bigint;
  close(): void;
  next(): Promise<IteratorResult<Record>>;
  [Symbol.asyncIterator](): AsyncIterator<Record>;
}

export class Client {
  static connect(addr: string, options?: ClientOptions): Promise<Client>;
  readonly features: number;
  readonly cores: number;
  readonly broker: string;
  /** The largest frame the broker accepts (latest HELLO). */
  readonly maxFrameBytes: number;
  /** The core calls not about one shard go to; moves if the broker comes back without it. */
  readonly homeCore: number;
  /** Cores this client holds a live connection to, in order. */
  readonly connectedCores: number[];
  /** Bytes of requests waiting for a backed-up socket to drain. */
  readonly queuedBytes: number;
  hasFeature(feature: number): boolean;
  close(): void;
  ping(): Promise<number>;

  /** `incarnation` needs FEATURES.STREAM_INCARNATION (refused locally without it). */
  createStream(stream: StreamArg, shards: number, options?: CreateStreamOptions): Promise<StreamInfo>;
  describeStream(stream: StreamArg): Promise<StreamInfo>;
  listStreams(tenant?: string): Promise<StreamInfo[]>;
  deleteStream(stream: StreamArg): Promise<void>;
  describeShard(stream: StreamArg, shard: number): Promise<ShardInfo>;
  /** This broker's replica of a shard (a broker in a cluster, `FEATURES.REPLICA_INFO`). */
  describeReplica(stream: StreamArg, shard: number): Promise<ReplicaInfo>;
  /**
   * Every broker of this broker's cluster with its client address, in node
   * order (a broker in a cluster, `FEATURES.CLUSTER_INFO`; refused locally
   * with UnsupportedError elsewhere).
   */
  describeCluster(): Promise<ClusterInfo>;

  publish(stream: StreamArg, shard: number, record: RecordArg): Promise<bigint>;
  publishBatch(stream: StreamArg, shard: number, records: RecordArg[]): Promise<Published>;
  publishKeyed(stream: StreamArg, key: Buffer | Uint8Array | string, record: RecordArg): Promise<Published>;
  publishKeyedBatch(stream: StreamArg, key: Buffer | Uint8Array | string, records: RecordArg[]): Promise<Published>;

  read(stream: StreamArg, shard: number, from: StartPosition, options?: ReadOptions): Promise<ReadBatch>;
  subscribe(stream: StreamArg, shard: number, from: StartPosition, options?: ReadOptions): Subscription;

  groupPoll(stream: StreamArg, shard: number, group: string, options?: GroupPollOptions): Promise<GroupRecord[]>;
  groupAck(stream: StreamArg, shard: number, group: string, offsets: OffsetArg | GroupRecord | Array<OffsetArg | GroupRecord>): Promise<void>;
  groupNack(stream: StreamArg, shard: number, group: string, record: Claim, options?: { delayMs?: number; reason?: string }): Promise<void>;
  groupNackAfter(stream: StreamArg, shard: number, group: string, record: Claim, delayMs: number, options?: { reason?: string }): Promise<void>;
  /** Resolves to how long the claim now stands, in ms. */
  groupExtend(stream: StreamArg, shard: number, group: string, record: Claim, byMs: number): Promise<number>;
  groupDeadLetter(stream: StreamArg, shard: number, group: string, record: Claim, reason?: string): Promise<void>;
  groupDeadLetters(stream: StreamArg, shard: number, group: string): Promise<bigint[]>;
  groupDeadLettersDetailed(stream: StreamArg, shard: number, group: string): Promise<DeadLetterInfo[]>;
  groupDeadLettersPage(stream: StreamArg, shard: number, group: string, from: OffsetArg, max: number): Promise<DeadLetterPage>;
  groupRedrive(stream: StreamArg, shard: number, group: string, offset: OffsetArg): Promise<void>;
  groupDiscard(stream: StreamArg, shard: number, group: string, offset: OffsetArg): Promise<void>;
  groupCreate(stream: StreamArg, shard: number, group: string, start?: StartPosition): Promise<void>;
  groupSeek(stream: StreamArg, shard: number, group: string, start: StartPosition): Promise<void>;
  groupDescribe(stream: StreamArg, shard: number, group: string): Promise<GroupInfo>;
  groupDelete(stream: StreamArg, shard: number, group: string): Promise<void>;
  listGroups(stream: StreamArg, shard: number): Promise<string[]>;
  /** An offset is accepted for a one-shard stream only (refused with InvalidArgumentError otherwise). */
  groupCreateStream(stream: StreamArg, group: string, start?: StartPosition): Promise<void>;
  /** An offset is accepted for a one-shard stream only (refused with InvalidArgumentError otherwise). */
  groupSeekStream(stream: StreamArg, group: string, start: StartPosition): Promise<void>;
  groupDescribeStream(stream: StreamArg, group: string): Promise<GroupInfo[]>;
  groupDeleteStream(stream: StreamArg, group: string): Promise<void>;
  /** One consumer of `group` on every shard of the stream (asks the broker for the shard count). */
  shardedGroup(stream: StreamArg, group: string, options?: ShardedGroupOptions): Promise<ShardedGroup>;
}

/** One broker's answer in `ClusterClient.describeReplicas`: its replica, or why it gave none. */
export type ReplicaAnswer =
  | { broker: string; replica: ReplicaInfo; error?: undefined }
  | { broker: string; replica?: undefined; error: FelixError };

/**
 * A client for a cluster of brokers, every shard replicated on each and
 * served by its elected leader: each per-shard call goes to the shard's
 * leader, following `not_leader` answers and trying the other brokers
 * (backing off, 40 attempts, about 18 seconds) while none is known. The
 * per-shard calls take the same arguments as Client's.
 *
 * Sent again after a lost answer (a dropped connection, a timeout) or an
 * `unavailable`: publishes (at least once: a record can be written twice
 * across a failover), reads, polls, acks, group creates, describes and
 * dead-letter lists. Every other group call (nack, extend, dead-letter,
 * redrive, discard, seek, delete, and `withLeader`) is tried again only
 * where nothing was applied (`not_leader`, a broker not reached); a lost
 * answer rejects with its error.
 */
export class ClusterClient {
  /**
   * Each address counts once (trimmed); at least one broker must answer
   * now. The first that answers names every broker of its cluster
   * (`Client.describeCluster`, FEATURES.CLUSTER_INFO), so one address is
   * enough; a broker that cannot say leaves the brokers given as the
   * cluster's. One that fails to name them is passed over for the next.
   */
  static connect(brokers: string | string[], options?: ClientOptions): Promise<ClusterClient>;
  /** The brokers given at connect (each once, in order), then those of the cluster learned at connect and not given. */
  readonly brokers: readonly string[];
  /**
   * The cluster's brokers as the first broker reached named them (client
   * addresses, in node order); the brokers given when it could not say.
   * Streams are created, deleted and described on these.
   */
  readonly members: readonly string[];
  /** The broker that last led the shard, if one is known. */
  leaderOf(stream: StreamArg, shard: number): string | undefined;
  /** Closes every broker's client; calls in flight or backing off reject with DisconnectedError. */
  close(): void;
  /** Any per-shard call of the leader's Client, tried again only where nothing was applied. */
  withLeader<T>(stream: StreamArg, shard: number, call: (client: Client) => Promise<T>): Promise<T>;

  /**
   * On every broker of the cluster (`members`), as one incarnation (the
   * one more than half of them already hold, or a new one); resolves to
   * the first member's view. Refused with AlreadyExistsError, naming the brokers, where a
   * broker holds another shard count, the holders disagree, or half of
   * the brokers or fewer hold it. A broker that cannot be reached is passed
   * over: made on the others, then UnavailableError naming it (run the
   * same create again once it is back); nothing is made when half of the
   * brokers or fewer answer, or when the holders' majority turns on those
   * that did not.
   */
  createStream(stream: StreamArg, shards: number, options?: { retentionBytes?: OffsetArg; retentionMs?: OffsetArg }): Promise<StreamInfo>;
  /** As the first of `members` that answers has it. */
  describeStream(stream: StreamArg): Promise<StreamInfo>;
  /** As the first of `members` that answers has them. */
  listStreams(tenant?: string): Promise<StreamInfo[]>;
  /** On every broker of the cluster (`members`; one already gone is fine); the first other error is thrown once all were tried. */
  deleteStream(stream: StreamArg): Promise<void>;
  /** Every member's view in the order of `members`, asked all at once; remembers the leader of the newest term. */
  describeReplicas(stream: StreamArg, shard: number): Promise<ReplicaAnswer[]>;
  describeShard(stream: StreamArg, shard: number): Promise<ShardInfo>;

  publish(stream: StreamArg, shard: number, record: RecordArg): Promise<bigint>;
  publishBatch(stream: StreamArg, shard: number, records: RecordArg[]): Promise<Published>;
  publishKeyed(stream: StreamArg, key: Buffer | Uint8Array | string, record: RecordArg): Promise<Published>;
  publishKeyedBatch(stream: StreamArg, key: Buffer | Uint8Array | string, records: RecordArg[]): Promise<Published>;

  /** From the broker that last led the shard (any replica answers a read). */
  read(stream: StreamArg, shard: number, from: StartPosition, options?: ReadOptions): Promise<ReadBatch>;
  subscribe(stream: StreamArg, shard: number, from: StartPosition, options?: ReadOptions): Subscription;

  groupPoll(stream: StreamArg, shard: number, group: string, options?: GroupPollOptions): Promise<GroupRecord[]>;
  groupAck(stream: StreamArg, shard: number, group: string, offsets: OffsetArg | GroupRecord | Array<OffsetArg | GroupRecord>): Promise<void>;
  groupNack(stream: StreamArg, shard: number, group: string, record: Claim, options?: { delayMs?: number; reason?: string }): Promise<void>;
  groupNackAfter(stream: StreamArg, shard: number, group: string, record: Claim, delayMs: number, options?: { reason?: string }): Promise<void>;
  groupExtend(stream: StreamArg, shard: number, group: string, record: Claim, byMs: number): Promise<number>;
  groupDeadLetter(stream: StreamArg, shard: number, group: string, record: Claim, reason?: string): Promise<void>;
  groupDeadLetters(stream: StreamArg, shard: number, group: string): Promise<bigint[]>;
  groupDeadLettersDetailed(stream: StreamArg, shard: number, group: string): Promise<DeadLetterInfo[]>;
  groupDeadLettersPage(stream: StreamArg, shard: number, group: string, from: OffsetArg, max: number): Promise<DeadLetterPage>;
  groupRedrive(stream: StreamArg, shard: number, group: string, offset: OffsetArg): Promise<void>;
  groupDiscard(stream: StreamArg, shard: number, group: string, offset: OffsetArg): Promise<void>;
  groupCreate(stream: StreamArg, shard: number, group: string, start?: StartPosition): Promise<void>;
  groupSeek(stream: StreamArg, shard: number, group: string, start: StartPosition): Promise<void>;
  groupDescribe(stream: StreamArg, shard: number, group: string): Promise<GroupInfo>;
  groupDelete(stream: StreamArg, shard: number, group: string): Promise<void>;
  listGroups(stream: StreamArg, shard: number): Promise<string[]>;
  groupCreateStream(stream: StreamArg, group: string, start?: StartPosition): Promise<void>;
  groupSeekStream(stream: StreamArg, group: string, start: StartPosition): Promise<void>;
  groupDescribeStream(stream: StreamArg, group: string): Promise<GroupInfo[]>;
  groupDeleteStream(stream: StreamArg, group: string): Promise<void>;
  /** One consumer of `group` on every shard, each shard's calls on its leader. */
  shardedGroup(stream: StreamArg, group: string, options?: ShardedGroupOptions): Promise<ShardedGroup>;
}

export declare const FEATURES: {
  readonly GROUPS: 0x01;
  readonly GROUP_SKIPPED: 0x02;
  readonly GROUP_CLAIM_CONTROL: 0x04;
  readonly GROUP_ADMIN: 0x08;
  readonly PUBLISH_ACK_MODE: 0x10;
  readonly GROUP_DEAD_LETTER_PAGES: 0x20;
  readonly REPLICA_INFO: 0x40;
  readonly STREAM_INCARNATION: 0x80;
  readonly CLUSTER_INFO: 0x100;
  readonly ERROR_NOT_APPLIED: 0x200;
};
export declare const FEATURES_ALL: number;
export declare const PROTOCOL_VERSION: number;
export function shardForKey(key: Buffer | Uint8Array | string, shards: number): number;
export function crc32c(bytes: Uint8Array): number;

export class FelixError extends Error {
  /** The wire's snake_case name, or a client-side one: invalid_argument, timeout, disconnected, protocol, io. */
  readonly code: string;
  /** The request certainly did nothing (refused before any of it was done, `not_leader`, or never sent): sending it again cannot apply it twice. False: not known from the error alone. */
  readonly notApplied: boolean;
}
export class ServerError extends FelixError {
  /** The code on the wire; set on every answer from the broker, absent only on an UnsupportedError the client raised itself. */
  readonly wireCode?: number;
  readonly core?: number;
}
export class InvalidRequestError extends ServerError {}
export class NotFoundError extends ServerError {}
export class AlreadyExistsError extends ServerError {}
export class WrongCoreError extends ServerError {}
export class UnsupportedError extends ServerError {
  /** True when the client refused to send (the broker did not advertise the feature); `wireCode` is then absent. */
  readonly local: boolean;
}
export class TooLargeError extends ServerError {}
export class UnavailableError extends ServerError {}
export class UnauthorizedError extends ServerError {}
export class StaleClaimError extends ServerError {}
export class NotLeaderError extends ServerError {
  /** The client address of the broker that leads the shard, when the answering broker knows it. */
  readonly leader?: string;
}
export class InternalError extends ServerError {}
export class BusyError extends ServerError {}
export class InvalidArgumentError extends FelixError {}
export class TimeoutError extends FelixError {}
export class DisconnectedError extends FelixError {}
export class ProtocolError extends FelixError {}
export class ConnectionError extends FelixError {}
export function errorFromWire(code: number, message: string, core?: number, leader?: string): ServerError;
