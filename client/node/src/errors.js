'use strict';

/**
 * Error classes. Every error a client call rejects with is a `FelixError`
 * whose `code` is the broker's snake_case error name (`not_found`,
 * `stale_claim`, ...) for a refusal from the broker, or one of
 * `invalid_argument`, `unsupported`, `timeout`, `disconnected`, `protocol`,
 * `io` for an error raised on the client side.
 * @module felix-client/errors
 */

/** Base class of every error the client raises. */
class FelixError extends Error {
  /**
   * @param {string} code snake_case error name
   * @param {string} message human-readable detail (not meant to be parsed)
   * @param {{cause?: unknown}} [options]
   */
  constructor(code, message, options) {
    super(message, options);
    this.name = new.target.name;
    /** @type {string} */
    this.code = code;
    /**
     * True when the request certainly did nothing, so that sending it again
     * cannot apply it twice: the broker refused it before doing any of it
     * and said so (a publish refused so stored none of its records: the
     * disk nearly full, the broker stopping, a `not_leader`), or a call the
     * client refused before sending. False: the outcome is not known from
     * the error alone (a lost connection, a timeout, a shard stopped while
     * writing).
     * @type {boolean}
     */
    this.notApplied = false;
  }
}

/**
 * A refusal from the broker (an `Error` answer). `wireCode` is the number
 * on the wire; `core` is set on `wrong_core` answers.
 */
class ServerError extends FelixError {
  /**
   * @param {string} code
   * @param {number} wireCode
   * @param {string} message
   * @param {number} [core]
   */
  constructor(code, wireCode, message, core) {
    super(code, message);
    /** @type {number} */
    this.wireCode = wireCode;
    /** @type {number|undefined} */
    this.core = core;
  }
}

/** Defines a `ServerError` subclass for one wire code. */
function serverErrorClass(name, code, wireCode) {
  const cls = {
    [name]: class extends ServerError {
      /**
       * @param {string} message
       * @param {number} [core]
       * @param {number} [rawCode] the number received, when it is not `wireCode`
       */
      constructor(message, core, rawCode) {
        super(code, rawCode ?? wireCode, message, core);
      }
    },
  }[name];
  cls.WIRE_CODE = wireCode;
  return cls;
}

/** `invalid_request` (1): malformed request or arguments the broker refuses. */
const InvalidRequestError = serverErrorClass('InvalidRequestError', 'invalid_request', 1);
/** `not_found` (2): stream, shard, group or record does not exist. */
const NotFoundError = serverErrorClass('NotFoundError', 'not_found', 2);
/** `already_exists` (3): stream or group already exists. */
const AlreadyExistsError = serverErrorClass('AlreadyExistsError', 'already_exists', 3);
/** `wrong_core` (4): the shard is owned by another core (`core` names it). */
const WrongCoreError = serverErrorClass('WrongCoreError', 'wrong_core', 4);
/** `too_large` (6): frame, record or batch over a limit. */
const TooLargeError = serverErrorClass('TooLargeError', 'too_large', 6);
/** `unavailable` (7): the broker cannot serve now (shutting down, shard stopped). */
const UnavailableError = serverErrorClass('UnavailableError', 'unavailable', 7);
/** `unauthorized` (8): missing or bad credentials, or no permission for the call. */
const UnauthorizedError = serverErrorClass('UnauthorizedError', 'unauthorized', 8);
/** `stale_claim` (9): the named group claim is no longer held by this delivery. */
const StaleClaimError = serverErrorClass('StaleClaimError', 'stale_claim', 9);
/**
 * `not_leader` (10): this broker (in a cluster) does not lead the shard.
 * `leader` is the client address of the broker that does, when the
 * answering broker knows it (none while a leader is being elected).
 * Nothing was applied. `ClusterClient` follows it.
 */
class NotLeaderError extends ServerError {
  /**
   * @param {string} message
   * @param {string} [leader] the leader's client address, `host:port`
   */
  constructor(message, leader) {
    super('not_leader', NotLeaderError.WIRE_CODE, message, undefined);
    /** @type {string|undefined} */
    this.leader = leader;
  }
}
NotLeaderError.WIRE_CODE = 10;
/** `internal` (11): broker bug or I/O failure; also every code this client does not know. */
const InternalError = serverErrorClass('InternalError', 'internal', 11);
/** `busy` (12): overloaded; back off and retry. */
const BusyError = serverErrorClass('BusyError', 'busy', 12);

/**
 * `unsupported`: the broker answered code 5 (unknown opcode, version, or a
 * feature not negotiated; `wireCode` is 5), or the client refused on its own
 * side: `local` is true when it refused to send a call or field the broker
 * did not advertise (nothing was sent). A refusal of the client's own has
 * no `wireCode`.
 */
class UnsupportedError extends ServerError {
  /**
   * @param {string} message
   * @param {{local?: boolean, wireCode?: number}} [options] `wireCode` only for the broker's answer
   */
  constructor(message, options = {}) {
    super('unsupported', options.wireCode, message, undefined);
    /** True when refused by the client before anything was sent. */
    this.local = options.local === true;
    this.notApplied = this.local;
  }
}
UnsupportedError.WIRE_CODE = 5;

/** The call's arguments were refused before anything was sent. */
class InvalidArgumentError extends FelixError {
  /** @param {string} message */
  constructor(message) {
    super('invalid_argument', message);
    this.notApplied = true;
  }
}

/**
 * No answer within the request timeout (plus any wait the request asked the
 * broker for), or no connection within the connect timeout. The request may
 * or may not have been applied.
 */
class TimeoutError extends FelixError {
  /** @param {string} message */
  constructor(message) {
    super('timeout', message);
  }
}

/**
 * The connection was lost (or the client closed) before the answer arrived.
 * The request may or may not have been applied; it is not resent.
 */
class DisconnectedError extends FelixError {
  /** @param {string} message @param {{cause?: unknown}} [options] */
  constructor(message, options) {
    super('disconnected', message, options);
  }
}

/**
 * The broker sent bytes this client cannot make sense of. An answer whose
 * frame header is intact but whose body does not decode fails only the call
 * it answers (the connection is kept); a broken frame header drops the
 * connection and fails every call in flight on it.
 */
class ProtocolError extends FelixError {
  /** @param {string} message */
  constructor(message) {
    super('protocol', message);
  }
}

/**
 * Connecting to the broker failed (refused, unreachable, closed during
 * HELLO). The request that needed the connection was never sent
 * (`notApplied`).
 */
class ConnectionError extends FelixError {
  /** @param {string} message @param {{cause?: unknown}} [options] */
  constructor(message, options) {
    super('io', message, options);
    this.notApplied = true;
  }
}

const BY_WIRE_CODE = new Map(
  [
    InvalidRequestError, NotFoundError, AlreadyExistsError, WrongCoreError, UnsupportedError,
    TooLargeError, UnavailableError, UnauthorizedError, StaleClaimError, NotLeaderError,
    InternalError, BusyError,
  ].map((cls) => [cls.WIRE_CODE, cls]),
);

/**
 * The typed error for an `Error` answer. An unknown code becomes an
 * `InternalError` that keeps the number (`wireCode`) and says it in the message.
 * @param {number} code
 * @param {string} message
 * @param {number|undefined} core
 * @param {string} [leader] a `not_leader` answer's leader address
 * @returns {ServerError}
 */
function errorFromWire(code, message, core, leader, notApplied) {
  const cls = BY_WIRE_CODE.get(code);
  let e;
  if (cls === UnsupportedError) e = new UnsupportedError(message, { wireCode: UnsupportedError.WIRE_CODE });
  else if (cls === NotLeaderError) e = new NotLeaderError(message, leader);
  else if (cls) e = new cls(message, core);
  else e = new InternalError(`unknown error code ${code}: ${message}`, core, code);
  e.notApplied = notApplied === true;
  return e;
}

module.exports = {
  FelixError,
  ServerError,
  InvalidRequestError,
  NotFoundError,
  AlreadyExistsError,
  WrongCoreError,
  UnsupportedError,
  TooLargeError,
  UnavailableError,
  UnauthorizedError,
  StaleClaimError,
  NotLeaderError,
  InternalError,
  BusyError,
  InvalidArgumentError,
  TimeoutError,
  DisconnectedError,
  ProtocolError,
  ConnectionError,
  errorFromWire,
};
