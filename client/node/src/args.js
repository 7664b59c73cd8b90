'use strict';

/**
 * Argument checks and conversions for client calls. Each throws
 * `InvalidArgumentError` naming the argument; nothing is sent for a call
 * whose arguments fail. Name rules themselves (characters, length) belong
 * to the broker, which answers `invalid_request`.
 * @module felix-client/args
 */

const { InvalidArgumentError } = require('./errors');
const { MAX_INCARNATION, U64_MAX } = require('./wire');

const U32_MAX = 0xffffffff;
/** Longest group member name, in bytes. */
const MAX_MEMBER_NAME_BYTES = 128;
/** Longest string a `str` field can carry, in bytes. */
const MAX_STR_BYTES = 0xffff;

function describe(v) {
  if (typeof v === 'string') return JSON.stringify(v);
  if (typeof v === 'bigint') return `${v}n`;
  return String(v);
}

/**
 * An options object whose keys are all in `known`: a typo such as `waitMS`
 * is refused rather than quietly left at its default.
 */
function options(v, known, what) {
  if (v === null || typeof v !== 'object') {
    throw new InvalidArgumentError(`${what} must be an object, not ${describe(v)}`);
  }
  for (const key of Object.keys(v)) {
    if (!known.includes(key)) {
      throw new InvalidArgumentError(`unknown ${what} key ${JSON.stringify(key)}; the keys are ${known.join(', ')}`);
    }
  }
  return v;
}

/** A non-empty string that fits a `str` field. */
function name(v, what) {
  if (typeof v !== 'string' || v.length === 0) {
    throw new InvalidArgumentError(`${what} must be a non-empty string, not ${describe(v)}`);
  }
  if (Buffer.byteLength(v, 'utf8') > MAX_STR_BYTES) {
    throw new InvalidArgumentError(`${what} is over ${MAX_STR_BYTES} bytes`);
  }
  return v;
}

/**
 * A stream as `"tenant/namespace/stream"` or `{tenant, namespace, stream}`.
 * @returns {{tenant: string, namespace: string, stream: string}}
 */
function streamRef(v) {
  if (typeof v === 'string') {
    const parts = v.split('/');
    if (parts.length !== 3 || parts.some((p) => p.length === 0)) {
      throw new InvalidArgumentError(`stream path ${describe(v)} must be tenant/namespace/stream`);
    }
    return { tenant: parts[0], namespace: parts[1], stream: parts[2] };
  }
  if (v === null || typeof v !== 'object') {
    throw new InvalidArgumentError(`stream must be "tenant/namespace/stream" or {tenant, namespace, stream}, not ${describe(v)}`);
  }
  return {
    tenant: name(v.tenant, 'tenant'),
    namespace: name(v.namespace, 'namespace'),
    stream: name(v.stream, 'stream'),
  };
}

/** An integer in `[min, U32_MAX]`, given as a number. */
function u32(v, what, min = 0) {
  if (!Number.isInteger(v) || v < min || v > U32_MAX) {
    throw new InvalidArgumentError(`${what} must be an integer from ${min} to ${U32_MAX}, not ${describe(v)}`);
  }
  return v;
}

/**
 * A u64 given as a bigint or a non-negative safe integer number.
 * @returns {bigint}
 */
function u64(v, what) {
  if (typeof v === 'number') {
    if (!Number.isSafeInteger(v) || v < 0) {
      throw new InvalidArgumentError(`${what} must be a non-negative integer (use a bigint past 2^53), not ${describe(v)}`);
    }
    return BigInt(v);
  }
  if (typeof v !== 'bigint' || v < 0n || v > U64_MAX) {
    throw new InvalidArgumentError(`${what} must be a bigint from 0 to 2^64-1 or a non-negative integer, not ${describe(v)}`);
  }
  return v;
}

/** A stream incarnation: 1 to 2^63-1 (what a broker stores), as a bigint. */
function incarnation(v, what = 'incarnation') {
  const i = u64(v, what);
  if (i === 0n || i > MAX_INCARNATION) {
    throw new InvalidArgumentError(`${what} must be from 1 to 2^63-1, not ${describe(v)}`);
  }
  return i;
}

/** An offset (u64) as a bigint. */
function offset(v, what = 'offset') {
  return u64(v, what);
}

/**
 * Milliseconds as a non-negative finite number; a fraction rounds up so a
 * sub-millisecond duration does not become zero.
 * @returns {number}
 */
function millis(v, what) {
  if (typeof v !== 'number' || !Number.isFinite(v) || v < 0) {
    throw new InvalidArgumentError(`${what} must be a non-negative number of milliseconds, not ${describe(v)}`);
  }
  return Math.ceil(v);
}

/** Milliseconds for a `u32` field (a wait): saturates at the field's maximum. */
function millisU32(v, what) {
  return Math.min(millis(v, what), U32_MAX);
}

/** Milliseconds for a `u64` field, more than zero. @returns {bigint} */
function positiveMillisU64(v, what) {
  const ms = millis(v, what);
  if (ms === 0) throw new InvalidArgumentError(`${what} must be more than zero`);
  return BigInt(Math.min(ms, Number.MAX_SAFE_INTEGER));
}

/**
 * A start position: `'earliest'`, `'latest'` or an offset.
 * @returns {'earliest'|'latest'|bigint}
 */
function startPosition(v, what = 'start position') {
  if (v === 'earliest' || v === 'latest') return v;
  if (typeof v === 'number' || typeof v === 'bigint') return offset(v, what);
  throw new InvalidArgumentError(`${what} must be 'earliest', 'latest' or an offset, not ${describe(v)}`);
}

/** Bytes from a Buffer, a Uint8Array or a string (UTF-8). @returns {Buffer} */
function bytes(v, what) {
  if (Buffer.isBuffer(v)) return v;
  if (v instanceof Uint8Array) return Buffer.from(v.buffer, v.byteOffset, v.byteLength);
  if (typeof v === 'string') return Buffer.from(v, 'utf8');
  throw new InvalidArgumentError(`${what} must be a Buffer, Uint8Array or string, not ${describe(v)}`);
}

/** Headers as `[[name, value], ...]` or `{name: value}`. @returns {Array<[string, Buffer]>} */
function headers(v) {
  if (v === undefined) return [];
  const pairs = Array.isArray(v) ? v : Object.entries(v ?? {});
  return pairs.map((pair, i) => {
    if (!Array.isArray(pair) || pair.length !== 2) {
      throw new InvalidArgumentError(`header ${i} must be a [name, value] pair`);
    }
    if (typeof pair[0] !== 'string' || Buffer.byteLength(pair[0], 'utf8') > MAX_STR_BYTES) {
      throw new InvalidArgumentError(`header ${i} name must be a string of at most ${MAX_STR_BYTES} bytes`);
    }
    return [pair[0], bytes(pair[1], `header ${describe(pair[0])} value`)];
  });
}

/**
 * A record to publish: a payload (Buffer, Uint8Array, string) or
 * `{payload, key?, headers?, timestampMs?}`.
 */
function recordIn(v, i) {
  const what = `record ${i}`;
  if (typeof v === 'string' || v instanceof Uint8Array) return { key: undefined, headers: [], payload: bytes(v, `${what} payload`) };
  if (v === null || typeof v !== 'object') {
    throw new InvalidArgumentError(`${what} must be a payload or {payload, key?, headers?, timestampMs?}, not ${describe(v)}`);
  }
  return {
    timestampMs: v.timestampMs === undefined ? undefined : u64(v.timestampMs, `${what} timestampMs`),
    key: v.key === undefined ? undefined : bytes(v.key, `${what} key`),
    headers: headers(v.headers),
    payload: bytes(v.payload, `${what} payload`),
  };
}

/** A non-empty array of records to publish. */
function records(v) {
  if (!Array.isArray(v) || v.length === 0) {
    throw new InvalidArgumentError('a publish needs a non-empty array of records');
  }
  return v.map(recordIn);
}

/** A group member name, 1 to 128 bytes. */
function memberName(v) {
  const len = typeof v === 'string' ? Buffer.byteLength(v, 'utf8') : -1;
  if (len < 1 || len > MAX_MEMBER_NAME_BYTES) {
    throw new InvalidArgumentError(`a group consumer name is a string of 1 to ${MAX_MEMBER_NAME_BYTES} bytes, not ${describe(v)}`);
  }
  return v;
}

/** A delivered record, as given back to nack/extend/dead-letter: its offset and attempts. */
function claim(v) {
  if (v === null || typeof v !== 'object') {
    throw new InvalidArgumentError(`expected a delivered group record ({offset, attempts}), not ${describe(v)}`);
  }
  return { offset: offset(v.offset, 'record.offset'), attempts: u32(v.attempts, 'record.attempts') };
}

/** An optional free-text reason. */
function reason(v) {
  if (v === undefined) return undefined;
  if (typeof v !== 'string') throw new InvalidArgumentError(`reason must be a string, not ${describe(v)}`);
  return v;
}

module.exports = {
  options,
  MAX_MEMBER_NAME_BYTES,
  name,
  streamRef,
  u32,
  u64,
  incarnation,
  offset,
  millis,
  millisU32,
  positiveMillisU64,
  startPosition,
  bytes,
  records,
  memberName,
  claim,
  reason,
};
