'use strict';

/**
 * The Felix wire protocol, version 1: frame layout, opcodes, feature bits,
 * body encoders and a bounds-checked decoder (docs/internals/wire-protocol.md).
 * Every integer is little-endian; there is exactly one encoding of every message.
 * @module felix-client/wire
 */

const PROTOCOL_VERSION = 1;
const FRAME_HEADER_BYTES = 16;
/** Bytes counted by a frame's `len` that belong to the header. */
const HEADER_AFTER_LEN = 12;
const KIND_REQUEST = 1;
const KIND_RESPONSE = 2;
/** Most elements any list in a message may hold. */
const MAX_ITEMS_PER_VEC = 100_000;
const U64_MAX = (1n << 64n) - 1n;

/** Feature bits negotiated in HELLO. */
const FEATURES = Object.freeze({
  GROUPS: 0x01,
  GROUP_SKIPPED: 0x02,
  GROUP_CLAIM_CONTROL: 0x04,
  GROUP_ADMIN: 0x08,
  PUBLISH_ACK_MODE: 0x10,
  GROUP_DEAD_LETTER_PAGES: 0x20,
  REPLICA_INFO: 0x40,
  STREAM_INCARNATION: 0x80,
  CLUSTER_INFO: 0x100,
  ERROR_NOT_APPLIED: 0x200,
});
/** Every feature bit this client understands (what it offers in HELLO). */
const FEATURES_ALL = Object.values(FEATURES).reduce((a, b) => a | b, 0);

/** Request opcodes (frame kind 1). */
const OP = Object.freeze({
  HELLO: 0x01,
  PING: 0x02,
  CREATE_STREAM: 0x10,
  DESCRIBE_STREAM: 0x11,
  LIST_STREAMS: 0x12,
  DELETE_STREAM: 0x13,
  DESCRIBE_SHARD: 0x14,
  DESCRIBE_REPLICA: 0x15,
  DESCRIBE_CLUSTER: 0x16,
  PUBLISH: 0x20,
  READ: 0x21,
  GROUP_POLL: 0x30,
  GROUP_ACK: 0x31,
  GROUP_NACK: 0x32,
  GROUP_EXTEND: 0x33,
  GROUP_DEAD_LETTER: 0x34,
  GROUP_DEAD_LETTERS: 0x35,
  GROUP_REDRIVE: 0x36,
  GROUP_DISCARD: 0x37,
  GROUP_DEAD_LETTERS_PAGE: 0x38,
  GROUP_CREATE: 0x40,
  GROUP_SEEK: 0x41,
  GROUP_DESCRIBE: 0x42,
  GROUP_DELETE: 0x43,
  LIST_GROUPS: 0x44,
});

/** AckMode values of a publish. */
const ACK = Object.freeze({ DEFAULT: 0, QUEUED: 1, DURABLE: 2 });

/** Largest stream incarnation a broker stores (2^63-1); the smallest is 1. */
const MAX_INCARNATION = (1n << 63n) - 1n;

/** A decode failure: the bytes from the broker are not a valid message. */
class DecodeError extends Error {}

// ----- encoding ------------------------------------------------------------

/** Appends little-endian fields to a growing buffer. */
class Writer {
  /** @param {number} [capacity] initial size guess */
  constructor(capacity = 256) {
    this.buf = Buffer.allocUnsafe(capacity);
    this.len = 0;
  }

  reserve(n) {
    if (this.len + n <= this.buf.length) return;
    const next = Buffer.allocUnsafe(Math.max(this.buf.length * 2, this.len + n));
    this.buf.copy(next, 0, 0, this.len);
    this.buf = next;
  }

  u8(v) {
    this.reserve(1);
    this.buf[this.len++] = v;
  }

  u16(v) {
    this.reserve(2);
    this.len = this.buf.writeUInt16LE(v, this.len);
  }

  u32(v) {
    this.reserve(4);
    this.len = this.buf.writeUInt32LE(v, this.len);
  }

  /** @param {bigint} v */
  u64(v) {
    this.reserve(8);
    this.len = this.buf.writeBigUInt64LE(v, this.len);
  }

  bool(v) {
    this.u8(v ? 1 : 0);
  }

  /** Raw bytes, no length prefix. */
  bytes(b) {
    this.reserve(b.length);
    this.buf.set(b, this.len);
    this.len += b.length;
  }

  /** `u16` length + UTF-8, cut at the last character boundary within 65,535 bytes (as the Rust codec). */
  str(s) {
    let b = Buffer.from(s, 'utf8');
    if (b.length > 0xffff) b = b.subarray(0, utf8Boundary(b, 0xffff));
    this.u16(b.length);
    this.bytes(b);
  }

  /** `u32` length + bytes. */
  blob(b) {
    this.u32(b.length);
    this.bytes(b);
  }

  /** `opt<T>`: presence byte, then `put(value)` when present. */
  opt(v, put) {
    if (v === undefined || v === null) {
      this.u8(0);
    } else {
      this.u8(1);
      put.call(this, v);
    }
  }

  finish() {
    return this.buf.subarray(0, this.len);
  }
}

/** Largest length <= max that does not split a UTF-8 character of `b`. */
function utf8Boundary(b, max) {
  let end = max;
  while (end > 0 && (b[end] & 0xc0) === 0x80) end--;
  return end;
}

/**
 * A whole request frame.
 * @param {bigint} requestId
 * @param {number} opcode
 * @param {(w: Writer) => void} body writes the body
 * @param {number} [sizeHint]
 * @returns {Buffer}
 */
function encodeRequest(requestId, opcode, body, sizeHint = 256) {
  const w = new Writer(FRAME_HEADER_BYTES + sizeHint);
  w.u32(0); // patched below
  w.u8(KIND_REQUEST);
  w.u8(opcode);
  w.u16(0);
  w.u64(requestId);
  body(w);
  const frame = w.finish();
  frame.writeUInt32LE(frame.length - 4, 0);
  return frame;
}

/** @param {Writer} w @param {{tenant: string, namespace: string, stream: string}} s */
function putStreamRef(w, s) {
  w.str(s.tenant);
  w.str(s.namespace);
  w.str(s.stream);
}

/** @param {Writer} w @param {{stream: object, shard: number, group: string}} key */
function putGroupKey(w, key) {
  putStreamRef(w, key.stream);
  w.u32(key.shard);
  w.str(key.group);
}

/** @param {Writer} w @param {'earliest'|'latest'|bigint} start */
function putStartPosition(w, start) {
  if (start === 'earliest') {
    w.u8(0);
  } else if (start === 'latest') {
    w.u8(1);
  } else {
    w.u8(2);
    w.u64(start);
  }
}

/** @param {Writer} w @param {{timestampMs?: bigint, key?: Buffer, headers: Array<[string, Buffer]>, payload: Buffer}} r */
function putRecordIn(w, r) {
  w.opt(r.timestampMs, w.u64);
  w.opt(r.key, w.blob);
  w.u32(r.headers.length);
  for (const [name, value] of r.headers) {
    w.str(name);
    w.blob(value);
  }
  w.blob(r.payload);
}

// ----- decoding ------------------------------------------------------------

// `ignoreBOM`: a leading U+FEFF is part of the string, not a marker to strip.
const UTF8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });
/** Every zero-length blob decoded is this one buffer, so a frame of empty blobs allocates no buffers. */
const EMPTY = Buffer.alloc(0);

/** Reads a message body; every length is checked against the bytes left first. */
class Reader {
  /** @param {Buffer} buf */
  constructor(buf) {
    this.buf = buf;
    this.pos = 0;
  }

  remaining() {
    return this.buf.length - this.pos;
  }

  need(n, what) {
    if (n > this.remaining()) throw new DecodeError(`truncated ${what}`);
  }

  u8(what) {
    this.need(1, what);
    return this.buf[this.pos++];
  }

  u16(what) {
    this.need(2, what);
    const v = this.buf.readUInt16LE(this.pos);
    this.pos += 2;
    return v;
  }

  u32(what) {
    this.need(4, what);
    const v = this.buf.readUInt32LE(this.pos);
    this.pos += 4;
    return v;
  }

  /** @returns {bigint} */
  u64(what) {
    this.need(8, what);
    const v = this.buf.readBigUInt64LE(this.pos);
    this.pos += 8;
    return v;
  }

  /** A u64 that is a count or a time, as a number. */
  u64n(what) {
    return Number(this.u64(what));
  }

  bool(what) {
    const v = this.u8(what);
    if (v > 1) throw new DecodeError(`invalid ${what}`);
    return v === 1;
  }

  str(what) {
    const len = this.u16(what);
    if (len === 0) return '';
    this.need(len, what);
    const raw = this.buf.subarray(this.pos, this.pos + len);
    this.pos += len;
    try {
      return UTF8.decode(raw);
    } catch {
      throw new DecodeError(`${what} is not valid UTF-8`);
    }
  }

  /**
   * A copy, so a kept payload does not pin the whole receive buffer. Empty
   * blobs share one buffer (do not write to a received buffer).
   */
  blob(what) {
    const len = this.u32(what);
    if (len === 0) return EMPTY;
    this.need(len, what);
    const b = Buffer.from(this.buf.subarray(this.pos, this.pos + len));
    this.pos += len;
    return b;
  }

  /** `opt<T>`: undefined when absent. */
  opt(what, read) {
    return this.bool(what) ? read.call(this, what) : undefined;
  }

  /**
   * A trailing `u64` (a field added after the message first shipped):
   * undefined when the body ends before it, else a value that is never 0.
   */
  trailingU64(what) {
    if (this.remaining() === 0) return undefined;
    const v = this.u64(what);
    if (v === 0n) throw new DecodeError(`invalid ${what} 0`);
    return v;
  }

  /**
   * `vec<T>`: the count is checked against the bytes left (each element
   * takes at least `minItemBytes`, which must be a true lower bound and at
   * least 1) and the item cap before anything is allocated, so a frame
   * promising more elements than it can hold fails at once and a decode
   * allocates in proportion to the frame.
   */
  vec(what, minItemBytes, read) {
    const n = this.u32(what);
    if (n * Math.max(minItemBytes, 1) > this.remaining()) throw new DecodeError(`truncated ${what}`);
    if (n > MAX_ITEMS_PER_VEC) {
      throw new DecodeError(`${what}: ${n} elements, over the limit of ${MAX_ITEMS_PER_VEC}`);
    }
    const out = new Array(n);
    for (let i = 0; i < n; i++) out[i] = read(this);
    return out;
  }

  finish() {
    if (this.remaining() !== 0) throw new DecodeError('trailing bytes after message body');
  }
}

// Smallest encodings, for Reader.vec's count check.
const MIN_STREAM_REF = 6;
const MIN_STREAM_INFO = MIN_STREAM_REF + 4 + 1 + 1 + 4;
const MIN_RECORD = 8 + 8 + 1 + 4 + 4;
const MIN_GROUP_RECORD = 8 + 4 + 8 + 1 + 4 + 4 + 1;
const MIN_DEAD_LETTER = 8 + 4 + 8 + 1 + 1;
const MIN_HEADER = 2 + 4;
const MIN_CLUSTER_MEMBER = 8 + 2;

function getStreamRef(r) {
  return { tenant: r.str('tenant'), namespace: r.str('namespace'), stream: r.str('stream') };
}

function getHeaders(r) {
  return r.vec('headers', MIN_HEADER, (h) => [h.str('header name'), h.blob('header value')]);
}

function getStreamInfo(r) {
  return {
    stream: getStreamRef(r),
    shards: r.u32('shards'),
    // u64 limits a user may set anywhere up to 2^64-1: bigints, not numbers.
    retentionBytes: r.opt('retention_bytes', r.u64),
    retentionMs: r.opt('retention_ms', r.u64),
    placement: r.vec('placement', 4, (p) => p.u32('placement')),
  };
}

function getShardInfo(r) {
  return {
    stream: getStreamRef(r),
    shard: r.u32('shard'),
    core: r.u32('core'),
    startOffset: r.u64('start_offset'),
    endOffset: r.u64('end_offset'),
    bytes: r.u64n('bytes'),
    segments: r.u32('segments'),
    stopped: r.opt('stopped', r.str),
  };
}

/** A replica's role by its wire number. */
const REPLICA_ROLES = ['leader', 'elected', 'follower', 'electing', 'stopped'];

function getReplicaInfo(r) {
  const stream = getStreamRef(r);
  const shard = r.u32('shard');
  const node = r.u64('node');
  const roleNumber = r.u8('replica role');
  const role = REPLICA_ROLES[roleNumber];
  if (role === undefined) throw new DecodeError(`unknown replica role ${roleNumber}`);
  return {
    stream,
    shard,
    node,
    role,
    term: r.u64('term'),
    leader: r.opt('leader', r.u64),
    leaderAddr: r.opt('leader_addr', r.str),
    commit: r.u64('commit'),
    applied: r.u64('applied'),
    lastIndex: r.u64('last_index'),
    compacted: r.u64('compacted'),
    stopped: r.opt('stopped', r.str),
    peers: r.vec('peers', 16, (p) => ({ node: p.u64('peer node'), matched: p.u64('peer matched') })),
  };
}

/** A `Cluster` answer: the answering broker's node id, then every broker of its cluster in node order. */
function getClusterInfo(r) {
  return {
    node: r.u64('node'),
    members: r.vec('members', MIN_CLUSTER_MEMBER, (m) => ({ node: m.u64('member node'), addr: m.str('member addr') })),
  };
}

function getRecord(r) {
  return {
    offset: r.u64('record offset'),
    timestampMs: r.u64n('record timestamp'),
    key: r.opt('record key', r.blob),
    headers: getHeaders(r),
    payload: r.blob('record payload'),
  };
}

function getGroupRecord(r) {
  return {
    offset: r.u64('record offset'),
    attempts: r.u32('record attempts'),
    timestampMs: r.u64n('record timestamp'),
    key: r.opt('record key', r.blob),
    headers: getHeaders(r),
    payload: r.blob('record payload'),
    skippedBefore: r.opt('skipped_before', r.u64),
  };
}

function getDeadLetter(r) {
  return {
    offset: r.u64('dead letter offset'),
    attempts: r.u32('dead letter attempts'),
    atMs: r.u64n('dead letter at_ms'),
    reason: r.opt('dead letter reason', r.str),
    byConsumer: r.bool('dead letter by_consumer'),
  };
}

function getGroupInfo(r) {
  const info = {
    group: r.str('group'),
    position: r.u64('position'),
    endOffset: r.u64('end_offset'),
    startOffset: r.u64('start_offset'),
    inFlight: r.u32('in_flight'),
    owed: r.u32('owed'),
    delayed: r.u32('delayed'),
    deadLetters: r.u32('dead_letters'),
    oldestInFlightAgeMs: r.opt('oldest_in_flight_age_ms', r.u64n),
    oldestOwedAgeMs: r.opt('oldest_owed_age_ms', r.u64n),
    lastActiveMs: r.opt('last_active_ms', r.u64n),
  };
  // Retention settles what it removed, unread: not counted.
  const from = info.position > info.startOffset ? info.position : info.startOffset;
  info.lag = info.endOffset > from ? info.endOffset - from : 0n;
  return info;
}

/** Response decoders by response opcode; each returns `{type, ...fields}`. */
const RESPONSES = new Map([
  [0x01, (r) => ({
    type: 'hello_ok',
    version: r.u16('version'),
    features: r.u64('features'),
    cores: r.u32('cores'),
    core: r.u32('core'),
    maxFrameBytes: r.u32('max_frame_bytes'),
    broker: r.str('broker'),
  })],
  [0x02, () => ({ type: 'pong' })],
  [0x03, () => ({ type: 'ok' })],
  [0x10, (r) => {
    // A `Stream` answer (not a `Streams` entry) may end with the stream's
    // incarnation (STREAM_INCARNATION); absent, the stream has none.
    const info = getStreamInfo(r);
    info.incarnation = r.trailingU64('incarnation');
    return { type: 'stream', info };
  }],
  [0x11, (r) => ({ type: 'streams', infos: r.vec('streams', MIN_STREAM_INFO, getStreamInfo) })],
  [0x12, (r) => ({ type: 'shard', info: getShardInfo(r) })],
  [0x13, (r) => ({ type: 'replica', info: getReplicaInfo(r) })],
  [0x14, (r) => ({ type: 'cluster', info: getClusterInfo(r) })],
  [0x20, (r) => ({
    type: 'published',
    shard: r.u32('shard'),
    baseOffset: r.u64('base_offset'),
    count: r.u32('count'),
  })],
  [0x21, (r) => ({
    type: 'records',
    startOffset: r.u64('start_offset'),
    nextOffset: r.u64('next_offset'),
    endOffset: r.u64('end_offset'),
    records: r.vec('records', MIN_RECORD, getRecord),
  })],
  [0x30, (r) => ({ type: 'group_records', records: r.vec('records', MIN_GROUP_RECORD, getGroupRecord) })],
  [0x31, (r) => ({ type: 'extended', standsMs: r.u64n('stands_ms') })],
  [0x32, (r) => ({ type: 'dead_letters', letters: r.vec('dead letters', MIN_DEAD_LETTER, getDeadLetter) })],
  [0x33, (r) => ({
    type: 'dead_letter_page',
    letters: r.vec('dead letters', MIN_DEAD_LETTER, getDeadLetter),
    next: r.opt('next', r.u64),
  })],
  [0x40, (r) => ({ type: 'group', info: getGroupInfo(r) })],
  [0x41, (r) => ({ type: 'groups', names: r.vec('group names', 2, (g) => g.str('group name')) })],
  [0xff, (r) => {
    const e = {
      type: 'error',
      code: r.u16('error code'),
      message: r.str('error message'),
      core: r.opt('error core', r.u32),
    };
    // A not_leader error (from a broker in a cluster) names the leader's
    // client address after the core.
    if (e.code === 10) e.leader = r.opt('error leader', r.str);
    // Trailing, only when set (and negotiated): one byte, 1.
    if (r.remaining() > 0) {
      if (r.u8('error not_applied') !== 1) throw new DecodeError('invalid error not_applied');
      e.notApplied = true;
    }
    return e;
  }],
]);

/**
 * Decode a response body.
 * @param {number} opcode
 * @param {Buffer} body
 * @returns {{type: string} & Record<string, any>}
 * @throws {DecodeError}
 */
function decodeResponse(opcode, body) {
  const decode = RESPONSES.get(opcode);
  if (!decode) throw new DecodeError(`unknown response opcode 0x${opcode.toString(16)}`);
  const r = new Reader(body);
  const msg = decode(r);
  r.finish();
  return msg;
}

/**
 * Incremental frame splitter for bytes from the broker. `push` returns the
 * complete frames; a length over `maxFrameBytes` or under the header size
 * throws `DecodeError` before anything of that frame is buffered.
 */
class FrameParser {
  /** @param {number} maxFrameBytes */
  constructor(maxFrameBytes) {
    this.maxFrameBytes = maxFrameBytes;
    /** @type {Buffer[]} */
    this.chunks = [];
    this.size = 0;
  }

  /**
   * @param {Buffer} chunk
   * @returns {Array<{kind: number, opcode: number, flags: number, requestId: bigint, body: Buffer}>}
   * @throws {DecodeError} on a fatal framing error
   */
  push(chunk) {
    this.chunks.push(chunk);
    this.size += chunk.length;
    const frames = [];
    for (;;) {
      if (this.size < 4) return frames;
      const len = this.peek(4).readUInt32LE(0);
      if (len > this.maxFrameBytes) {
        throw new DecodeError(`frame declares ${len} bytes, over the limit of ${this.maxFrameBytes}`);
      }
      if (len < HEADER_AFTER_LEN) throw new DecodeError(`invalid frame length ${len}`);
      if (this.size < 4 + len) return frames;
      const frame = this.take(4 + len);
      frames.push({
        kind: frame[4],
        opcode: frame[5],
        flags: frame.readUInt16LE(6),
        requestId: frame.readBigUInt64LE(8),
        body: frame.subarray(FRAME_HEADER_BYTES),
      });
    }
  }

  /** The first `n` buffered bytes (merging chunks if they are split). */
  peek(n) {
    if (this.chunks[0].length < n) this.chunks = [Buffer.concat(this.chunks)];
    return this.chunks[0];
  }

  take(n) {
    const head = this.peek(n);
    const out = head.subarray(0, n);
    if (head.length === n) this.chunks.shift();
    else this.chunks[0] = head.subarray(n);
    this.size -= n;
    return out;
  }
}

module.exports = {
  PROTOCOL_VERSION,
  FRAME_HEADER_BYTES,
  HEADER_AFTER_LEN,
  KIND_REQUEST,
  KIND_RESPONSE,
  MAX_ITEMS_PER_VEC,
  U64_MAX,
  MAX_INCARNATION,
  FEATURES,
  FEATURES_ALL,
  OP,
  ACK,
  DecodeError,
  Writer,
  Reader,
  encodeRequest,
  putStreamRef,
  putGroupKey,
  putStartPosition,
  putRecordIn,
  decodeResponse,
  FrameParser,
};
